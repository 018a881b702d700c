/**
 * The results of `npm run bench:instructions` (bench/instructions.ts): their shape, the summary
 * per scenario and workload, the targets of issue 37, and the Markdown: the table printed and
 * kept in bench/results/instructions.md, and the section of docs/benchmarks.md, which
 * `npm run bench` keeps when it rewrites the rest of that page.
 */
import { sectionOf, withSection, type Markers } from './doc-sections.js'
import type { Workload } from './scenarios/index.js'

export interface InstructionRun {
  scenario: string
  workload: Workload
  repeat: number
  /** Answered requests in the measured window (all 2xx, or the run has issues). */
  requests: number
  /** Server process, instructions per request: everything, then the parts by category. */
  server: { total: number, core: number, compile: number, majorGC: number, minorGC: number }
  /** The private redis-server, per request: everything, serverCron (timers, not requests), and the rest (core). */
  redis: { total: number, core: number, cron: number } | null
  seconds: number
  /** Wall seconds: start-up, warm-up, the measured window. */
  phases: { start: number, warmup: number, window: number }
  issues: string[]
}

export interface InstructionSettings {
  warmupRequests: number
  requests: number
  connections: number
  repeats: number
  source: 'lib' | 'dist'
  jobs: number
}

export interface InstructionResults {
  generatedAt: string
  command: string
  settings: InstructionSettings
  machine: { cpuModel: string, cores: number, node: string, platform: string, valgrind: string, redis: string, loadAverageStart: number[], loadAverageEnd: number[] }
  elapsedSeconds: number
  /** The default set of scenarios and workloads (only then does it write docs/benchmarks.md). */
  fullSet: boolean
  runs: InstructionRun[]
  /** Runs that failed (a server that did not start), with the error. */
  failures: string[]
  summary: InstructionSummary[]
  targets: InstructionTarget[]
}

interface Range { min: number, max: number }

export interface InstructionSummary {
  scenario: string
  label: string
  /** A few words, for the ratio column. */
  short: string
  workload: Workload
  repeats: number
  /** Server core instructions per request: the lowest repeat, and the range. */
  core: Range
  compile: Range
  majorGC: Range
  minorGC: Range
  total: Range
  redisCore: Range | null
  /** Server core plus Redis core, per repeat: the lowest and the range. */
  serverPlusRedis: Range | null
  correct: boolean
}

export interface InstructionTarget {
  text: string
  value: number | null
  threshold: number
  met: boolean | null
}

function range (values: number[]): Range {
  return { min: Math.min(...values), max: Math.max(...values) }
}

export function summarizeInstructions (runs: InstructionRun[], labels: Record<string, { label: string, short: string }>): InstructionSummary[] {
  const groups = new Map<string, InstructionRun[]>()
  for (const run of runs) {
    const key = `${run.scenario}\u0000${run.workload}`
    groups.set(key, [...(groups.get(key) ?? []), run])
  }
  return [...groups.values()].map((group) => {
    const first = group[0]!
    const withRedis = group.filter((r) => r.redis !== null)
    return {
      scenario: first.scenario,
      label: labels[first.scenario]?.label ?? first.scenario,
      short: labels[first.scenario]?.short ?? first.scenario,
      workload: first.workload,
      repeats: group.length,
      core: range(group.map((r) => r.server.core)),
      compile: range(group.map((r) => r.server.compile)),
      majorGC: range(group.map((r) => r.server.majorGC)),
      minorGC: range(group.map((r) => r.server.minorGC)),
      total: range(group.map((r) => r.server.total)),
      redisCore: withRedis.length > 0 ? range(withRedis.map((r) => r.redis!.core)) : null,
      serverPlusRedis: withRedis.length > 0 ? range(withRedis.map((r) => r.server.core + r.redis!.core)) : null,
      correct: group.every((r) => r.issues.length === 0)
    }
  })
}

function find (summary: InstructionSummary[], scenario: string, workload: Workload): InstructionSummary | undefined {
  return summary.find((s) => s.scenario === scenario && s.workload === workload)
}

function ratio (a: number | undefined, b: number | undefined): number | null {
  return a === undefined || b === undefined || b === 0 ? null : a / b
}

