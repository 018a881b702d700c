/**
 * The section "Server CPU per request at a fixed rate" of docs/benchmarks.md, written by
 * `npm run bench:rate -- --docs`: one table per workload, each replaced by the next run of that
 * workload and the others kept.
 */
import { sectionOf, withSection, type Markers } from './doc-sections.js'

export const FIXED_RATE_MARKERS: Markers = {
  start: '<!-- fixed-rate:start (written by npm run bench:rate -- --docs) -->',
  end: '<!-- fixed-rate:end -->'
}

const WORKLOADS = ['NEW', 'REPLAY', 'MIXED'] as const
const TITLES: Record<string, string> = { NEW: 'First requests (NEW)', REPLAY: 'Replays (REPLAY)', MIXED: 'Nine replays in ten (MIXED)' }

export interface FixedRateRun {
  workload: string
  rows: Array<{ label: string, cpu: number, user: number, system: number, rounds: number[] }>
  /** Date, machine, load and settings, as one sentence. */
  conditions: string
}

/** The marker a workload's part of the section starts with. */
function partMarker (workload: string): string {
  return `<!-- fixed-rate ${workload} -->`
}

function part (run: FixedRateRun): string {
  return [
    partMarker(run.workload),
    `### ${TITLES[run.workload] ?? run.workload}`,
    '',
    '| scenario | server CPU µs per request, median | user | system | each round |',
    '|---|---:|---:|---:|---|',
    ...run.rows.map((row) => `| ${row.label} | ${row.cpu.toFixed(1)} | ${row.user.toFixed(1)} | ${row.system.toFixed(1)} | ${row.rounds.map((cpu) => cpu.toFixed(1)).join(', ')} |`),
    '',
    `*${run.conditions}.*`
  ].join('\n')
}

/** The parts the section holds now, by workload. */
function parts (section: string | null): Map<string, string> {
  const found = new Map<string, string>()
  if (section === null) return found
  const body = section.slice(0, section.length - FIXED_RATE_MARKERS.end.length)
  for (const workload of WORKLOADS) {
    const at = body.indexOf(partMarker(workload))
    if (at === -1) continue
    const next = WORKLOADS.map((other) => body.indexOf(partMarker(other), at + 1)).filter((index) => index > at)
    found.set(workload, body.slice(at, next.length > 0 ? Math.min(...next) : body.length).trimEnd())
  }
  return found
}

/** `doc` with `run`'s table in the section (the other workloads' tables kept). */
export function fixedRateSection (doc: string, run: FixedRateRun): string {
  const kept = parts(sectionOf(doc, FIXED_RATE_MARKERS))
  kept.set(run.workload, part(run))
  const section = [
    FIXED_RATE_MARKERS.start,
    '## Server CPU per request at a fixed rate',
    '',
    'Every server gets the same requests at the same pace, well under what the slowest one serves, one server at a time, round after round; ' +
      'what is compared is the server process\'s own CPU time per answer (`process.cpuUsage()`, user and system). ' +
      'Steadier than throughput at saturation, but on a shared virtual machine it still moves with whatever else runs there: one round can cost twice another of the same server, so read the rounds beside the median, and the instruction counts above for a figure that does not move.',
    '',
    ...WORKLOADS.filter((workload) => kept.has(workload)).flatMap((workload) => [kept.get(workload)!, '']),
    FIXED_RATE_MARKERS.end
  ].join('\n')
  return withSection(doc, FIXED_RATE_MARKERS, section, ['\n## Against the peers'])
}
