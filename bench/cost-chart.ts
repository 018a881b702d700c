/**
 * docs/benchmark-cost.svg: what a request costs a user, for a first request (NEW) and a retry
 * (REPLAY): the server's CPU time per request and the latency, with the plugin on each store,
 * beside the bare route and each peer. Drawn from a run's summary by `npm run bench` (and
 * `--report-only`), as a hand-built SVG string like the throughput chart beside it in report.ts.
 */
import { escapeXml } from './report.js'
import { scenario as scenarioInfo, type Workload } from './scenarios/index.js'
import type { BenchResults, Summary } from './results-types.js'

/** The rows, in the order a reader compares them: each store of ours next to the peer on the same store. */
const ROWS = ['bare', 'memory', 'node-idem-memory', 'redis', 'node-idem-redis', 'knex-pg', 'knex-mariadb', 'knex-sqlite', 'express-bare', 'express-idempotency']
const GROUPS: Array<{ workload: Workload, title: string }> = [
  { workload: 'NEW', title: 'A first request (NEW: a fresh key each time): the handler runs, the response is stored' },
  { workload: 'REPLAY', title: 'A retry (REPLAY: a key already answered): the stored response is sent' }
]
const COLORS = { ours: '#2563eb', peer: '#6b7280', baseline: '#d1d5db', incorrect: '#dc2626', text: '#111827', muted: '#4b5563', grid: '#e5e7eb' }

/** The route each row adds its cost to: the bare route of its own framework. */
function bareOf (s: Summary): string {
  return s.framework === 'express' ? 'express-bare' : 'bare'
}

function fmt (value: number): string {
  return value >= 10 ? value.toFixed(0) : value.toFixed(1)
}

