/**
 * `npm run bench:instructions`: instructions per request of the server process (and of Redis, for
 * the Redis scenarios), counted by callgrind, which counts the same whatever else the machine does.
 *
 * Per scenario, workload and repeat: a fresh server (bench/server.ts) under
 * `valgrind --tool=callgrind --instr-atstart=no --smc-check=all-non-file`, and for a Redis scenario
 * a private redis-server under callgrind on a free port (never the shared one). The server is
 * warmed with --warmup requests of the workload (JIT compilation settles), collection is switched
 * on in both processes (`callgrind_control -i on`), --requests requests are sent over
 * --connections keep-alive connections (autocannon, an exact count), collection is switched off
 * and the counts dumped. The dump's total is split into JIT compilation, major GC, minor GC and
 * the rest by function name (bench/callgrind.ts); "core" is the total less compilation and major
 * GC, and Redis's core leaves out its timer, `serverCron`.
 *
 * Writes bench/results/instructions.json and instructions.md, and the section "Instructions per
 * request" of docs/benchmarks.md (not for a subset of scenarios or workloads). See bench/README.md.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process'
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { createServer } from 'node:net'
import { cpus, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs, promisify } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import autocannon from 'autocannon'
import { Redis } from 'ioredis'
import { attributeFile } from './callgrind.js'
import { REPO_ROOT, ServerProcess } from './processes.js'
import { runIssues } from './report.js'
import { scenario as scenarioInfo, type Workload } from './scenarios/index.js'
import { workloadRequests } from './workloads.js'
import {
  instructionsSection, instructionsTable, instructionTargets, spliceSection, summarizeInstructions, targetsTable,
  type InstructionResults, type InstructionRun
} from './instructions-report.js'

const run = promisify(execFile)
const RESULTS_DIR = join(REPO_ROOT, 'bench', 'results')
const DOCS_PAGE = join(REPO_ROOT, 'docs', 'benchmarks.md')

/**
 * The default set: the bare route, the in-process floor, memory (plain and sealed), PostgreSQL and
 * its floor, the Redis floor, ours on ioredis and node-redis, and the peer.
 */
const DEFAULT_SCENARIOS = ['bare', 'memory-floor', 'memory', 'memory-sealed', 'pg-floor', 'knex-pg', 'redis-floor', 'redis', 'redis-node-redis', 'node-idem-redis']
const DEFAULT_WORKLOADS: Workload[] = ['REPLAY', 'NEW']
/** The bare route does the same for a replayed key as for a fresh one: NEW only. */
const ONLY_NEW = new Set(['bare'])

const { values: args } = parseArgs({
  options: {
    scenarios: { type: 'string' },
    workloads: { type: 'string' },
    repeats: { type: 'string' },
    warmup: { type: 'string' },
    requests: { type: 'string' },
    connections: { type: 'string' },
    jobs: { type: 'string' },
    dist: { type: 'boolean', default: false },
    keep: { type: 'string' },
    'no-docs': { type: 'boolean', default: false },
    'report-only': { type: 'boolean', default: false },
    help: { type: 'boolean', default: false }
  }
})

if (args.help) {
  console.log(`npm run bench:instructions -- [options]
  --scenarios a,b     scenarios (default ${DEFAULT_SCENARIOS.join(',')}; any of bench/scenarios/index.ts)
  --workloads R,N     REPLAY and/or NEW (default both; the bare route runs NEW only)
  --repeats N         fresh server processes per scenario and workload (3)
  --warmup N          warm-up requests before the window (10000)
  --requests N        requests in the measured window (3000)
  --connections N     keep-alive connections (8)
  --jobs N            runs at a time (1); callgrind counts do not depend on it, only the wall time does
  --dist              load the plugin from dist/ (npm run build first)
  --keep DIR          keep the callgrind dumps in DIR (callgrind_annotate --inclusive=yes DIR/<file>)
  --no-docs           do not rewrite the section of docs/benchmarks.md
  --report-only       rebuild instructions.md and the docs section from bench/results/instructions.json
                      (written after every run, so a run cut short keeps what it measured)
Needs valgrind (callgrind_control) and redis-server on the PATH.`)
  process.exit(0)
}

