/**
 * From runs to conclusions: medians per scenario and workload, ratios paired by round, the
 * performance targets, the comparison with the peers, and the outputs (latest.md, the SVG chart,
 * docs/benchmarks.md, bench/REPORT.md). Nothing here measures; everything here can be re-run on a saved
 * latest.json (`npm run bench -- --report-only`).
 */
import { existsSync, readFileSync } from 'node:fs'
import { SCENARIOS, WORKLOADS, scenario as scenarioInfo, type Workload } from './scenarios/index.js'
import { CONFLICT_HANDLER_MS, CONFLICT_KEY_PERIOD_MS } from './workloads.js'
import type { BarResult, BenchResults, PeerComparison, RunRecord, Spread, Summary } from './results-types.js'

// ------------------------------------------------------------------------------------ statistics

export function median (values: number[]): number {
  if (values.length === 0) return NaN
  const sorted = [...values].sort((a, b) => a - b)
  const middle = Math.floor(sorted.length / 2)
  return sorted.length % 2 === 1 ? sorted[middle]! : (sorted[middle - 1]! + sorted[middle]!) / 2
}

/** Linear-interpolated quantile, q in [0, 1]. */
export function quantile (values: number[], q: number): number {
  if (values.length === 0) return NaN
  const sorted = [...values].sort((a, b) => a - b)
  const at = (sorted.length - 1) * q
  const low = Math.floor(at)
  const high = Math.ceil(at)
  return sorted[low]! + (sorted[high]! - sorted[low]!) * (at - low)
}

function spread (values: number[]): Spread {
  return { median: median(values), min: Math.min(...values), max: Math.max(...values) }
}

function addCounts (into: Record<string, number>, from: Record<string, number>): void {
  for (const [code, count] of Object.entries(from)) into[code] = (into[code] ?? 0) + count
}

export function summarize (runs: RunRecord[]): Summary[] {
  const summaries: Summary[] = []
  for (const info of SCENARIOS) {
    for (const workload of info.workloads) {
      const mine = runs.filter((r) => r.scenario === info.name && r.workload === workload)
      if (mine.length === 0) continue
      let ratio: Summary['ratio'] = null
      let cpuRatio: Summary['cpuRatio'] = null
      if (info.baseline !== null) {
        const perRound: number[] = []
        const cpuPerRound: number[] = []
        for (const run of mine) {
          const base = runs.find((r) => r.scenario === info.baseline && r.workload === workload && r.round === run.round)
          if (base !== undefined && base.rps > 0) perRound.push(run.rps / base.rps)
          if (base !== undefined && run.serverCpuMicrosPerRequest > 0) cpuPerRound.push(base.serverCpuMicrosPerRequest / run.serverCpuMicrosPerRequest)
        }
        if (perRound.length > 0) ratio = { ...spread(perRound), perRound }
        if (cpuPerRound.length > 0) cpuRatio = spread(cpuPerRound)
      }
      const statusCodes: Record<string, number> = {}
      for (const run of mine) addCounts(statusCodes, run.statusCodes)
      const guarded = info.guarded
      const issues = [...new Set(mine.flatMap((r) => r.issues))]
      summaries.push({
        scenario: info.name,
        label: info.label,
        kind: info.kind,
        store: info.store,
        framework: info.framework,
        workload,
        baseline: info.baseline,
        rounds: mine.length,
        rps: spread(mine.map((r) => r.rps)),
        p50: median(mine.map((r) => r.p50)),
        p99: median(mine.map((r) => r.p99)),
        ratio,
        cpuPerRequest: median(mine.map((r) => r.serverCpuMicrosPerRequest)),
        cpuRatio,
        redisCpuPerRequest: info.store === 'redis' ? median(mine.map((r) => r.redisCpuMicrosPerRequest ?? NaN).filter(Number.isFinite)) : null,
        executions: mine.reduce((sum, r) => sum + r.executions.executions, 0),
        duplicateKeys: mine.reduce((sum, r) => sum + r.executions.duplicateKeys, 0),
        statusCodes,
        correct: guarded ? issues.length === 0 : null,
        issues
      })
    }
  }
  return summaries
}

/**
 * What a guarded scenario got wrong in one run. `statuses` are the client's counts, `executions`
 * the server's, both over the warm-up and the measured part.
 */
export function runIssues (workload: Workload, guarded: boolean, run: Pick<RunRecord, 'statusCodes' | 'errors' | 'timeouts' | 'executions'>): string[] {
  const issues: string[] = []
  if (run.errors > 0) issues.push(`${run.errors} socket errors/timeouts`)
  const ok = Object.entries(run.statusCodes).filter(([code]) => code.startsWith('2')).reduce((sum, [, n]) => sum + n, 0)
  const unexpected = Object.entries(run.statusCodes).filter(([code]) => !code.startsWith('2') && !(workload === 'CONFLICT' && code === '409'))
  for (const [code, count] of unexpected) issues.push(`${count} × HTTP ${code}`)
  if (!guarded) return issues
  const e = run.executions
  if (e.duplicateKeys > 0) issues.push(`handler ran more than once for ${e.duplicateKeys} key(s) (up to ${e.maxPerKey} times)`)
  if (workload === 'REPLAY' && e.executions > 0) issues.push(`handler ran ${e.executions} times on replays`)
  if (workload === 'NEW' && e.executions < ok) issues.push(`${ok - e.executions} fresh keys answered without running the handler`)
  return issues
}