/** The targets of issue 37, on the lowest core figure of the repeats. */
export function instructionTargets (summary: InstructionSummary[]): InstructionTarget[] {
  const core = (s: string, w: Workload): number | undefined => find(summary, s, w)?.core.min
  const both = (s: string, w: Workload): number | undefined => find(summary, s, w)?.serverPlusRedis?.min
  const redis = (s: string, w: Workload): number | undefined => find(summary, s, w)?.redisCore?.min
  const specs: Array<[string, number | null, number]> = [
    ['MemoryStorage REPLAY at most 1.15x the in-process floor', ratio(core('memory', 'REPLAY'), core('memory-floor', 'REPLAY')), 1.15],
    ['MemoryStorage NEW at most 1.15x the in-process floor', ratio(core('memory', 'NEW'), core('memory-floor', 'NEW')), 1.15],
    ['sealed MemoryStorage NEW at most 1.20x plain MemoryStorage NEW', ratio(core('memory-sealed', 'NEW'), core('memory', 'NEW')), 1.2],
    ['KnexStorage (PostgreSQL) NEW at most 1.15x its floor', ratio(core('knex-pg', 'NEW'), core('pg-floor', 'NEW')), 1.15],
    ['KnexStorage (PostgreSQL) REPLAY at most 1.15x its floor', ratio(core('knex-pg', 'REPLAY'), core('pg-floor', 'REPLAY')), 1.15],
    ['Redis\'s own instructions per first request (node-redis) at most 1.5x @node-idempotency\'s', ratio(redis('redis-node-redis', 'NEW'), redis('node-idem-redis', 'NEW')), 1.5],
    ['RedisStorage (ioredis) NEW, server + Redis, at most 0.95x @node-idempotency', ratio(both('redis', 'NEW'), both('node-idem-redis', 'NEW')), 0.95],
    ['RedisStorage (ioredis) REPLAY, server + Redis, at most 0.95x @node-idempotency', ratio(both('redis', 'REPLAY'), both('node-idem-redis', 'REPLAY')), 0.95],
    ['RedisStorage (node-redis) NEW, server + Redis, at most 0.95x @node-idempotency', ratio(both('redis-node-redis', 'NEW'), both('node-idem-redis', 'NEW')), 0.95],
    ['RedisStorage (node-redis) REPLAY, server + Redis, at most 0.95x @node-idempotency', ratio(both('redis-node-redis', 'REPLAY'), both('node-idem-redis', 'REPLAY')), 0.95]
  ]
  return specs.map(([text, value, threshold]) => ({ text, value, threshold, met: value === null ? null : value <= threshold }))
}

function k (n: number): string {
  return `${(n / 1000).toFixed(1)}k`
}

function spread (r: Range): string {
  return r.min === r.max || Math.round(r.min / 100) === Math.round(r.max / 100) ? k(r.min) : `${k(r.min)}–${k(r.max)}`
}

/** Against what each scenario's core is divided in the table. */
const RELATIVE: Record<string, string> = {
  memory: 'memory-floor',
  'memory-sealed': 'memory',
  'memory-floor': 'bare',
  redis: 'node-idem-redis',
  'redis-node-redis': 'node-idem-redis',
  'redis-floor': 'node-idem-redis',
  'knex-pg': 'pg-floor'
}

export function instructionsTable (results: InstructionResults): string {
  const summary = results.summary
  const rows = [
    '| scenario | workload | core (lowest) | core, all repeats (how many) | JIT compile | major GC | minor GC (in core) | Redis | server + Redis | ratio |',
    '|---|---|---:|---:|---:|---:|---:|---:|---:|---|'
  ]
  for (const s of summary) {
    const against = RELATIVE[s.scenario]
    const base = against === undefined ? undefined : find(summary, against, s.workload) ?? (against === 'bare' ? find(summary, 'bare', 'NEW') : undefined)
    let ratioText = ''
    if (base !== undefined) {
      const redisPair = s.serverPlusRedis !== null && base.serverPlusRedis !== null
      const value = redisPair ? ratio(s.serverPlusRedis!.min, base.serverPlusRedis!.min) : ratio(s.core.min, base.core.min)
      if (value !== null) ratioText = `${value.toFixed(2)}x ${base.short}${redisPair ? ' (server + Redis)' : ''}${base.workload !== s.workload ? ` ${base.workload}` : ''}`
    }
    rows.push(`| ${s.label} | ${s.workload} | ${k(s.core.min)} | ${spread(s.core)} (${s.repeats}) | ${spread(s.compile)} | ${spread(s.majorGC)} | ${spread(s.minorGC)} | ${s.redisCore === null ? '' : spread(s.redisCore)} | ${s.serverPlusRedis === null ? '' : k(s.serverPlusRedis.min)} | ${ratioText}${s.correct ? '' : ' (a run with issues: see below)'} |`)
  }
  return rows.join('\n')
}