function int (value: string | undefined, fallback: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isInteger(n) || n <= 0) throw new Error(`expected a positive integer, got ${value}`)
  return n
}

const scenarios = args.scenarios?.split(',') ?? DEFAULT_SCENARIOS
const workloads = (args.workloads?.split(',').map((w) => w.toUpperCase()) ?? DEFAULT_WORKLOADS) as Workload[]
for (const w of workloads) if (w !== 'REPLAY' && w !== 'NEW') throw new Error(`workload ${w}: only REPLAY and NEW`)
for (const s of scenarios) scenarioInfo(s)
const settings = {
  warmupRequests: int(args.warmup, 10_000),
  requests: int(args.requests, 3000),
  connections: int(args.connections, 8),
  repeats: int(args.repeats, 3),
  source: args.dist ? 'dist' as const : 'lib' as const,
  jobs: int(args.jobs, 1)
}
const fullSet = args.scenarios === undefined && args.workloads === undefined
const runId = `i${Date.now().toString(36)}`
const started = Date.now()

function log (line: string): void {
  const s = Math.round((Date.now() - started) / 1000)
  console.log(`[${Math.floor(s / 60)}:${String(s % 60).padStart(2, '0')}] ${line}`)
}

const CALLGRIND = ['valgrind', '-q', '--tool=callgrind', '--instr-atstart=no', '--smc-check=all-non-file']

async function callgrindControl (pid: number, ...command: string[]): Promise<void> {
  await run('callgrind_control', [...command, String(pid)], { timeout: 120_000 })
}

/** The newest dump callgrind wrote for `pid` in `dir` (`<name>.<pid>.<n>`), once it is complete. */
function latestDump (dir: string, name: string, pid: number): string {
  const prefix = `${name}.${pid}.`
  const files = readdirSync(dir).filter((f) => f.startsWith(prefix)).sort((a, b) => Number(a.slice(prefix.length)) - Number(b.slice(prefix.length)))
  const file = files.at(-1)
  if (file === undefined) throw new Error(`no callgrind dump of ${name} (pid ${pid}) in ${dir}`)
  const path = join(dir, file)
  if (!/^totals: \d+/m.test(readFileSync(path, 'utf8'))) throw new Error(`callgrind dump ${path} is incomplete`)
  return path
}

async function freePort (): Promise<number> {
  return await new Promise((resolve, reject) => {
    const server = createServer()
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      const address = server.address()
      server.close(() => { typeof address === 'object' && address !== null ? resolve(address.port) : reject(new Error('no port')) })
    })
  })
}

function exited (child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => child.once('exit', () => resolve()))
}

/** A private redis-server under callgrind, on a free loopback port, with nothing saved. */
async function startRedis (dir: string): Promise<{ port: number, pid: number, stop: () => Promise<void> }> {
  const port = await freePort()
  const child = spawn(CALLGRIND[0]!, [...CALLGRIND.slice(1), `--callgrind-out-file=${join(dir, 'redis.%p')}`,
    'redis-server', '--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: ['ignore', 'ignore', 'pipe'] })
  let stderr = ''
  child.stderr!.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
  // Poll until it answers (valgrind takes a few seconds to start it).
  const deadline = Date.now() + 120_000
  for (;;) {
    const client = new Redis({ port, host: '127.0.0.1', lazyConnect: true, retryStrategy: () => null, maxRetriesPerRequest: 0 })
    client.on('error', () => {})
    try {
      await client.connect()
      await client.ping()
      break
    } catch (error) {
      if (child.exitCode !== null || Date.now() > deadline) {
        child.kill('SIGKILL')
        throw new Error(`private redis-server did not start: ${String(error)}\n${stderr.slice(-2000)}`)
      }
      await sleep(200)
    } finally {
      client.disconnect()
    }
  }
  return {
    port,
    pid: child.pid!,
    stop: async () => {
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), 30_000)
      await exited(child)
      clearTimeout(timer)
    }
  }
}