// --------------------------------------------------------------------------------------- targets

/** How far below the bare route an unflagged route may measure and still count as "at its speed". */
export const NOISE_ALLOWANCE = 0.03

interface BarSpec {
  id: string
  text: string
  scenario: string
  workload: Workload
  threshold: number
}

const BAR_SPECS: BarSpec[] = [
  { id: 'unflagged-replay', text: 'Unflagged route at the bare route\'s throughput (within noise)', scenario: 'unflagged', workload: 'REPLAY', threshold: 1 - NOISE_ALLOWANCE },
  { id: 'unflagged-new', text: 'Unflagged route at the bare route\'s throughput (within noise)', scenario: 'unflagged', workload: 'NEW', threshold: 1 - NOISE_ALLOWANCE },
  { id: 'memory-replay', text: 'MemoryStorage: REPLAY at or above the bare route', scenario: 'memory', workload: 'REPLAY', threshold: 1 },
  { id: 'memory-new', text: 'MemoryStorage: NEW at 90 % or more of the bare route', scenario: 'memory', workload: 'NEW', threshold: 0.9 },
  { id: 'redis-replay', text: 'RedisStorage: REPLAY at 95 % or more of the one-GET floor', scenario: 'redis', workload: 'REPLAY', threshold: 0.95 },
  { id: 'redis-new', text: 'RedisStorage: NEW at 95 % or more of the two-round-trip floor', scenario: 'redis', workload: 'NEW', threshold: 0.95 },
  { id: 'pg-replay', text: 'KnexStorage on PostgreSQL: REPLAY at 90 % or more of the one-SELECT floor', scenario: 'knex-pg', workload: 'REPLAY', threshold: 0.9 },
  { id: 'pg-new', text: 'KnexStorage on PostgreSQL: NEW at 90 % or more of the INSERT + UPDATE floor', scenario: 'knex-pg', workload: 'NEW', threshold: 0.9 },
  { id: 'pg-trx-new', text: 'KnexStorage on PostgreSQL, transaction mode: NEW at 80 % or more of its floor', scenario: 'knex-pg-trx', workload: 'NEW', threshold: 0.8 },
  { id: 'mariadb-replay', text: 'KnexStorage on MariaDB: REPLAY at 90 % or more of the one-SELECT floor', scenario: 'knex-mariadb', workload: 'REPLAY', threshold: 0.9 },
  { id: 'mariadb-new', text: 'KnexStorage on MariaDB: NEW at 90 % or more of the INSERT + UPDATE floor', scenario: 'knex-mariadb', workload: 'NEW', threshold: 0.9 },
  { id: 'sqlite-replay', text: 'KnexStorage on SQLite (WAL): REPLAY at 90 % or more of the one-SELECT floor', scenario: 'knex-sqlite', workload: 'REPLAY', threshold: 0.9 },
  { id: 'sqlite-new', text: 'KnexStorage on SQLite (WAL): NEW at 90 % or more of the INSERT + UPDATE floor', scenario: 'knex-sqlite', workload: 'NEW', threshold: 0.9 },
  { id: 'sealed-replay', text: 'Encryption at rest: REPLAY at 85 % or more of MemoryStorage without it', scenario: 'memory-sealed', workload: 'REPLAY', threshold: 0.85 },
  { id: 'sealed-new', text: 'Encryption at rest: NEW at 85 % or more of MemoryStorage without it', scenario: 'memory-sealed', workload: 'NEW', threshold: 0.85 }
]

export function evaluateBars (summary: Summary[]): BarResult[] {
  return BAR_SPECS.map((spec) => {
    const s = summary.find((x) => x.scenario === spec.scenario && x.workload === spec.workload)
    const against = scenarioInfo(spec.scenario).baseline ?? ''
    if (s === undefined || s.ratio === null) {
      return { ...spec, against, value: null, met: null, clear: false, note: 'not measured in this run' }
    }
    const value = s.ratio.median
    const q1 = quantile(s.ratio.perRound, 0.25)
    const q3 = quantile(s.ratio.perRound, 0.75)
    // Fewer than 5 rounds have no meaningful middle half: such a run decides nothing on its own.
    const enough = s.ratio.perRound.length >= 5
    const clear = enough && (q1 >= spec.threshold || q3 < spec.threshold)
    const notes = [
      clear
        ? 'clear: the middle half of the rounds is on this side of the target'
        : enough ? 'undecided: the middle half of the rounds straddles the target' : `undecided: ${s.ratio.perRound.length} rounds are too few to call`,
      `rounds' middle half ${q1.toFixed(2)}–${q3.toFixed(2)}`
    ]
    let met = value >= spec.threshold
    if (s.correct === false) {
      met = false
      notes.unshift(`incorrect: ${s.issues.join('; ')}`)
    }
    return { ...spec, against, value, met, clear, note: notes.join('; ') }
  })
}

