/**
 * The benchmark orchestrator: `npm run bench` (full) or `npm run bench -- --quick`.
 *
 * Each round starts one server process per scenario (bench/server.ts), warms them, then runs
 * every workload against every scenario with autocannon from this process, the order of the
 * scenarios rotated between rounds, and stops them. Then the memory check (bench/memory.ts),
 * the summary (bench/report.ts) and the outputs: bench/results/latest.json and latest.md,
 * docs/benchmark-chart.svg, docs/benchmark-cost.svg, docs/benchmarks.md and bench/REPORT.md. See bench/README.md.
 */
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { cpus, loadavg, tmpdir, totalmem } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import autocannon from 'autocannon'
import { Redis } from 'ioredis'
import knexFactory from 'knex'
import { benchEnv } from './scenarios/common.js'
import { SCENARIOS, WORKLOADS, scenario as scenarioInfo, type ScenarioInfo, type Workload } from './scenarios/index.js'
import { workloadRequests } from './workloads.js'
import { removeRedisKeys, REPO_ROOT, runMemoryCheck, ServerProcess } from './processes.js'
import { costChartSvg } from './cost-chart.js'
import { benchmarksDoc, chartSvg, comparePeers, evaluateBars, latestMarkdown, markdownTable, reportDoc, runIssues, summarize } from './report.js'
import { formatProfile, summarizeProfile } from './profile.js'
import { sectionOf, withSection } from './doc-sections.js'
import { FIXED_RATE_MARKERS } from './fixed-rate-report.js'
import { existingSection, spliceSection } from './instructions-report.js'
import type { BenchResults, MachineInfo, RunRecord } from './results-types.js'
import type { MemoryReport } from './memory.js'

const RESULTS_DIR = join(REPO_ROOT, 'bench', 'results')
const DOCS_DIR = join(REPO_ROOT, 'docs')
const NOTES = join(REPO_ROOT, 'bench', 'analysis.md')

const { values: args } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    rounds: { type: 'string' },
    duration: { type: 'string' },
    'conflict-duration': { type: 'string' },
    warmup: { type: 'string' },
    connections: { type: 'string' },
    only: { type: 'string' },
    workloads: { type: 'string' },
    'no-memory': { type: 'boolean', default: false },
    'memory-requests': { type: 'string' },
    dist: { type: 'boolean', default: false },
    fresh: { type: 'boolean', default: false },
    'report-only': { type: 'boolean', default: false },
    profile: { type: 'string' },
    'profile-duration': { type: 'string' },
    'profile-warmup': { type: 'string' },
    help: { type: 'boolean', default: false }
  }
})

if (args.help) {
  console.log(`npm run bench [-- options]
  --quick                 short runs (under 3 min on 2 cores): 3 rounds of 0.7 s runs, memory check on
                          100,000 requests (full: 8 rounds of 1.2 s runs, 1,000,000 requests; about 12 min)
  --rounds N              rounds (quick 3, full 8)
  --duration S            measured seconds per run (quick 0.7, full 1.2)
  --conflict-duration S   measured seconds per CONFLICT run (quick 0.4, full 1)
  --warmup S              unmeasured seconds before each run (quick 0.15, full 0.3)
  --fresh                 start fresh server processes every round (default: one set for all rounds)
  --connections N         autocannon connections (50)
  --only a,b              only these scenarios (and their baselines); results are printed, not written
  --workloads W,W         only these workloads (REPLAY, NEW, MIXED, CONFLICT); printed, not written
  --no-memory             skip the memory check
  --memory-requests N     requests for the memory check (quick 100,000, full 1,000,000)
  --dist                  load the plugin from dist/ (run \`npm run build\` first) instead of lib/
  --report-only           rebuild latest.md, the charts, docs/benchmarks.md and bench/REPORT.md from latest.json
  --profile s:W[,s:W]     run each scenario:workload alone under --cpu-prof and print its hot spots
  --profile-duration S    seconds of load while profiling (10)
  --profile-warmup S      seconds of the same workload before the profiled part (0; e.g. 20 for memory:NEW
                          to fill MemoryStorage to its bound first)`)
  process.exit(0)
}