async function send (url: string, workload: Workload, tag: string, unique: string, amount: number): Promise<autocannon.Result> {
  return await autocannon({
    url,
    connections: settings.connections,
    pipelining: 1,
    amount,
    timeout: 120,
    requests: workloadRequests(workload, tag, unique)
  })
}

function statusCounts (result: autocannon.Result): Record<string, number> {
  const counts: Record<string, number> = {}
  for (const [code, stat] of Object.entries(result.statusCodeStats ?? {})) counts[code] = (counts[code] ?? 0) + (stat.count ?? 0)
  return counts
}

async function measureOnce (name: string, workload: Workload, repeat: number): Promise<InstructionRun> {
  const info = scenarioInfo(name)
  const t0 = Date.now()
  const dir = mkdtempSync(join(tmpdir(), 'fastify-idempotency-instructions-'))
  const tag = `${runId}-${name}-${workload}-${repeat}`
  let redis: Awaited<ReturnType<typeof startRedis>> | null = null
  let server: ServerProcess | null = null
  try {
    if (info.store === 'redis') redis = await startRedis(dir)
    const env: NodeJS.ProcessEnv = { BENCH_TAG: tag, BENCH_SOURCE: settings.source, BENCH_TMP: dir }
    if (redis !== null) Object.assign(env, { BENCH_REDIS_HOST: '127.0.0.1', BENCH_REDIS_PORT: String(redis.port) })
    server = await ServerProcess.start(name, env, [], { wrapper: [...CALLGRIND, `--callgrind-out-file=${join(dir, 'node.%p')}`], startSeconds: 900 })
    const pid = server.pid!
    const tStarted = Date.now()
    const warm = await send(server.url, workload, tag, 'warm', settings.warmupRequests)
    if (warm.errors + warm.timeouts > 0) throw new Error(`${name} ${workload}: ${warm.errors} errors, ${warm.timeouts} timeouts in the warm-up`)
    await server.stats(true)
    const tWarm = Date.now()
    await Promise.all([callgrindControl(pid, '-i', 'on'), redis === null ? null : callgrindControl(redis.pid, '-i', 'on')])
    const result = await send(server.url, workload, tag, 'measured', settings.requests)
    const tMeasured = Date.now()
    await Promise.all([callgrindControl(pid, '-i', 'off'), redis === null ? null : callgrindControl(redis.pid, '-i', 'off')])
    await Promise.all([callgrindControl(pid, '-d'), redis === null ? null : callgrindControl(redis.pid, '-d')])
    const { stats } = await server.stats(true)
    const statusCodes = statusCounts(result)
    const answered = Object.values(statusCodes).reduce((a, b) => a + b, 0)
    const issues = runIssues(workload, info.guarded, { statusCodes, errors: result.errors, timeouts: result.timeouts, executions: stats })
    if (answered !== settings.requests) issues.push(`${answered} answers to ${settings.requests} requests`)
    const nodeDump = latestDump(dir, 'node', pid)
    const parts = attributeFile(nodeDump)
    const per = (n: number): number => Math.round(n / answered)
    const serverFigures = {
      total: per(parts.total),
      core: per(parts.total - parts.parts.compile! - parts.parts.majorGC!),
      compile: per(parts.parts.compile!),
      majorGC: per(parts.parts.majorGC!),
      minorGC: per(parts.parts.minorGC!)
    }
    let redisFigures: InstructionRun['redis'] = null
    let redisDump: string | null = null
    if (redis !== null) {
      redisDump = latestDump(dir, 'redis', redis.pid)
      const r = attributeFile(redisDump, { cron: /^serverCron$/ })
      redisFigures = { total: per(r.total), cron: per(r.parts.cron!), core: per(r.total - r.parts.cron!) }
    }
    if (args.keep !== undefined) {
      mkdirSync(args.keep, { recursive: true })
      writeFileSync(join(args.keep, `${name}-${workload}-${repeat}.node.callgrind`), readFileSync(nodeDump))
      if (redisDump !== null) writeFileSync(join(args.keep, `${name}-${workload}-${repeat}.redis.callgrind`), readFileSync(redisDump))
    }
    return { scenario: name, workload, repeat, requests: answered, server: serverFigures, redis: redisFigures, seconds: Math.round((Date.now() - t0) / 1000), phases: { start: (tStarted - t0) / 1000, warmup: (tWarm - tStarted) / 1000, window: (tMeasured - tWarm) / 1000 }, issues }
  } finally {
    await server?.close()
    await redis?.stop()
    rmSync(dir, { recursive: true, force: true })
  }
}