const PEER_PAIRS: Array<{ peer: string, ours: string }> = [
  { peer: 'node-idem-memory', ours: 'memory' },
  { peer: 'node-idem-redis', ours: 'redis' },
  { peer: 'node-idem-redis', ours: 'redis-node-redis' },
  { peer: 'node-idem-redis', ours: 'redis-glide' },
  { peer: 'node-idem-redis', ours: 'redis-iovalkey' },
  { peer: 'express-idempotency', ours: 'memory' }
]

export function comparePeers (summary: Summary[]): PeerComparison[] {
  const rows: PeerComparison[] = []
  for (const { peer, ours } of PEER_PAIRS) {
    for (const workload of scenarioInfo(peer).workloads) {
      const p = summary.find((x) => x.scenario === peer && x.workload === workload)
      const o = summary.find((x) => x.scenario === ours && x.workload === workload)
      if (p === undefined || o === undefined) continue
      const measure = workload === 'CONFLICT' ? 'req/s' : 'ratio to own baseline'
      const value = (s: Summary): number | null => (measure === 'req/s' ? s.rps.median : s.ratio?.median ?? null)
      const oursValue = value(o)
      const peerValue = value(p)
      let ahead: boolean | null = null
      let note = ''
      if (o.correct === false) {
        ahead = false
        note = `ours incorrect: ${o.issues.join('; ')}`
      } else if (p.correct === false) {
        ahead = true
        note = `peer incorrect: ${p.issues.join('; ')}`
      } else if (oursValue !== null && peerValue !== null) {
        ahead = oursValue > peerValue
        note = `ours ${(oursValue / peerValue).toFixed(2)}× the peer`
      }
      rows.push({ peer, ours, workload, measure, oursValue, peerValue, oursCorrect: o.correct, peerCorrect: p.correct, ahead, note })
    }
  }
  return rows
}

// -------------------------------------------------------------------------------------- markdown

function fmtInt (n: number): string {
  return Math.round(n).toLocaleString('en-US')
}

function fmtMs (n: number): string {
  return n >= 10 ? n.toFixed(0) : n.toFixed(1)
}

function fmtRatio (r: Summary['ratio']): string {
  if (r === null) return '—'
  return `**${r.median.toFixed(2)}** (${r.min.toFixed(2)}–${r.max.toFixed(2)})`
}

function fmtStatuses (codes: Record<string, number>): string {
  return Object.entries(codes).sort().map(([code, n]) => `${code}: ${fmtInt(n)}`).join(', ')
}

function fmtCorrect (s: Summary): string {
  if (s.correct === null) return 'n/a'
  return s.correct ? 'yes' : `**NO**: ${s.issues.join('; ')}`
}

function fmtBytes (n: number): string {
  return `${(n / 1024 / 1024).toFixed(1)} MiB`
}

export function markdownTable (results: BenchResults): string {
  const lines = [
    '| Workload | Scenario | req/s (median) | p50 ms | p99 ms | Throughput vs baseline: median (min–max of rounds) | Baseline | Server CPU µs/req | CPU-based ratio | Redis CPU µs/req | Handler runs | Correct | Status codes (all rounds, warm-up included) |',
    '|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|---|'
  ]
  for (const workload of WORKLOADS) {
    for (const s of results.summary.filter((x) => x.workload === workload)) {
      const cpuRatio = s.cpuRatio === null ? '—' : s.cpuRatio.median.toFixed(2)
      lines.push(`| ${workload} | ${s.label} | ${fmtInt(s.rps.median)} | ${fmtMs(s.p50)} | ${fmtMs(s.p99)} | ${fmtRatio(s.ratio)} | ${s.baseline ?? '—'} | ${s.cpuPerRequest.toFixed(0)} | ${cpuRatio} | ${s.redisCpuPerRequest === null || Number.isNaN(s.redisCpuPerRequest) ? '—' : s.redisCpuPerRequest.toFixed(1)} | ${fmtInt(s.executions)} | ${fmtCorrect(s)} | ${fmtStatuses(s.statusCodes)} |`)
    }
  }
  return lines.join('\n')
}