export function targetsTable (targets: InstructionTarget[]): string {
  return [
    '| target | measured | met |',
    '|---|---:|---|',
    ...targets.map((t) => `| ${t.text} | ${t.value === null ? '—' : `${t.value.toFixed(3)}x`} | ${t.met === null ? 'not measured' : t.met ? 'yes' : '**no**'} |`)
  ].join('\n')
}

export const SECTION_START = '<!-- instructions:start (written by npm run bench:instructions) -->'
export const SECTION_END = '<!-- instructions:end -->'

function settingsText (results: InstructionResults): string {
  const s = results.settings
  const m = results.machine
  const counts = results.summary.map((row) => row.repeats)
  const repeats = Math.min(...counts) < s.repeats ? `${s.repeats} repeats asked, ${Math.min(...counts)}–${Math.max(...counts)} done (the run was cut short)` : `${s.repeats} repeats`
  return `${results.generatedAt.slice(0, 10)}; ${m.cpuModel}, ${m.cores} cores shared with other work (load average ${m.loadAverageStart[0]?.toFixed(1)} at the start), ` +
    `Node ${m.node}, ${m.valgrind}, Redis ${m.redis}; each repeat a fresh server process: ${s.warmupRequests.toLocaleString('en')} warm-up requests, then ${s.requests.toLocaleString('en')} measured over ` +
    `${s.connections} keep-alive connections; ${repeats}; plugin from \`${s.source}/\`; \`${results.command}\`, ${Math.round(results.elapsedSeconds / 60)} minutes`
}

/** The runs whose answers were not all right, each with what went wrong (none: nothing). */
function issuesLines (results: InstructionResults): string[] {
  const bad = results.runs.filter((r) => r.issues.length > 0)
  if (bad.length === 0) return []
  return [`Runs with issues: ${bad.map((r) => `${r.scenario} ${r.workload} repeat ${r.repeat}: ${r.issues.join(', ')} of ${r.requests.toLocaleString('en')}`).join('; ')}.`, '']
}

/**
 * What the targets that are missed come down to, measured apart from the table (the commands say
 * how): the same for every run of this code, so written here rather than computed.
 */