async function valgrindVersion (): Promise<string> {
  try {
    return (await run('valgrind', ['--version'])).stdout.trim()
  } catch {
    throw new Error('valgrind is not installed (apt-get install valgrind)')
  }
}

async function redisVersion (): Promise<string> {
  try {
    return /v=(\S+)/.exec((await run('redis-server', ['--version'])).stdout)?.[1] ?? 'unknown'
  } catch {
    return 'missing'
  }
}

function buildResults (runs: InstructionRun[], failures: string[], meta: Pick<InstructionResults, 'machine' | 'command' | 'fullSet'>): InstructionResults {
  const sorted = [...runs]
  const order = (r: InstructionRun): number => scenarios.indexOf(r.scenario) * 10 + workloads.indexOf(r.workload)
  sorted.sort((a, b) => order(a) - order(b) || a.repeat - b.repeat)
  const labels = Object.fromEntries(sorted.map((r) => [r.scenario, { label: scenarioInfo(r.scenario).label, short: scenarioInfo(r.scenario).short }]))
  const summary = summarizeInstructions(sorted, labels)
  return {
    generatedAt: new Date().toISOString(),
    ...meta,
    settings,
    elapsedSeconds: Math.round((Date.now() - started) / 1000),
    runs: sorted,
    failures,
    summary,
    targets: instructionTargets(summary)
  }
}

/** bench/results/instructions.{json,md}; with `docs`, the section of docs/benchmarks.md too. */
function writeResults (results: InstructionResults, docs: boolean): string {
  const table = instructionsTable(results) + '\n\n' + targetsTable(results.targets) + '\n'
  mkdirSync(RESULTS_DIR, { recursive: true })
  writeFileSync(join(RESULTS_DIR, 'instructions.json'), JSON.stringify(results, null, 2) + '\n')
  writeFileSync(join(RESULTS_DIR, 'instructions.md'), table)
  if (docs) writeFileSync(DOCS_PAGE, spliceSection(readFileSync(DOCS_PAGE, 'utf8'), instructionsSection(results)))
  return table
}