function barsTable (results: BenchResults): string {
  const lines = ['| Target | Throughput ratio (median of rounds) | Threshold | Met | CPU-based ratio (cross-check) |', '|---|---:|---:|---|---:|']
  for (const bar of results.bars) {
    const value = bar.value === null ? '—' : `${bar.value.toFixed(3)} × ${bar.against}`
    const met = bar.met === null ? 'not measured' : bar.met ? '**met**' : '**missed**'
    const s = results.summary.find((x) => x.scenario === bar.scenario && x.workload === bar.workload)
    const cpu = s?.cpuRatio == null ? '—' : `${s.cpuRatio.median.toFixed(2)} (${s.cpuRatio.min.toFixed(2)}–${s.cpuRatio.max.toFixed(2)})`
    lines.push(`| ${bar.text} — ${bar.workload} | ${value} | ${bar.threshold.toFixed(2)} | ${met} (${bar.note}) | ${cpu} |`)
  }
  return lines.join('\n')
}

function peersTable (results: BenchResults): string {
  const lines = [
    '| Workload | Peer | Ours | Measure | Ours | Peer | Ahead (by the measure) | Server CPU µs/req, ours / peer | Redis CPU µs/req, ours / peer |',
    '|---|---|---|---|---:|---:|---|---:|---:|'
  ]
  const find = (name: string, workload: Workload): Summary | undefined => results.summary.find((x) => x.scenario === name && x.workload === workload)
  for (const p of results.peers) {
    const v = (x: number | null): string => (x === null ? '—' : p.measure === 'req/s' ? fmtInt(x) : x.toFixed(2))
    const ahead = p.ahead === null ? '—' : p.ahead ? 'yes' : '**no**'
    const o = find(p.ours, p.workload)
    const q = find(p.peer, p.workload)
    const cpu = o === undefined || q === undefined ? '—' : `${o.cpuPerRequest.toFixed(0)} / ${q.cpuPerRequest.toFixed(0)}`
    const redisCpu = o?.redisCpuPerRequest == null || q?.redisCpuPerRequest == null ? '—' : `${o.redisCpuPerRequest.toFixed(1)} / ${q.redisCpuPerRequest.toFixed(1)}`
    lines.push(`| ${p.workload} | ${scenarioInfo(p.peer).label} | ${scenarioInfo(p.ours).label} | ${p.measure} | ${v(p.oursValue)} | ${v(p.peerValue)} | ${ahead} (${p.note}) | ${cpu} | ${redisCpu} |`)
  }
  return lines.join('\n')
}

function settingsLine (results: BenchResults): string {
  const s = results.settings
  const m = results.machine
  return `${results.mode} mode, ${s.rounds} rounds, ${s.durationSeconds} s per run (CONFLICT ${s.conflictDurationSeconds} s) after ${s.warmupSeconds} s of warm-up, ` +
    `${s.connections} connections, pipelining ${s.pipelining}; ${m.cpuModel}, ${m.cores} cores, Node ${m.node}; ` +
    `load average ${m.loadAverageStart.map((x) => x.toFixed(2)).join('/')} at the start; plugin from ${s.source}/; ${results.generatedAt}`
}

function memorySection (results: BenchResults): string {
  const m = results.memory
  if (m === null) return 'Not run (`--no-memory`).'
  const quick = results.mode === 'quick' ? ` (quick mode: ${fmtInt(m.requests)} requests, not the full run's 1,000,000)` : ''
  return [
    `${fmtInt(m.requests)} NEW requests${quick} through \`app.inject\` (${m.concurrency} at a time, ${m.seconds.toFixed(1)} s) into the plugin on \`new MemoryStorage()\` with its default bounds (${fmtInt(m.maxEntries)} entries, ${fmtBytes(m.maxBytes)}).`,
    '',
    '| | before | after (full GC) |',
    '|---|---:|---:|',
    `| heap used | ${fmtBytes(m.before.heapUsed)} | ${fmtBytes(m.after.heapUsed)} |`,
    `| external (Buffers) | ${fmtBytes(m.before.external)} | ${fmtBytes(m.after.external)} |`,
    `| of which ArrayBuffers | ${fmtBytes(m.before.arrayBuffers)} | ${fmtBytes(m.after.arrayBuffers)} |`,
    `| RSS | ${fmtBytes(m.before.rss)} | ${fmtBytes(m.after.rss)} |`,
    '',
    `Store size: ${fmtInt(m.finalSize)} entries at the end, at most ${fmtInt(m.maxSizeSeen)} at any request (bound ${fmtInt(m.maxEntries)}): ` +
    `**${m.sizeWithinBound ? 'within the bound' : 'OVER the bound'}**; ${fmtBytes(m.finalCalculatedSize)} counted against \`maxBytes\`; ${m.finalLeases} leases left; ` +
    `${fmtInt(m.executions)} handler runs, ${m.non201} responses other than 201.`
  ].join('\n')
}