const MISSED_TARGETS = [
  'What the first requests spend, beside the table:',
  '',
  '- **MemoryStorage against the in-process floor.** The floor keeps a string per key, and so does the plugin: the body as the string the handler sent, its bytes made when the entry is first read. Around it the plugin keeps the status, content type and headers under a fencing token, fingerprints the canonical form of the body, and holds a lease that is renewed, bounded by a deadline and drained at shutdown. ' +
    'What is left over the floor is spread thinly: a profile with `--perf-basic-prof` finds no function of the plugin above 600 instructions of its own per request, and about 1,400 in the listener that watches each running request\'s response close (hijacked replies and clients that leave). ' +
    'Both the floor and the plugin move by several thousand instructions from one server process to the next (JIT and collector timing): the ranges show by how much. ' +
    'Major GC lands in the window of some runs and not others, by timing alone; counted over 60,000 first requests on real HTTP outside callgrind (`--trace-gc`), the plugin on MemoryStorage ran 4 mark-compacts and 127 scavenges, against 5 and 134 before its bodies were kept as strings.',
  '- **A kept response is what the collector works on.** Every first request adds an entry that outlives the young generation: what MemoryStorage keeps per entry is what each scavenge copies and each mark-compact walks. ' +
    'An entry is now the response, its body as the string the handler sent (its bytes are made when the entry is first read), the fingerprint record (one string on a start shared by the route) and a shared empty header set when the response keeps no header: 411 bytes of heap per entry at 100,000 entries and none outside the heap, against 738 bytes of heap before this release, and 507 with 62 outside the heap before bodies were kept as strings (`node --expose-gc --import tsx bench/memory.ts 100000`, after a full collection).',
  '- **Encryption.** A seal is one call into libsodium (ChaCha20-Poly1305 through `sodium-native`, written straight into the envelope), and a new key\'s keyed hash continues two SHA-256 states that absorbed the pads once. ' +
    '`sh bench/micro-instructions.sh \'seal (route response)\'` counts 23.2k instructions per seal on Node 20, 21.7k on Node 22 (60.5k and 40.2k with Node\'s AES-256-GCM, which sets up a native cipher context on every call); `hashKey` of a new key 21.3k and 20.2k (30.0k and 34.1k as two one-shot `crypto.hash` calls), each with the harness\'s own allocations and a Map insertion. ' +
    'Of a seal, ChaCha20 and Poly1305 are about 3.4k, the call into the binding with its six Buffers about 4k; of a keyed hash, SHA-256\'s compression about 2.3k per 64-byte block (a key of 28 to 59 characters takes three), each of the four calls into the binding about 1.5k. ' +
    'A plain first request keeps its body as the string it was sent as; a sealed one makes its bytes, a plaintext with its meta, an envelope, and the store copies the envelope; each is a few thousand instructions, and the collector pays for them again. ' +
    'What is left is calls into native code and the bytes a sealed entry needs, spread thinly; the target allows all of it 20 % of a plain first request, about 28k. Libraries in JavaScript or WebAssembly cost more than the native calls they would save (bench/analysis.md#encryption).',
  '- **Redis.** The fence that keeps a request whose lease lapsed from storing over a newer one\'s lease is a Lua script, and Redis 7 has no compare-and-set command (`SET … IFEQ` arrives in Redis 8.4 and Valkey 8.1). ' +
    '`sh bench/redis-fence.sh` counts Redis\'s own instructions per first request: 19.1k for the peer\'s two plain `SET`s, 50.6k for this store\'s `SET … NX GET` and fenced script, 49.0k for the smallest script that compares and sets, 45.9k for the same as a Redis function: what costs is the call into Lua, whatever it runs. ' +
    'Two ways without a script were counted too: a lease key apart from the response key, where the first completion wins by `SET … NX` (25.3k, 1.32x the peer), which stores the response of a holder whose lease lapsed while a newer holder runs, and which 0.1 and this version could not share a store with during a rolling deploy (0.1 would take a lease the other does not see, and run the handler again); ' +
    'and a strict fence from commands alone, a lease-token key with the lease\'s expiry renamed onto the key inside `MULTI` (61.1k), which costs Redis more than the script. So the script stays, and the fencing tests with it. ' +
    'On node-redis 6 the storage sets its command options once, on a view of the client, instead of with each command, whose options node-redis merges with an object spread that takes V8\'s slow path (about 5.7k instructions per command).',
  ''
]

/** The section of docs/benchmarks.md, between its markers. */
export function instructionsSection (results: InstructionResults): string {
  return [
    SECTION_START,
    '## Instructions per request',
    '',
    'Throughput on a shared machine moves with whatever else runs on it; the number of instructions a request costs does not. ' +
      'These are counted by callgrind (valgrind) in the server process, and in Redis for the Redis scenarios, over a window of requests after a warm-up, ' +
      'and divided by the requests. **Core** leaves out JIT compilation and major (mark-compact) GC, which land in some windows and not in others; ' +
      'minor GC (scavenges) grows with what a request allocates and stays in it. Redis leaves out its timer (`serverCron`). ' +
      'Each figure is the lowest of the repeats; the range shows all of them. A ratio is the lowest core against the lowest core of what it is compared with ' +
      '(for Redis scenarios, server plus Redis).',
    '',
    instructionsTable(results),
    '',
    `*${settingsText(results)}.*`,
    '',
    ...issuesLines(results),
    'Against the targets the request path is held to:',
    '',
    targetsTable(results.targets),
    '',
    ...MISSED_TARGETS,
    'Reproduce with `npm run bench:instructions` (needs valgrind and `redis-server`; the default set takes about an hour on 2 busy cores; see [bench/README.md](https://github.com/fastify-idempotency/fastify-idempotency/blob/main/bench/README.md)).',
    SECTION_END
  ].join('\n')
}

export const INSTRUCTIONS_MARKERS: Markers = { start: SECTION_START, end: SECTION_END }

/** `doc` with the section between the markers replaced, or inserted before "## Against the peers" (or at the end). */
export function spliceSection (doc: string, section: string): string {
  return withSection(doc, INSTRUCTIONS_MARKERS, section, ['\n## Against the peers'])
}

/** The section as it stands in a page (markers included), or null. */
export function existingSection (doc: string): string | null {
  return sectionOf(doc, INSTRUCTIONS_MARKERS)
}
