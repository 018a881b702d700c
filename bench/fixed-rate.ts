/**
 * Server CPU per request at a fixed offered rate: `npm run bench:rate -- --scenarios memory,memory-sealed`.
 *
 * `npm run bench` drives every server as hard as it goes and compares throughput; a server that
 * costs more per request then also runs at a lower rate, where the kernel and the load generator
 * cost each request more (loopback TCP charges the receiver's wake-up to the sender), so a small
 * change in the plugin's own work moves the ratio by more than that work, and the rounds swing with
 * the machine. Here every server gets the same requests at the same pace (autocannon's
 * `overallRate`, well under what the slowest one serves), and what is compared is the server
 * process's CPU time per response (`process.cpuUsage()`, user and system). Scenarios run one at a
 * time, round after round in turn; the figures are medians over rounds. This is the measure the
 * commits that change a hot path quote, before and after.
 *
 * Before/after figures for a change: the same command in a worktree of the earlier commit
 * (`git worktree add /tmp/before <commit>`, with this checkout's node_modules linked in), run in
 * turn with this one, a few times over.
 */
import { readFileSync, writeFileSync } from 'node:fs'
import { cpus, loadavg } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import { removeRedisKeys, ServerProcess } from './processes.js'
import { FIXED_RATE_MARKERS, fixedRateSection } from './fixed-rate-report.js'
import { median } from './report.js'
import { KEY_HEADER } from './scenarios/common.js'
import { scenario, type Workload } from './scenarios/index.js'
import { replayKey, workloadRequests } from './workloads.js'

const HELP = `usage: npm run bench:rate -- [options]
  --scenarios a,b,...   scenarios to compare (names as in npm run bench; default bare,memory)
  --workload W          REPLAY, NEW or MIXED (default REPLAY)
  --rate N              requests per second offered, in all (default 10000)
  --seconds S           measured seconds per run (default 4)
  --rounds N            rounds; each runs every scenario once (default 3)
  --keys N              REPLAY over N stored keys in turn instead of one (default 1)
  --connections N       (default 50)
  --docs                write the medians into docs/benchmarks.md, under this workload
                        (the section "Server CPU per request at a fixed rate"; npm run bench keeps it)`

const { values } = parseArgs({
  options: {
    scenarios: { type: 'string', default: 'bare,memory' },
    workload: { type: 'string', default: 'REPLAY' },
    rate: { type: 'string', default: '10000' },
    seconds: { type: 'string', default: '4' },
    rounds: { type: 'string', default: '3' },
    keys: { type: 'string', default: '1' },
    connections: { type: 'string', default: '50' },
    docs: { type: 'boolean', default: false },
    help: { type: 'boolean', default: false }
  }
})
if (values.help) {
  console.log(HELP)
  process.exit(0)
}

const names = values.scenarios.split(',').filter((name) => name !== '')
const workload = values.workload as Workload
const rate = Number(values.rate)
const seconds = Number(values.seconds)
const rounds = Number(values.rounds)
const keys = Number(values.keys)
const connections = Number(values.connections)
// Throws for a name no scenario has, listing those there are.
const infos = names.map(scenario)
if (!['REPLAY', 'NEW', 'MIXED'].includes(workload)) throw new Error('--workload must be REPLAY, NEW or MIXED')

const runId = `rate${Date.now().toString(36)}`
let run = 0

/** The `index`th stored key of a REPLAY run (`--keys`): the workload's own key when there is one. */
function storedKey (tag: string, index: number): string {
  return keys === 1 ? replayKey(tag) : `${replayKey(tag)}-${index % keys}`
}

/** The requests of one run: the workload's, or for REPLAY over several keys, those keys in turn. */
function requests (tag: string): autocannon.Request[] {
  const unique = `${runId}-${++run}`
  if (workload !== 'REPLAY' || keys === 1) return workloadRequests(workload, tag, unique)
  const [request] = workloadRequests('REPLAY', tag, unique)
  let n = 0
  return [{ ...request, setupRequest: (sent) => { (sent.headers as Record<string, string>)[KEY_HEADER] = storedKey(tag, n++); return sent } }]
}

async function load (server: ServerProcess, tag: string, duration: number): Promise<number> {
  const result = await autocannon({ url: server.url, connections, overallRate: rate, duration, requests: requests(tag) })
  const failed = result.non2xx + result.errors + result.timeouts
  if (failed > 0) throw new Error(`${server.name}: ${failed} requests failed or were not 2xx`)
  return result.requests.total
}