function conflictSection (results: BenchResults): string {
  const lines = [
    `Every connection sends the same key, which changes every ${CONFLICT_KEY_PERIOD_MS} ms, to a handler that takes ${CONFLICT_HANDLER_MS} ms: ` +
    'per key, exactly one execution is right; the others must get the documented "in progress" answer or, once the first is done, the stored response.',
    '',
    '| Scenario | req/s | Handler runs | Keys run twice | 2xx | 409 | other | Correct |',
    '|---|---:|---:|---:|---:|---:|---:|---|'
  ]
  for (const s of results.summary.filter((x) => x.workload === 'CONFLICT')) {
    const codes = s.statusCodes
    const ok = Object.entries(codes).filter(([c]) => c.startsWith('2')).reduce((a, [, n]) => a + n, 0)
    const conflict = codes['409'] ?? 0
    const other = Object.entries(codes).filter(([c]) => !c.startsWith('2') && c !== '409').reduce((a, [, n]) => a + n, 0)
    lines.push(`| ${s.label} | ${fmtInt(s.rps.median)} | ${fmtInt(s.executions)} | ${s.duplicateKeys} | ${fmtInt(ok)} | ${fmtInt(conflict)} | ${fmtInt(other)} | ${fmtCorrect(s)} |`)
  }
  return lines.join('\n')
}

/** How quiet the machine was: load averages and the spread of the bare route's own throughput. */
function conditions (results: BenchResults): string {
  const loads = results.runs.map((r) => r.loadAverage)
  const cores = results.machine.cores
  const parts = [`1-minute load average during the runs: median ${median(loads).toFixed(1)}, ${Math.min(...loads).toFixed(1)}–${Math.max(...loads).toFixed(1)}, on ${cores} cores`]
  for (const workload of ['REPLAY', 'NEW'] as const) {
    const bare = results.runs.filter((r) => r.scenario === 'bare' && r.workload === workload).map((r) => r.rps)
    if (bare.length > 0) parts.push(`bare route ${workload}: ${fmtInt(Math.min(...bare))}–${fmtInt(Math.max(...bare))} req/s over the rounds`)
  }
  const busy = median(loads) > cores
  return `**Conditions**: ${parts.join('; ')}.` + (busy
    ? ' The load counts the benchmark\'s own processes (load generator, server and store share the cores), and it was above the core count, so single runs swing widely; the paired medians absorb part of it, ' +
      'and a target is called *clear* only when the middle half of its rounds (5 rounds at least) lies on one side of it.'
    : '')
}

export function latestMarkdown (results: BenchResults): string {
  return [
    '# Benchmark results (latest run)',
    '',
    settingsLine(results),
    '',
    'Ratios are paired: each round divides a scenario\'s throughput by its baseline\'s in the same round, and the table shows the median of those.',
    '',
    conditions(results),
    '',
    markdownTable(results),
    '',
    '## Targets',
    '',
    barsTable(results),
    '',
    '## Peers',
    '',
    peersTable(results),
    '',
    '## CONFLICT',
    '',
    conflictSection(results),
    '',
    '## Memory',
    '',
    memorySection(results),
    ''
  ].join('\n')
}

// ------------------------------------------------------------------------------------------- SVG

export function escapeXml (text: string): string {
  return text.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;')
}

const COLORS = { ours: '#2563eb', peer: '#9ca3af', floor: '#4b5563', incorrect: '#dc2626', met: '#16a34a', missed: '#dc2626' }