const quick = args.quick
const num = (value: string | undefined, fallback: number): number => {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isFinite(n) || n <= 0) throw new Error(`not a positive number: ${value}`)
  return n
}
const settings: BenchResults['settings'] = {
  rounds: Math.round(num(args.rounds, quick ? 3 : 8)),
  durationSeconds: num(args.duration, quick ? 0.7 : 1.2),
  conflictDurationSeconds: num(args['conflict-duration'], quick ? 0.4 : 1),
  warmupSeconds: num(args.warmup, quick ? 0.15 : 0.3),
  roundWarmupSeconds: quick ? 0.25 : 1,
  freshProcesses: args.fresh,
  connections: Math.round(num(args.connections, 50)),
  pipelining: 1,
  source: args.dist ? 'dist' : 'lib',
  memoryRequests: Math.round(num(args['memory-requests'], quick ? 100_000 : 1_000_000))
}
const runId = `b${Date.now().toString(36)}`
const started = Date.now()

function elapsed (): string {
  const s = Math.round((Date.now() - started) / 1000)
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, '0')}`
}

function log (line: string): void {
  console.log(`[${elapsed()}] ${line}`)
}

// --------------------------------------------------------------------------------------- load

async function load (url: string, workload: Workload, tag: string, unique: string, seconds: number): Promise<autocannon.Result> {
  return await autocannon({
    url,
    connections: settings.connections,
    pipelining: settings.pipelining,
    duration: seconds,
    // Sampling every 50 ms lets a run stop within 50 ms of its duration (autocannon stops on a sample).
    sampleInt: 50,
    requests: workloadRequests(workload, tag, unique)
  })
}

function statusCounts (...results: autocannon.Result[]): Record<string, number> {
  const counts: Record<string, number> = {}
  for (const result of results) {
    for (const [code, stat] of Object.entries(result.statusCodeStats ?? {})) counts[code] = (counts[code] ?? 0) + (stat.count ?? 0)
  }
  return counts
}

function rotate<T> (items: T[], by: number): T[] {
  if (items.length === 0) return items
  const shift = by % items.length
  return [...items.slice(shift), ...items.slice(0, shift)]
}

/**
 * The order of one workload's runs in one round: each baseline next to the scenarios measured
 * against it (so a ratio divides figures taken minutes apart at most), the families and the
 * scenarios within each family rotated from round to round (so none is always first or last).
 */
function runOrder (scenarios: ScenarioInfo[], round: number): ScenarioInfo[] {
  const families = new Map<string, ScenarioInfo[]>()
  for (const s of scenarios) {
    const family = s.baseline ?? s.name
    families.set(family, [...(families.get(family) ?? []), s])
  }
  return rotate([...families.values()], round - 1).flatMap((family) => rotate(family, round - 1))
}

let runCounter = 0

async function measure (server: ServerProcess, info: ScenarioInfo, workload: Workload, round: number, tag: string): Promise<RunRecord> {
  const unique = `${tag}-${++runCounter}`
  const seconds = workload === 'CONFLICT' ? settings.conflictDurationSeconds : settings.durationSeconds
  await server.stats(true)
  const warm = await load(server.url, workload, tag, `${unique}w`, settings.warmupSeconds)
  const before = await server.stats(false)
  const redisBefore = info.store === 'redis' ? await redisCpuMicros() : null
  const result = await load(server.url, workload, tag, unique, seconds)
  const redisAfter = info.store === 'redis' ? await redisCpuMicros() : null
  const { stats, memory, cpu } = await server.stats(true)
  const cpuMicros = cpu.user + cpu.system - before.cpu.user - before.cpu.system
  const redisMicros = redisBefore !== null && redisAfter !== null ? redisAfter - redisBefore : null
  const partial = {
    statusCodes: statusCounts(warm, result),
    errors: warm.errors + result.errors,
    timeouts: warm.timeouts + result.timeouts,
    executions: stats
  }
  const guarded = info.guarded
  return {
    round,
    scenario: info.name,
    workload,
    rps: result.requests.total / result.duration,
    p50: result.latency.p50,
    p99: result.latency.p99,
    latencyMean: result.latency.mean,
    serverCpuMicrosPerRequest: result.requests.total > 0 ? cpuMicros / result.requests.total : 0,
    redisCpuMicrosPerRequest: redisMicros !== null && result.requests.total > 0 ? redisMicros / result.requests.total : null,
    loadAverage: loadavg()[0] ?? 0,
    requests: result.requests.total,
    seconds: result.duration,
    ...partial,
    serverRssMiB: memory.rss / 1024 / 1024,
    issues: runIssues(workload, guarded, partial)
  }
}

// ---------------------------------------------------------------------------------- services

async function probeRedis (): Promise<string | null> {
  const env = benchEnv()
  const client = new Redis({ host: env.redisHost, port: env.redisPort, lazyConnect: true, connectTimeout: 2000, maxRetriesPerRequest: 0, retryStrategy: () => null })
  try {
    await client.connect()
    const info = await client.info('server')
    return /redis_version:(\S+)/.exec(info)?.[1] ?? 'unknown'
  } catch {
    return null
  } finally {
    client.disconnect()
  }
}

async function probePostgres (): Promise<string | null> {
  const knex = knexFactory({ client: 'pg', connection: { ...benchEnv().pg, connectionTimeoutMillis: 2000 }, pool: { min: 0, max: 1 } })
  try {
    const { rows } = await knex.raw('SHOW server_version') as { rows: Array<{ server_version: string }> }
    return rows[0]?.server_version ?? 'unknown'
  } catch {
    return null
  } finally {
    await knex.destroy()
  }
}

let infoClient: Redis | null = null

/** Redis's own CPU time so far (user + system, µs), from INFO cpu. */
async function redisCpuMicros (): Promise<number | null> {
  try {
    if (infoClient === null) {
      const env = benchEnv()
      infoClient = new Redis({ host: env.redisHost, port: env.redisPort })
    }
    const info = await infoClient.info('cpu')
    const user = Number(/used_cpu_user:([\d.]+)/.exec(info)?.[1])
    const system = Number(/used_cpu_sys:([\d.]+)/.exec(info)?.[1])
    return Number.isFinite(user + system) ? (user + system) * 1e6 : null
  } catch {
    return null
  }
}

async function cleanRedis (): Promise<number> {
  return await removeRedisKeys(`bench:${runId}-`)
}

function packageVersion (name: string): string {
  try {
    return (JSON.parse(readFileSync(join(REPO_ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version
  } catch {
    return 'missing'
  }
}

function versions (): Record<string, string> {
  const names = ['fastify', 'ioredis', 'knex', 'pg', 'better-sqlite3', 'autocannon', 'tsx', 'express', 'express-idempotency',
    '@node-idempotency/core', '@node-idempotency/storage-adapter-memory', '@node-idempotency/storage-adapter-redis', 'redis', 'iovalkey', '@valkey/valkey-glide', 'lru-cache']
  return Object.fromEntries(names.map((n) => [n, packageVersion(n)]))
}

// ------------------------------------------------------------------------------------ outputs

function writeOutputs (results: BenchResults): void {
  mkdirSync(RESULTS_DIR, { recursive: true })
  writeFileSync(join(RESULTS_DIR, 'latest.json'), JSON.stringify(results, null, 2) + '\n')
  writeFileSync(join(RESULTS_DIR, 'latest.md'), latestMarkdown(results))
  mkdirSync(DOCS_DIR, { recursive: true })
  writeFileSync(join(DOCS_DIR, 'benchmark-chart.svg'), chartSvg(results))
  writeFileSync(join(DOCS_DIR, 'benchmark-cost.svg'), costChartSvg(results))
  // The sections "Instructions per request" (`npm run bench:instructions`) and "Server CPU per
  // request at a fixed rate" (`npm run bench:rate -- --docs`) are kept as they stand.
  const page = join(DOCS_DIR, 'benchmarks.md')
  const existing = existsSync(page) ? readFileSync(page, 'utf8') : ''
  let doc = benchmarksDoc(results)
  const instructions = existingSection(existing)
  if (instructions !== null) doc = spliceSection(doc, instructions)
  const fixedRate = sectionOf(existing, FIXED_RATE_MARKERS)
  if (fixedRate !== null) doc = withSection(doc, FIXED_RATE_MARKERS, fixedRate, ['\n## Against the peers'])
  writeFileSync(page, doc)
  writeFileSync(join(REPO_ROOT, 'bench', 'REPORT.md'), reportDoc(results, NOTES))
}

function printConclusions (results: BenchResults): void {
  console.log('\n' + markdownTable(results) + '\n')
  for (const bar of results.bars) {
    const verdict = bar.met === null ? 'not measured' : bar.met ? 'MET' : 'MISSED'
    console.log(`bar ${bar.id.padEnd(17)} ${bar.value?.toFixed(3) ?? '—'} vs ${bar.threshold.toFixed(2)}  ${verdict}  ${bar.note}`)
  }
  for (const p of results.peers) {
    console.log(`peer ${p.workload.padEnd(8)} ${p.ours} vs ${p.peer}: ${p.ahead === null ? '—' : p.ahead ? 'ahead' : 'BEHIND'} (${p.note})`)
  }
}

// -------------------------------------------------------------------------------------- modes

async function reportOnly (): Promise<void> {
  const results = JSON.parse(readFileSync(join(RESULTS_DIR, 'latest.json'), 'utf8')) as BenchResults
  results.summary = summarize(results.runs)
  results.bars = evaluateBars(results.summary)
  results.peers = comparePeers(results.summary)
  writeOutputs(results)
  printConclusions(results)
}

async function profile (spec: string): Promise<void> {
  mkdirSync(RESULTS_DIR, { recursive: true })
  const seconds = num(args['profile-duration'], 10)
  for (const item of spec.split(',')) {
    const [name, w] = item.split(':') as [string, string | undefined]
    const info = scenarioInfo(name)
    const workload = (w ?? 'REPLAY').toUpperCase() as Workload
    if (!WORKLOADS.includes(workload)) throw new Error(`unknown workload ${w}`)
    const file = `profile-${name}-${workload}.cpuprofile`
    const tag = `${runId}-p`
    // Every thread writes its own profile (tsx's loader runs in one): keep the main thread's, the largest.
    const dir = mkdtempSync(join(tmpdir(), 'fastify-idempotency-profile-'))
    const server = await ServerProcess.start(name, { BENCH_TAG: tag, BENCH_SOURCE: settings.source, BENCH_TMP: tmpdir() },
      ['--cpu-prof', '--cpu-prof-dir', dir, '--cpu-prof-interval', '100'])
    let from = 0
    let to = Infinity
    let requests = 0
    let cpuPerRequest = NaN
    try {
      await load(server.url, 'MIXED', tag, `${tag}-warm-${name}`, 1)
      // Optionally run the workload itself unprofiled first (e.g. NEW long enough to fill MemoryStorage to its bound).
      const extraWarmup = num(args['profile-warmup'], 0.001)
      if (extraWarmup >= 0.1) await load(server.url, workload, tag, `${tag}-warm2-${name}-${workload}`, extraWarmup)
      const before = await server.stats(false)
      const result = await load(server.url, workload, tag, `${tag}-${name}-${workload}`, seconds)
      const after = await server.stats(false)
      from = before.clockMicros
      to = after.clockMicros
      requests = result.requests.total
      cpuPerRequest = (after.cpu.user + after.cpu.system - before.cpu.user - before.cpu.system) / Math.max(1, requests)
      log(`profiled ${name} ${workload}: ${Math.round(result.requests.total / result.duration)} req/s under the profiler`)
    } finally {
      await server.close()
    }
    const written = readdirSync(dir).map((f) => join(dir, f)).sort((a, b) => statSync(b).size - statSync(a).size)
    if (written[0] === undefined) throw new Error(`no profile written in ${dir}`)
    copyFileSync(written[0], join(RESULTS_DIR, file))
    rmSync(dir, { recursive: true, force: true })
    console.log(formatProfile(`${info.label}, ${workload}, the ${seconds} s under load (${join('bench/results', file)})`, summarizeProfile(join(RESULTS_DIR, file), from, to, requests, cpuPerRequest)))
  }
  await cleanRedis()
}

async function benchmark (): Promise<void> {
  const only = args.only?.split(',').map((s) => s.trim()).filter((s) => s !== '')
  const onlyWorkloads = args.workloads?.split(',').map((s) => s.trim().toUpperCase() as Workload)
  for (const w of onlyWorkloads ?? []) if (!WORKLOADS.includes(w)) throw new Error(`unknown workload ${w}`)
  const partial = only !== undefined || onlyWorkloads !== undefined
  let chosen = SCENARIOS.filter((s) => only === undefined || only.includes(s.name))
  for (const s of [...chosen]) {
    if (s.baseline !== null && !chosen.some((c) => c.name === s.baseline)) chosen.push(scenarioInfo(s.baseline))
  }
  chosen = SCENARIOS.filter((s) => chosen.includes(s))

  const [redisVersion, postgresVersion] = await Promise.all([probeRedis(), probePostgres()])
  const skipped: BenchResults['skipped'] = []
  chosen = chosen.filter((s) => {
    if (s.store === 'redis' && redisVersion === null) skipped.push({ scenario: s.name, reason: 'Redis not reachable' })
    else if (s.store === 'postgres' && postgresVersion === null) skipped.push({ scenario: s.name, reason: 'PostgreSQL not reachable' })
    else return true
    return false
  })
  for (const s of skipped) log(`skipping ${s.scenario}: ${s.reason}`)

  const machineStart = loadavg()
  const tmp = mkdtempSync(join(tmpdir(), 'fastify-idempotency-bench-'))
  const runs: RunRecord[] = []
  log(`${quick ? 'quick' : 'full'} run ${runId}: ${chosen.length} scenarios, ${settings.rounds} rounds, ${settings.durationSeconds} s per run, ${settings.connections} connections`)
  try {
    let servers = new Map<string, ServerProcess>()
    let tag = ''
    const startServers = async (round: number): Promise<void> => {
      tag = `${runId}-r${round}`
      const env = { BENCH_TAG: tag, BENCH_TMP: tmp, BENCH_SOURCE: settings.source }
      const t0 = Date.now()
      const outcomes = await Promise.allSettled(chosen.map(async (s) => [s.name, await ServerProcess.start(s.name, env)] as const))
      for (const outcome of outcomes) if (outcome.status === 'fulfilled') servers.set(outcome.value[0], outcome.value[1])
      const failed = outcomes.find((o) => o.status === 'rejected')
      if (failed !== undefined) throw failed.reason
      log(`round ${round}: ${servers.size} servers up in ${((Date.now() - t0) / 1000).toFixed(1)} s; warming each for ${settings.roundWarmupSeconds} s`)
      for (const [name, server] of servers) {
        await load(server.url, 'MIXED', tag, `${tag}-warm-${name}`, settings.roundWarmupSeconds)
      }
    }
    const stopServers = async (): Promise<void> => {
      const t0 = Date.now()
      await Promise.all([...servers.values()].map(async (s) => { await s.close() }))
      if (servers.size > 0) log(`${servers.size} servers stopped in ${((Date.now() - t0) / 1000).toFixed(1)} s`)
      servers = new Map()
    }
    try {
      for (let round = 1; round <= settings.rounds; round++) {
        if (round === 1 || settings.freshProcesses) {
          await stopServers()
          await startServers(round)
        }
        for (const workload of WORKLOADS) {
          if (onlyWorkloads !== undefined && !onlyWorkloads.includes(workload)) continue
          for (const info of runOrder(chosen.filter((s) => s.workloads.includes(workload)), round)) {
            const run = await measure(servers.get(info.name)!, info, workload, round, tag)
            runs.push(run)
            const flag = run.issues.length > 0 && info.guarded ? `  INCORRECT: ${run.issues.join('; ')}` : ''
            log(`r${round} ${workload.padEnd(8)} ${info.name.padEnd(20)} ${String(Math.round(run.rps)).padStart(6)} req/s  p50 ${run.p50} ms  p99 ${run.p99} ms  runs ${run.executions.executions}${flag}`)
            await sleep(20)
          }
        }
      }
    } finally {
      await stopServers()
    }
  } finally {
    rmSync(tmp, { recursive: true, force: true })
    if (redisVersion !== null) log(`removed ${await cleanRedis()} Redis keys of this run`)
    infoClient?.disconnect()
  }
  const machineEnd = loadavg()

  let memory: MemoryReport | null = null
  if (!args['no-memory'] && !partial) {
    log(`memory check: ${settings.memoryRequests.toLocaleString('en-US')} NEW requests on MemoryStorage`)
    memory = await runMemoryCheck(settings.memoryRequests)
    log(`memory check: heap ${(memory.after.heapUsed / 1048576).toFixed(1)} MiB after GC, size ${memory.finalSize} (max ${memory.maxSizeSeen}) of ${memory.maxEntries}`)
  }

  const machine: MachineInfo = {
    cpuModel: cpus()[0]?.model.trim() ?? 'unknown',
    cores: cpus().length,
    totalMemoryMiB: Math.round(totalmem() / 1048576),
    node: process.version,
    platform: `${process.platform} ${process.arch}`,
    loadAverageStart: machineStart,
    loadAverageEnd: machineEnd,
    redisVersion,
    postgresVersion
  }
  const summary = summarize(runs)
  const results: BenchResults = {
    generatedAt: new Date().toISOString(),
    mode: quick ? 'quick' : 'full',
    settings,
    machine,
    versions: versions(),
    wallSeconds: Math.round((Date.now() - started) / 1000),
    skipped,
    runs,
    summary,
    bars: evaluateBars(summary),
    peers: comparePeers(summary),
    memory
  }
  if (partial) {
    log('partial run (--only/--workloads): nothing written')
  } else {
    writeOutputs(results)
    log('wrote bench/results/latest.json, bench/results/latest.md, docs/benchmark-chart.svg, docs/benchmark-cost.svg, docs/benchmarks.md, bench/REPORT.md')
  }
  printConclusions(results)
}

if (args['report-only']) await reportOnly()
else if (args.profile !== undefined) await profile(args.profile)
else await benchmark()