async function main (): Promise<void> {
  const valgrind = await valgrindVersion()
  const redis = await redisVersion()
  const loadAverageStart = loadavg()
  const tasks: Array<[string, Workload, number]> = []
  for (let repeat = 1; repeat <= settings.repeats; repeat++) {
    for (const s of scenarios) {
      if (scenarioInfo(s).store === 'redis' && redis === 'missing') throw new Error('redis-server is not installed: the Redis scenarios need a private one')
      for (const w of workloads) if (!(ONLY_NEW.has(s) && w !== 'NEW')) tasks.push([s, w, repeat])
    }
  }
  log(`${tasks.length} runs (${scenarios.join(', ')}; ${workloads.join(', ')}; ${settings.repeats} repeats), ${settings.warmupRequests} warm-up + ${settings.requests} measured requests each, ${settings.jobs} at a time`)
  const argv = process.argv.slice(2)
  const meta = () => ({
    command: `npm run bench:instructions${argv.length > 0 ? ` -- ${argv.join(' ')}` : ''}`,
    fullSet,
    machine: {
      cpuModel: cpus()[0]?.model.trim() ?? 'unknown',
      cores: cpus().length,
      node: process.version,
      platform: `${process.platform} ${process.arch}`,
      valgrind,
      redis,
      loadAverageStart,
      loadAverageEnd: loadavg()
    }
  })
  const runs: InstructionRun[] = []
  const failures: string[] = []
  let next = 0
  const worker = async (): Promise<void> => {
    while (next < tasks.length) {
      const [s, w, repeat] = tasks[next++]!
      let result: InstructionRun
      try {
        result = await measureOnce(s, w, repeat)
      } catch (error) {
        // One failed run (a server that would not start) does not end the others; it is listed.
        failures.push(`${s} ${w} #${repeat}: ${error instanceof Error ? error.message : String(error)}`)
        log(`${s} ${w} #${repeat}: FAILED: ${String(error)}`)
        continue
      }
      runs.push(result)
      const r = result.server
      log(`${s} ${w} #${repeat}: core ${r.core}, compile ${r.compile}, major GC ${r.majorGC}, minor GC ${r.minorGC}, total ${r.total}` +
        (result.redis === null ? '' : `; Redis core ${result.redis.core} (cron ${result.redis.cron})`) + ` per request; ${result.seconds} s (start ${result.phases.start} s, warm-up ${result.phases.warmup} s, window ${result.phases.window} s)` +
        (result.issues.length > 0 ? `; ISSUES: ${result.issues.join('; ')}` : ''))
      // The runs so far, so that a run cut short leaves its figures (--report-only rebuilds the rest).
      writeResults(buildResults(runs, failures, meta()), false)
    }
  }
  await Promise.all(Array.from({ length: Math.min(settings.jobs, tasks.length) }, worker))
  const docs = fullSet && !args['no-docs'] && failures.length === 0
  const table = writeResults(buildResults(runs, failures, meta()), docs)
  console.log('\n' + table)
  if (failures.length > 0) console.log(`failed runs:\n${failures.join('\n')}`)
  log(docs
    ? 'wrote bench/results/instructions.json, bench/results/instructions.md and the section "Instructions per request" of docs/benchmarks.md'
    : `wrote bench/results/instructions.json and bench/results/instructions.md (${failures.length > 0 ? 'runs failed' : 'a subset'}: docs/benchmarks.md left alone)`)
}

/** --report-only: the table, the targets and the docs section again from bench/results/instructions.json (a run cut short included). */
function reportOnly (): void {
  const saved = JSON.parse(readFileSync(join(RESULTS_DIR, 'instructions.json'), 'utf8')) as InstructionResults
  const labels = Object.fromEntries(saved.runs.map((r) => [r.scenario, { label: scenarioInfo(r.scenario).label, short: scenarioInfo(r.scenario).short }]))
  saved.summary = summarizeInstructions(saved.runs, labels)
  saved.targets = instructionTargets(saved.summary)
  const docs = saved.fullSet && !args['no-docs']
  const table = instructionsTable(saved) + '\n\n' + targetsTable(saved.targets) + '\n'
  writeFileSync(join(RESULTS_DIR, 'instructions.md'), table)
  if (docs) writeFileSync(DOCS_PAGE, spliceSection(readFileSync(DOCS_PAGE, 'utf8'), instructionsSection(saved)))
  console.log(table)
  log(docs ? 'rewrote bench/results/instructions.md and the section of docs/benchmarks.md' : 'rewrote bench/results/instructions.md (a subset: docs/benchmarks.md left alone)')
}

if (args['report-only']) reportOnly()
else await main()