/** Throughput of each scenario relative to its floor or baseline: one bar per scenario and workload. */
export function chartSvg (results: BenchResults): string {
  const rows: Array<{ workload: Workload, s: Summary }> = []
  for (const workload of ['REPLAY', 'NEW', 'MIXED'] as const) {
    for (const s of results.summary) {
      if (s.workload === workload && s.ratio !== null) rows.push({ workload, s })
    }
  }
  const barOf = new Map(results.bars.map((b) => [`${b.scenario}/${b.workload}`, b]))
  const labelWidth = 300
  const plotWidth = 520
  const rowHeight = 22
  const groupGap = 16
  const top = 74
  const groups = new Set(rows.map((r) => r.workload)).size
  const height = top + rows.length * rowHeight + groups * groupGap + 64
  const width = labelWidth + plotWidth + 180
  const maxRatio = Math.max(1.2, ...rows.map((r) => r.s.ratio!.median))
  // Past 1.4 a bar is cut (and marked →), so that 0.85, 0.90, 0.95 and 1.00 stay apart enough to read.
  const scaleMax = Math.min(Math.ceil(maxRatio * 10) / 10, 1.4)
  const x = (ratio: number): number => labelWidth + (Math.min(ratio, scaleMax) / scaleMax) * plotWidth
  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif" font-size="12">`)
  out.push(`<rect width="${width}" height="${height}" fill="#ffffff"/>`)
  out.push('<text x="12" y="22" font-size="15" font-weight="600">fastify-idempotency: throughput relative to each scenario\'s floor or baseline</text>')
  const m = results.machine
  out.push(`<text x="12" y="40" fill="#4b5563">Median of ${results.settings.rounds} interleaved rounds (${results.mode} mode), ratios paired by round; ${escapeXml(m.cpuModel)}, ${m.cores} cores, Node ${escapeXml(m.node)}; ${results.generatedAt.slice(0, 10)}</text>`)
  out.push('<text x="12" y="56" fill="#4b5563">Blue: fastify-idempotency. Grey: peers. Dark grey: the in-process floor. Red: incorrect (handler ran twice, or wrong answers). ✓/✗: the target for that row (undecided: its rounds straddle it).</text>')
  // reference lines
  const plotTop = top - 8
  const plotBottom = height - 52
  for (const [ratio, label, row] of [[0.85, '0.85', 1], [0.9, '0.90', 0], [0.95, '0.95', 1], [1, '1.00', 0]] as const) {
    const lx = x(ratio).toFixed(1)
    out.push(`<line x1="${lx}" y1="${plotTop}" x2="${lx}" y2="${plotBottom + row * 11}" stroke="${ratio === 1 ? '#111827' : '#6b7280'}" stroke-width="1" stroke-dasharray="${ratio === 1 ? '0' : '4 3'}"/>`)
    out.push(`<text x="${lx}" y="${plotBottom + 12 + row * 11}" text-anchor="middle" font-size="11" fill="#374151">${label}</text>`)
  }
  out.push(`<line x1="${labelWidth}" y1="${plotTop}" x2="${labelWidth}" y2="${plotBottom}" stroke="#111827"/>`)
  out.push(`<text x="${labelWidth}" y="${plotBottom + 14}" text-anchor="middle" fill="#374151">0</text>`)
  out.push(`<text x="${labelWidth + plotWidth / 2}" y="${plotBottom + 40}" text-anchor="middle" fill="#374151">throughput ÷ baseline, paired by round (1.00 = as fast as the floor or baseline; values past ${scaleMax.toFixed(1)} are cut, marked →)</text>`)
  let y = top
  let current: Workload | null = null
  for (const { workload, s } of rows) {
    if (workload !== current) {
      if (current !== null) y += groupGap
      current = workload
      out.push(`<text x="12" y="${y + 2}" font-weight="600" fill="#111827">${workload}</text>`)
      y += 8
    }
    const ratio = s.ratio!.median
    const color = s.correct === false ? COLORS.incorrect : s.kind === 'ours' ? COLORS.ours : s.kind === 'floor' ? COLORS.floor : COLORS.peer
    const label = `${scenarioInfo(s.scenario).short} ÷ ${s.baseline === null ? '' : scenarioInfo(s.baseline).short}`
    out.push(`<text x="${labelWidth - 8}" y="${y + 14}" text-anchor="end" fill="#111827">${escapeXml(label)}</text>`)
    const w = Math.max(1, x(ratio) - labelWidth)
    out.push(`<rect x="${labelWidth}" y="${y + 3}" width="${w.toFixed(1)}" height="${rowHeight - 7}" fill="${color}" rx="2"/>`)
    const bar = barOf.get(`${s.scenario}/${workload}`)
    let mark = ''
    let markColor = '#111827'
    if (bar !== undefined && bar.met !== null) {
      const undecided = bar.clear ? '' : ', undecided'
      mark = bar.met ? ` ✓ (target ${bar.threshold.toFixed(2)}${undecided})` : ` ✗ (target ${bar.threshold.toFixed(2)}${undecided})`
      markColor = bar.met ? COLORS.met : COLORS.missed
    }
    const suffix = s.correct === false ? ' incorrect' : ''
    const over = ratio > scaleMax ? ' →' : ''
    out.push(`<text x="${(x(ratio) + 5).toFixed(1)}" y="${y + 14}" fill="${markColor}" stroke="#ffffff" stroke-width="3" paint-order="stroke">${ratio.toFixed(2)}${over}${escapeXml(mark)}${suffix}</text>`)
    y += rowHeight
  }
  out.push('</svg>')
  return out.join('\n') + '\n'
}

// --------------------------------------------------------------------------------- the doc pages

/** The repository's copy of a file, for pages that ship in the package, where relative links would not resolve. */
const REPOSITORY = 'https://github.com/fastify-idempotency/fastify-idempotency/blob/main'