/** Store what REPLAY replays: its key, or its keys, each answered once. */
async function store (server: ServerProcess, tag: string): Promise<void> {
  const [request] = workloadRequests('REPLAY', tag, 'store')
  for (let index = 0; index < keys; index++) {
    const key = storedKey(tag, index)
    const response = await fetch(`${server.url}${request!.path}`, { method: 'POST', headers: { 'content-type': 'application/json', [KEY_HEADER]: key }, body: request!.body as string })
    if (!response.ok) throw new Error(`${server.name}: storing ${key} answered ${response.status}`)
    await response.arrayBuffer()
  }
}

const figures = new Map<string, Array<{ cpu: number, user: number, system: number }>>()
const loadAtStart = loadavg()[0]!
console.log(`${workload} at ${rate} req/s, ${seconds} s per run, ${rounds} rounds, ${connections} connections${keys > 1 ? `, ${keys} keys` : ''}`)
for (let round = 1; round <= rounds; round++) {
  for (const name of names) {
    const tag = `${runId}-${name}`
    const server = await ServerProcess.start(name, { BENCH_TAG: tag })
    try {
      if (workload !== 'NEW') await store(server, tag)
      await load(server, tag, 2)
      const before = (await server.stats(true)).cpu
      const answered = await load(server, tag, seconds)
      const { cpu: after, stats } = await server.stats(true)
      // A bare route or a floor runs its handler on every request; a guarded one, once per key.
      const guarded = ['ours', 'peer'].includes(scenario(name).kind)
      if (guarded && stats.duplicateKeys > 0) throw new Error(`${name}: a handler ran twice for one key`)
      if (guarded && workload === 'REPLAY' && stats.executions > 0) throw new Error(`${name}: a replay ran the handler`)
      const user = (after.user - before.user) / answered
      const system = (after.system - before.system) / answered
      const row = { cpu: user + system, user, system }
      figures.set(name, [...(figures.get(name) ?? []), row])
      console.log(`round ${round} ${name.padEnd(20)} ${answered} answered, ${row.cpu.toFixed(1)} µs of server CPU per request (user ${user.toFixed(1)}, system ${system.toFixed(1)})`)
    } finally {
      await server.close()
    }
  }
}

// What the Redis scenarios stored: every key is under bench:<run id>-<scenario>.
if (infos.some((info) => info.store === 'redis')) await removeRedisKeys(`bench:${runId}-`)

console.log('\n| scenario | server CPU µs per request, median | user | system | rounds |\n|---|---:|---:|---:|---|')
for (const [name, rows] of figures) {
  console.log(`| ${name} | ${median(rows.map((row) => row.cpu)).toFixed(1)} | ${median(rows.map((row) => row.user)).toFixed(1)} | ${median(rows.map((row) => row.system)).toFixed(1)} | ${rows.map((row) => row.cpu.toFixed(1)).join(', ')} |`)
}

if (values.docs) {
  const page = join(import.meta.dirname, '..', 'docs', 'benchmarks.md')
  const rows = [...figures].map(([name, runs]) => ({
    label: scenario(name).label,
    cpu: median(runs.map((row) => row.cpu)),
    user: median(runs.map((row) => row.user)),
    system: median(runs.map((row) => row.system)),
    rounds: runs.map((row) => row.cpu)
  }))
  const args = process.argv.slice(2).filter((arg) => arg !== '--docs')
  const doc = readFileSync(page, 'utf8')
  writeFileSync(page, fixedRateSection(doc, {
    workload,
    rows,
    conditions: `${new Date().toISOString().slice(0, 10)}; ${cpus()[0]?.model.trim() ?? 'unknown CPU'}, ${cpus().length} cores shared with the load generator and the stores ` +
      `(1-minute load average ${loadAtStart.toFixed(1)} at the start, ${loadavg()[0]!.toFixed(1)} at the end), Node ${process.version}; ` +
      `${rate.toLocaleString('en')} req/s offered over ${connections} connections, ${seconds} s measured per run after 2 s, ${rounds} rounds, scenarios in turn; plugin from \`lib/\`; ` +
      `\`npm run bench:rate -- ${args.join(' ')} --docs\``
  }))
  console.log(`wrote the ${workload} figures into docs/benchmarks.md (${FIXED_RATE_MARKERS.start})`)
}
