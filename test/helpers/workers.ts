/**
 * Worker processes for the recipes' tests (test/fixtures/recipes/): a consumer, a job worker or an
 * app instance, started as plain node from its bundle, that says what it does on stdout, one word
 * and its arguments a line (`READY`, `HANGING <key>`, `ACK <id>`...), and takes commands on stdin.
 * Tests wait for those lines instead of sleeping, and kill the process with SIGKILL to crash it.
 * The recipe a worker imports from examples/recipes/ is the one docs/jobs.md shows (recipes.ts).
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { bundle } from './bundle.js'
import { scaled } from './pace.js'
import { documentedRecipes } from './recipes.js'

const bundles = fileURLToPath(new URL('../../.tmp/bundles', import.meta.url))
const programs = new Map<string, Promise<string>>()
const started = new Set<Worker>()

/** How long a worker may take to say something a test waits for, on a busy machine. */
const LINE_LIMIT_MS = scaled(20_000)

export interface Worker {
  readonly pid: number
  /** Every line it has written to stdout so far. */
  readonly lines: string[]
  /** The first line (already written or still to come) that starts with `prefix`; rejects if it exits first. */
  line: (prefix: string, limitMs?: number) => Promise<string>
  /** Write a command line to its stdin. */
  send: (line: string) => void
  kill: (signal?: NodeJS.Signals) => Promise<void>
}

/** Start `fixture` (a path under test/fixtures/recipes/) with `env`, and wait for its `READY`. */
export async function startWorker (fixture: string, env: Record<string, string>): Promise<Worker> {
  const entry = fileURLToPath(new URL(`../fixtures/recipes/${fixture}`, import.meta.url))
  let program = programs.get(entry)
  if (program === undefined) programs.set(entry, program = bundle(entry, bundles, [documentedRecipes]))
  const child: ChildProcess = spawn(process.execPath, [await program], { env: { ...process.env, ...env }, stdio: ['pipe', 'pipe', 'pipe'] })
  const lines: string[] = []
  let stderr = ''
  const waiters: Array<{ prefix: string, resolve: (line: string) => void }> = []
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  child.stderr!.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
  createInterface({ input: child.stdout! }).on('line', (line) => {
    lines.push(line)
    for (const waiter of waiters.filter((w) => line.startsWith(w.prefix))) {
      waiters.splice(waiters.indexOf(waiter), 1)
      waiter.resolve(line)
    }
  })
  const worker: Worker = {
    pid: child.pid!,
    lines,
    line: (prefix, limitMs = LINE_LIMIT_MS) => {
      const seen = lines.find((line) => line.startsWith(prefix))
      if (seen !== undefined) return Promise.resolve(seen)
      return new Promise<string>((resolve, reject) => {
        const fail = (why: string) => reject(new Error(`${fixture} (pid ${child.pid}) ${why} before writing "${prefix}…"; it wrote:\n${lines.join('\n')}\nstderr:\n${stderr}`))
        const timer = setTimeout(() => fail(`took more than ${limitMs} ms`), limitMs)
        void exited.then(() => { clearTimeout(timer); fail(`exited (${child.exitCode ?? child.signalCode})`) })
        waiters.push({ prefix, resolve: (line) => { clearTimeout(timer); resolve(line) } })
      })
    },
    send: (line) => { child.stdin!.write(`${line}\n`) },
    kill: async (signal = 'SIGTERM') => {
      if (child.exitCode === null && child.signalCode === null) child.kill(signal)
      await exited
      started.delete(worker)
    }
  }
  started.add(worker)
  await worker.line('READY')
  return worker
}

/** Kill every worker still running: for a test file's afterAll (or a test that failed half-way). */
export async function killWorkers (): Promise<void> {
  await Promise.all([...started].map((worker) => worker.kill('SIGKILL')))
}