/** How a run is made: the same list on the user's page and in the report. */
function method (results: BenchResults): string[] {
  const s = results.settings
  return [
    '- **Servers**: every scenario is its own Node process (`bench/server.ts`, started by `bench/run.ts` through tsx), listening on 127.0.0.1 on a free port, ' +
      'Fastify logging off. Each serves one route, `POST /orders`: a small JSON body in, `201` with a small JSON body out. ' +
      `The plugin is loaded from \`${s.source}/\`.`,
    '- **Load**: autocannon (programmatic) in the orchestrator process, over real sockets, ' +
      `${s.connections} connections, pipelining ${s.pipelining}. Each run has ${s.warmupSeconds} s of warm-up (not measured, counted for correctness), then ${s.durationSeconds} s measured ` +
      `(CONFLICT: ${s.conflictDurationSeconds} s). Every workload goes through the same \`setupRequest\` hook, so the load generator spends the same work per request in every run.`,
    `- **Rounds**: ${s.rounds}. ` +
      (s.freshProcesses
        ? `Each round starts a fresh process per scenario, warms every one (${s.roundWarmupSeconds} s of MIXED traffic, which also stores the REPLAY key), then runs every workload over every scenario and stops them. `
        : `One process per scenario serves every round, warmed once (${s.roundWarmupSeconds} s of MIXED traffic, which also stores the REPLAY key); each round runs every workload over every scenario. `) +
      'Within a workload, each baseline runs next to the scenarios measured against it, and the order rotates from round to round. ' +
      'A ratio divides a scenario\'s throughput by its baseline\'s in the same round and workload; the figures are medians over rounds.',
    '- **CPU-based ratio**: the server process\'s own CPU time per response (`process.cpuUsage()` over the measured part), the baseline\'s divided by the scenario\'s. ' +
      'Throughput is what the targets are about, but on a machine where other processes take turns on the cores it moves with them; CPU per request moves less ' +
      '(under heavy load it moves too: a starved server handles more requests per wake-up), so it is shown as a cross-check. It leaves out what Redis or PostgreSQL spend, which on a shared 2-core box also costs throughput: ' +
      'for the Redis scenarios, Redis\'s own CPU time per response (`INFO cpu` before and after the measured part) is shown beside it.',
    '- **Workloads**: REPLAY (one stored key), NEW (a fresh key per request), MIXED (9 in 10 requests replay, the 10th is fresh), ' +
      `CONFLICT (all connections on one key that changes every ${CONFLICT_KEY_PERIOD_MS} ms, handler taking ${CONFLICT_HANDLER_MS} ms).`,
    '- **Baselines and floors**: the bare Fastify route (for the plugin on memory, the unflagged route and the memory peer); ' +
      'the in-process floor, measured against the bare route as the plugin on memory is: the least a layer built on Fastify\'s hooks does (in `preHandler`, a SHA-256 of `JSON.stringify` of the body and a `Map` lookup that answers or marks the key in flight; in `onSend`, the status, content type and payload kept; the oldest of 100,000 entries dropped), with no lease, token, deadline, header capture or shutdown drain; ' +
      'the Redis floor, a plain Fastify route that spends only the round trips no idempotency store can avoid: one `GET` for a replay (REPLAY, and the replays of MIXED) ' +
      'and two round trips (`SET NX PX`, handler, `SET PX`) for a fresh key, on ioredis with `enableAutoPipelining: true`. ' +
      '`RedisStorage` uses a client with the same setting. ' +
      'For each SQL database a floor through the same knex client and default pool: one primary-key `SELECT` for a replay, `INSERT` (takes the key), handler, `UPDATE` (stores the response) for a fresh key; ' +
      'in transaction mode, the `INSERT` on its own, then the handler\'s `INSERT` of an order row and the `UPDATE` in one transaction (the plugin\'s transaction-mode route writes the same row). SQLite runs in WAL with `synchronous = NORMAL`, floor and store alike. ' +
      'The plugin with encryption on is measured against the plugin without it. Express\'s bare route is express-idempotency\'s baseline.',
    '- **Correctness**: every handler counts its executions per idempotency key; the orchestrator reads the counts over IPC after each run. ' +
      'A guarded scenario is incorrect when a key\'s handler ran twice, when a REPLAY ran the handler, when a NEW key got an answer without a run, ' +
      'or when any answer was other than 2xx (409 allowed in CONFLICT), or a socket failed.',
    '- **Peers**: `@node-idempotency/core` with its memory and Redis (node-redis) adapters, wired into `preHandler`/`onSend` as its own Fastify plugin does ' +
      '(with `onResponse` called only for the request that was let through, which spares it a write on replays); `express-idempotency` with its default ' +
      'in-memory adapter on Express 5, the route checking `isHit(req)` first as its README says.',
    '- **The machine**: load generator, server, Redis, PostgreSQL and MariaDB share its cores, as they would on a small box; the ratios compare scenarios that pay the same tax. ' +
      'Quick mode is for a fast look: its runs are short and its 3 rounds decide no target on their own; the targets are read on a full run.'
  ]
}

function peersIntro (): string {
  return 'Ours and each peer on the same store kind. REPLAY, NEW and MIXED compare each one\'s throughput over its own framework\'s bare route ' +
    '(the Fastify peers share our baseline, so this is the same as comparing their req/s; express-idempotency is measured against Express\'s bare route); ' +
    'CONFLICT compares req/s. A peer that ran a handler twice or answered wrongly is reported as incorrect, not as fast.'
}

