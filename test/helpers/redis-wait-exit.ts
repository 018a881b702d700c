/**
 * Runs test/fixtures/redis-wait-exit.ts (wait mode on RedisStorage, then everything closed) as a
 * process of its own, and says whether that process ended by itself once it had closed.
 */
import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import { bundle } from './bundle.js'

const fixture = fileURLToPath(new URL('../fixtures/redis-wait-exit.ts', import.meta.url))
let program: Promise<string> | undefined

export interface ExitRun {
  /** What the program printed. */
  stdout: string
  stderr: string
  /** Its exit code; `null` when it had to be killed. */
  code: number | null
  /** It printed CLOSED and then ended without being killed. */
  exitedByItself: boolean
}

/**
 * The program with `env`; killed `graceMs` after it printed CLOSED if it has not ended by then (a
 * process that ends by itself does so at once: nothing is left to run), or after `limitMs` in all.
 */
export async function runWaitExit (env: Record<string, string>, graceMs = 10_000, limitMs = 60_000): Promise<ExitRun> {
  const path = await (program ??= bundle(fixture, fileURLToPath(new URL('../../.tmp/bundles', import.meta.url))))
  const child = spawn(process.execPath, [path], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  let stdout = ''
  let stderr = ''
  let killed = false
  const kill = (): void => { killed = true; child.kill('SIGKILL') }
  const limit = setTimeout(kill, limitMs)
  let grace: NodeJS.Timeout | undefined
  child.stdout.on('data', (chunk: Buffer) => {
    stdout += chunk.toString()
    if (grace === undefined && stdout.includes('CLOSED\n')) grace = setTimeout(kill, graceMs)
  })
  child.stderr.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
  const code = await new Promise<number | null>((resolve) => child.once('close', resolve))
  clearTimeout(limit)
  clearTimeout(grace)
  return { stdout, stderr, code, exitedByItself: !killed && stdout.includes('CLOSED\n') }
}