export function costChartSvg (results: Pick<BenchResults, 'summary' | 'settings' | 'machine' | 'mode' | 'generatedAt'>): string {
  const find = (name: string, workload: Workload): Summary | undefined => results.summary.find((s) => s.scenario === name && s.workload === workload)
  const groups = GROUPS.map((g) => ({ ...g, rows: ROWS.map((name) => find(name, g.workload)).filter((s): s is Summary => s !== undefined) }))
    .filter((g) => g.rows.length > 0)
  const all = groups.flatMap((g) => g.rows)

  const labelWidth = 215
  const cpuWidth = 420
  const gap = 120
  const latencyWidth = 300
  const rowHeight = 22
  const groupHead = 30
  const top = 124
  const width = labelWidth + cpuWidth + gap + latencyWidth + 80
  const height = top + groups.reduce((h, g) => h + groupHead + g.rows.length * rowHeight + 12, 0) + 40

  // CPU: linear from 0. Express and its peer cost several times what the rest does: past the
  // widest Fastify row the bar is cut (→) and the label keeps the figure.
  const fastifyMax = Math.max(...all.filter((s) => s.framework === 'fastify').map((s) => s.cpuPerRequest))
  const cpuStep = fastifyMax > 400 ? 200 : 100
  const cpuMax = Math.ceil((fastifyMax * 1.35) / cpuStep) * cpuStep
  const cpuX0 = labelWidth
  const cpuX = (us: number): number => cpuX0 + (Math.min(us, cpuMax) / cpuMax) * cpuWidth
  // Latency: a log scale, so that 1 ms and 500 ms both read.
  const latX0 = labelWidth + cpuWidth + gap
  const latMin = 0.5
  const latMax = 10 ** Math.ceil(Math.log10(Math.max(10, ...all.map((s) => s.p99))))
  const latX = (ms: number): number => latX0 + (Math.log10(Math.max(ms, latMin) / latMin) / Math.log10(latMax / latMin)) * latencyWidth

  const m = results.machine
  const s = results.settings
  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif" font-size="12" fill="${COLORS.text}">`)
  out.push(`<rect width="${width}" height="${height}" fill="#ffffff"/>`)
  out.push('<text x="12" y="22" font-size="15" font-weight="600">What a request costs: fastify-idempotency against the bare route and the peers</text>')
  out.push(`<text x="12" y="40" fill="${COLORS.muted}">Medians of ${s.rounds} rounds (${results.mode} mode), ${s.connections} connections over loopback sockets; ${escapeXml(m.cpuModel)}, ${m.cores} cores shared by the load generator, the server and the stores; Node ${escapeXml(m.node)}; ${results.generatedAt.slice(0, 10)}.</text>`)
  out.push(`<text x="12" y="56" fill="${COLORS.muted}">Blue: fastify-idempotency on each store. Dark grey: the peers. Light grey: the bare route of the same framework (Fastify, or Express for express-idempotency);</text>`)
  out.push(`<text x="12" y="72" fill="${COLORS.muted}">the rest of a bar, and the (+N), is what the idempotency layer adds to it. Red: incorrect (a handler ran twice, or a wrong answer).</text>`)
  out.push(`<text x="${cpuX0}" y="100" font-weight="600">Server CPU time per request, µs</text>`)
  out.push(`<text x="${cpuX0}" y="114" fill="${COLORS.muted}" font-size="11">the Node process's own; the database's is not counted, Redis's is shown beside</text>`)
  out.push(`<text x="${latX0}" y="100" font-weight="600">Latency, ms (log scale): p50 ● to p99 |</text>`)
  out.push(`<text x="${latX0}" y="114" fill="${COLORS.muted}" font-size="11">${s.connections} requests always in flight: queueing included</text>`)

  const plotBottom = height - 40
  for (let us = 0; us <= cpuMax; us += cpuStep) {
    out.push(`<line x1="${cpuX(us).toFixed(1)}" y1="${top}" x2="${cpuX(us).toFixed(1)}" y2="${plotBottom}" stroke="${COLORS.grid}"/>`)
    out.push(`<text x="${cpuX(us).toFixed(1)}" y="${plotBottom + 14}" text-anchor="middle" font-size="11" fill="${COLORS.muted}">${us}</text>`)
  }
  for (let ms = 1; ms <= latMax; ms *= 10) {
    out.push(`<line x1="${latX(ms).toFixed(1)}" y1="${top}" x2="${latX(ms).toFixed(1)}" y2="${plotBottom}" stroke="${COLORS.grid}"/>`)
    out.push(`<text x="${latX(ms).toFixed(1)}" y="${plotBottom + 14}" text-anchor="middle" font-size="11" fill="${COLORS.muted}">${ms}</text>`)
  }

  let y = top
  for (const group of groups) {
    out.push(`<text x="12" y="${y + 20}" font-weight="600">${escapeXml(group.title)}</text>`)
    y += groupHead
    for (const row of group.rows) {
      const info = scenarioInfo(row.scenario)
      const color = row.correct === false ? COLORS.incorrect : row.kind === 'ours' ? COLORS.ours : row.kind === 'peer' ? COLORS.peer : COLORS.baseline
      const name = info.short
      out.push(`<text x="${labelWidth - 10}" y="${y + 15}" text-anchor="end"${row.kind === 'baseline' ? ` fill="${COLORS.muted}"` : ''}>${escapeXml(name)}</text>`)
      const bare = row.kind === 'baseline' ? undefined : find(bareOf(row), group.workload)
      const barEnd = cpuX(row.cpuPerRequest)
      out.push(`<rect x="${cpuX0}" y="${y + 4}" width="${(barEnd - cpuX0).toFixed(1)}" height="${rowHeight - 8}" fill="${color}" rx="2"/>`)
      if (bare !== undefined) {
        out.push(`<rect x="${cpuX0}" y="${y + 4}" width="${(cpuX(Math.min(bare.cpuPerRequest, row.cpuPerRequest)) - cpuX0).toFixed(1)}" height="${rowHeight - 8}" fill="${COLORS.baseline}" rx="2"/>`)
      }
      const cut = row.cpuPerRequest > cpuMax ? ' →' : ''
      const added = bare === undefined ? '' : ` (${row.cpuPerRequest >= bare.cpuPerRequest ? '+' : '−'}${fmt(Math.abs(row.cpuPerRequest - bare.cpuPerRequest))})`
      const redis = row.redisCpuPerRequest !== null && Number.isFinite(row.redisCpuPerRequest) ? `, and Redis ${fmt(row.redisCpuPerRequest)}` : ''
      const wrong = row.correct === false ? ', incorrect' : ''
      out.push(`<text x="${(barEnd + 6).toFixed(1)}" y="${y + 15}" stroke="#ffffff" stroke-width="3" paint-order="stroke">${fmt(row.cpuPerRequest)}${cut}${escapeXml(added + redis + wrong)}</text>`)
      const p50 = latX(row.p50)
      const p99 = latX(row.p99)
      const mid = y + rowHeight / 2
      out.push(`<line x1="${p50.toFixed(1)}" y1="${mid}" x2="${p99.toFixed(1)}" y2="${mid}" stroke="${color}" stroke-width="2"/>`)
      out.push(`<line x1="${p99.toFixed(1)}" y1="${mid - 5}" x2="${p99.toFixed(1)}" y2="${mid + 5}" stroke="${color}" stroke-width="2"/>`)
      out.push(`<circle cx="${p50.toFixed(1)}" cy="${mid}" r="4" fill="${color}"/>`)
      out.push(`<text x="${(p99 + 6).toFixed(1)}" y="${y + 15}" font-size="11" fill="${COLORS.muted}">${fmt(row.p50)} / ${fmt(row.p99)}</text>`)
      y += rowHeight
    }
    y += 12
  }
  out.push('</svg>')
  return out.join('\n') + '\n'
}