const REPRODUCE = [
  '```sh',
  'npm run bench              # full: 8 rounds, about 16 minutes on 2 cores',
  'npm run bench:purge        # purgeExpired of 1,000,000 expired rows per SQL database, under load',
  'npm run bench:pg-statements  # PostgreSQL CPU per statement of the hot path, the store\'s and the floor\'s',
  'npm run bench -- --quick   # 3 shorter rounds, 100,000 requests for the memory check: under 3 minutes',
  'npm run bench:rate -- --scenarios bare,memory,memory-sealed --workload NEW  # server CPU per request at a fixed 10,000 req/s',
  'npm run bench:instructions  # instructions per request under callgrind (needs valgrind and redis-server)',
  '```'
]

/** docs/benchmarks.md, shipped in the package: what the plugin costs a user, against the bare route and the peers. */
export function benchmarksDoc (results: BenchResults): string {
  return [
    '# Benchmarks',
    '',
    '![What a request costs: server CPU time per request and latency, on each store, against the bare route and the peers](benchmark-cost.svg)',
    '',
    'What a request costs with the plugin on each store, against the bare route and the peers: the server\'s CPU time per request (the part the bare route costs, and what the idempotency layer adds to it) and the latency. ' +
      'Throughput relative to each store\'s floor, the least any idempotency layer on that store must do:',
    '',
    '![Throughput of each scenario relative to its floor or baseline](benchmark-chart.svg)',
    '',
    `*${settingsLine(results)}.*`,
    '',
    conditions(results),
    '',
    '## Against the peers',
    '',
    peersIntro(),
    '',
    peersTable(results),
    '',
    '## How it is measured',
    '',
    ...method(results),
    '',
    '## Reproduce',
    '',
    'In a clone of the repository:',
    '',
    ...REPRODUCE,
    '',
    `The full report of this run (the performance targets, every figure, one key under many connections, a million keys in memory, and notes from profiling) is [bench/REPORT.md](${REPOSITORY}/bench/REPORT.md) in the repository; [bench/README.md](${REPOSITORY}/bench/README.md) has the options and how to profile.`,
    ''
  ].join('\n')
}

/** bench/REPORT.md, in the repository only: the run's every figure, its targets, and the notes from profiling. */
export function reportDoc (results: BenchResults, notesPath: string): string {
  const missed = results.bars.filter((b) => b.met === false)
  const met = results.bars.filter((b) => b.met === true)
  const peersBehind = results.peers.filter((p) => p.ahead === false)
  const verdict = [
    `Of the ${results.bars.length} performance targets, **${met.length} ${met.length === 1 ? 'is' : 'are'} met and ${missed.length} missed** in this run` +
      (missed.length > 0 ? ` (missed: ${missed.map((b) => `${b.scenario} ${b.workload} at ${b.value?.toFixed(2)} against ${b.threshold.toFixed(2)}${b.clear ? '' : ', undecided'}`).join('; ')})` : '') +
      (met.some((b) => !b.clear) ? `; of those met, ${met.filter((b) => !b.clear).map((b) => `${b.scenario} ${b.workload}`).join(', ')} within the noise` : '') + '.',
    peersBehind.length === 0
      ? `Against the peers: ahead on every workload they support (${results.peers.length} comparisons).`
      : `Against the peers: **behind in ${peersBehind.length} of ${results.peers.length} comparisons** (${peersBehind.map((p) => `${p.peer} ${p.workload}`).join('; ')}).`
  ]
  const notes = existsSync(notesPath) ? readFileSync(notesPath, 'utf8').trim() : ''
  return [
    '# Benchmark report',
    '',
    'The full report of the last `npm run bench`: what [docs/benchmarks.md](../docs/benchmarks.md) shows users, with the performance targets, every figure and the notes from profiling ([analysis.md](analysis.md)).',
    '',
    '![Throughput of each scenario relative to its floor or baseline](../docs/benchmark-chart.svg)',
    '',
    `*${settingsLine(results)}. Every figure of the run is in \`bench/results/latest.json\` of the checkout where it ran.*`,
    '',
    ...verdict,
    '',
    conditions(results),
    '',
    '## Targets',
    '',
    'What the plugin aims at: each store against the least work any idempotency layer on it must do (its floor), evaluated on this run\'s medians. ' +
      '"Within noise" for the unflagged route is taken as ' +
      `at least ${(1 - NOISE_ALLOWANCE).toFixed(2)} of the bare route; a scenario that ran a handler twice or answered wrongly misses its target whatever its speed.`,
    '',
    barsTable(results),
    '',
    '## Against the peers',
    '',
    peersIntro(),
    '',
    peersTable(results),
    '',
    '## How it is measured',
    '',
    ...method(results),
    '',
    '## All figures',
    '',
    markdownTable(results),
    '',
    '## CONFLICT: one key, many connections',
    '',
    conflictSection(results),
    '',
    '## Memory: a million fresh keys on the in-memory store',
    '',
    memorySection(results),
    '',
    ...(notes === '' ? [] : ['## Notes from profiling', '', notes, '']),
    '## Reproduce',
    '',
    ...REPRODUCE,
    '',
    'See [README.md](README.md) for the options, profiling, and how to read the output.',
    ''
  ].join('\n')
}
