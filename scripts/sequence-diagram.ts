/**
 * A Mermaid sequence diagram, the subset docs/diagrams/ uses, drawn as a self-contained SVG.
 *
 * Why not Mermaid's own renderer: @mermaid-js/mermaid-cli lays text out in a headless browser, which
 * neither CI nor a contributor's machine is sure to have, so the check that the committed SVG is up
 * to date could not run everywhere. beautiful-mermaid (browser-free) drops a note placed before the
 * first message, does not widen a note over several participants nor make room for it, and writes
 * its colours as CSS variables mixed with color-mix(), which image viewers and converters outside a
 * browser do not resolve. The subset below is small enough to lay out here, deterministically, so
 * test/diagrams.test.ts can compare the committed SVG on every run.
 *
 * Accepted lines: `sequenceDiagram`, `participant X as Label`, `A->>B: text` (a call, solid),
 * `A-->>B: text` (an answer, dashed), `+`/`-` before the receiver (`P->>+H`, `H-->>-P`) to start and
 * end an activation on a lifeline, `Note over A,B: text` (a note over a participant or a span;
 * over every participant it is a section heading), `%%` comments and blank lines. Anything else
 * is refused with its line number, so that the source never says more than the picture shows.
 */

interface Participant { id: string, label: string }
type Step =
  | { kind: 'message', from: string, to: string, text: string, answer: boolean, activate: boolean, deactivate: boolean }
  | { kind: 'note', from: string, to: string, text: string }

export interface SequenceDiagram { participants: Participant[], steps: Step[] }

export function parseSequenceDiagram (source: string): SequenceDiagram {
  const participants: Participant[] = []
  const steps: Step[] = []
  const known = (id: string, line: number): string => {
    if (!participants.some((p) => p.id === id)) throw new Error(`line ${line}: unknown participant ${id} (declare it with "participant ${id} as ...")`)
    return id
  }
  let header = false
  source.split('\n').forEach((raw, index) => {
    const line = index + 1
    const text = raw.trim()
    if (text === '' || text.startsWith('%%')) return
    if (!header) {
      if (text !== 'sequenceDiagram') throw new Error(`line ${line}: expected "sequenceDiagram", got "${text}"`)
      header = true
      return
    }
    let m = /^participant (\w+)(?: as (.+))?$/.exec(text)
    if (m !== null) {
      participants.push({ id: m[1]!, label: m[2] ?? m[1]! })
      return
    }
    m = /^(\w+)(-->>|->>)([+-]?)(\w+): (.+)$/.exec(text)
    if (m !== null) {
      const from = known(m[1]!, line)
      const to = known(m[4]!, line)
      if (from === to) throw new Error(`line ${line}: a message to oneself is not drawn`)
      steps.push({ kind: 'message', from, to, text: m[5]!, answer: m[2] === '-->>', activate: m[3] === '+', deactivate: m[3] === '-' })
      return
    }
    m = /^Note over (\w+)(?:,\s*(\w+))?: (.+)$/.exec(text)
    if (m !== null) {
      steps.push({ kind: 'note', from: known(m[1]!, line), to: known(m[2] ?? m[1]!, line), text: m[3]! })
      return
    }
    throw new Error(`line ${line}: not in the subset this renderer draws: "${text}"`)
  })
  if (participants.length < 2) throw new Error('a sequence diagram needs two participants or more')
  return { participants, steps }
}

const FONT = 13
const TITLE_FONT = 14
const ROW = 34
const NOTE_ROW = 30
const BOX_HEIGHT = 34
const MARGIN = 20
const COLORS = {
  text: '#111827',
  line: '#374151',
  lifeline: '#9ca3af',
  box: '#f3f4f6',
  boxStroke: '#6b7280',
  note: '#fef9c3',
  noteStroke: '#ca8a04',
  section: '#e0e7ff',
  sectionStroke: '#6366f1',
  activation: '#dbeafe',
  activationStroke: '#2563eb'
}

/**
 * A generous estimate of a label's width: the layout has no font to measure, and the SVG is read
 * with whatever sans-serif the viewer has (DejaVu Sans, the widest common one, fits).
 */
export function textWidth (text: string, size: number, bold = false): number {
  let units = 0
  for (const ch of text) {
    if ('iljtf.,:;\'|!I1 ()[]{}'.includes(ch)) units += 0.36
    else if ('mwMW@%'.includes(ch)) units += 0.9
    else if (ch >= 'A' && ch <= 'Z') units += 0.7
    else units += 0.6
  }
  return units * size * (bold ? 1.08 : 1)
}

function escapeXml (text: string): string {
  return text.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;')
}

const n = (value: number): string => String(Math.round(value * 10) / 10)

export function renderSequenceDiagram (source: string): string {
  const { participants, steps } = parseSequenceDiagram(source)
  const index = new Map(participants.map((p, i) => [p.id, i]))
  const boxWidths = participants.map((p) => textWidth(p.label, TITLE_FONT, true) + 28)
  // Centres: far enough apart for the boxes, then pushed right until every label fits its span.
  const centers: number[] = []
  participants.forEach((_, i) => {
    centers.push(i === 0 ? MARGIN + boxWidths[0]! / 2 : centers[i - 1]! + (boxWidths[i - 1]! + boxWidths[i]!) / 2 + 24)
  })
  const spans = steps
    .map((s) => {
      const a = index.get(s.from)!
      const b = index.get(s.to)!
      const width = s.kind === 'message' ? textWidth(s.text, FONT) + 28 : textWidth(s.text, FONT, true) + 24
      return { low: Math.min(a, b), high: Math.max(a, b), width, note: s.kind === 'note' }
    })
    .sort((x, y) => x.high - y.high || y.low - x.low)
  for (const span of spans) {
    if (span.note) continue
    const deficit = span.width - (centers[span.high]! - centers[span.low]!)
    if (deficit > 0) for (let i = span.high; i < centers.length; i++) centers[i]! += deficit
  }
  // A note over one participant, or one wider than its span, is centred and may overhang.
  let right = centers[centers.length - 1]! + boxWidths[boxWidths.length - 1]! / 2
  let left = MARGIN
  for (const span of spans.filter((s) => s.note)) {
    const middle = (centers[span.low]! + centers[span.high]!) / 2
    const half = Math.max(span.width, centers[span.high]! - centers[span.low]! + 40) / 2
    left = Math.min(left, middle - half)
    right = Math.max(right, middle + half)
  }
  const shift = MARGIN - left
  for (let i = 0; i < centers.length; i++) centers[i]! += shift
  const width = Math.ceil(right + shift + MARGIN)

  const body: string[] = []
  const top = MARGIN + BOX_HEIGHT
  let y = top + 14
  const activeSince = new Map<string, number[]>()
  const activations: string[] = []
  for (const step of steps) {
    const a = centers[index.get(step.from)!]!
    const b = centers[index.get(step.to)!]!
    if (step.kind === 'note') {
      const section = step.from === participants[0]!.id && step.to === participants[participants.length - 1]!.id
      const w = Math.max(textWidth(step.text, FONT, section) + 24, Math.abs(b - a) + 40)
      const x = (a + b) / 2 - w / 2
      body.push(`<rect x="${n(x)}" y="${n(y)}" width="${n(w)}" height="${NOTE_ROW - 8}" rx="3" fill="${section ? COLORS.section : COLORS.note}" stroke="${section ? COLORS.sectionStroke : COLORS.noteStroke}"/>`)
      body.push(`<text x="${n((a + b) / 2)}" y="${n(y + 15)}" text-anchor="middle"${section ? ' font-weight="600"' : ''}>${escapeXml(step.text)}</text>`)
      y += NOTE_ROW
      continue
    }
    const arrowY = y + 20
    const direction = b > a ? 1 : -1
    const start = a + direction * (activeSince.get(step.from)?.length ? 5 : 0)
    if (step.deactivate) {
      const since = activeSince.get(step.from)?.pop()
      if (since === undefined) throw new Error(`"${step.from}" ends an activation it did not start`)
      activations.push(`<rect x="${n(a - 5)}" y="${n(since)}" width="10" height="${n(arrowY - since)}" fill="${COLORS.activation}" stroke="${COLORS.activationStroke}"/>`)
    }
    const end = b - direction * ((activeSince.get(step.to)?.length ?? 0) > 0 || step.activate ? 5 : 0)
    body.push(`<text x="${n((a + b) / 2)}" y="${n(arrowY - 6)}" text-anchor="middle" class="label">${escapeXml(step.text)}</text>`)
    body.push(`<line x1="${n(start)}" y1="${n(arrowY)}" x2="${n(end - direction * 8)}" y2="${n(arrowY)}" stroke="${COLORS.line}" stroke-width="1.3"${step.answer ? ' stroke-dasharray="5 4"' : ''}/>`)
    body.push(`<path d="M${n(end)} ${n(arrowY)} l${n(-direction * 9)} -4.5 v9 z" fill="${COLORS.line}"/>`)
    if (step.activate) activeSince.set(step.to, [...(activeSince.get(step.to) ?? []), arrowY])
    y += ROW
  }
  for (const [id, open] of activeSince) if (open.length > 0) throw new Error(`"${id}" starts an activation it never ends`)
  const height = Math.ceil(y + 10 + MARGIN)

  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif" font-size="${FONT}" fill="${COLORS.text}">`)
  out.push('<style>.label { paint-order: stroke; stroke: #ffffff; stroke-width: 4px; stroke-linejoin: round; }</style>')
  out.push(`<rect width="${width}" height="${height}" fill="#ffffff"/>`)
  participants.forEach((p, i) => {
    const x = centers[i]!
    out.push(`<line x1="${n(x)}" y1="${top}" x2="${n(x)}" y2="${height - MARGIN}" stroke="${COLORS.lifeline}" stroke-dasharray="3 3"/>`)
    out.push(`<rect x="${n(x - boxWidths[i]! / 2)}" y="${MARGIN}" width="${n(boxWidths[i]!)}" height="${BOX_HEIGHT}" rx="4" fill="${COLORS.box}" stroke="${COLORS.boxStroke}"/>`)
    out.push(`<text x="${n(x)}" y="${MARGIN + 22}" text-anchor="middle" font-size="${TITLE_FONT}" font-weight="600">${escapeXml(p.label)}</text>`)
  })
  out.push(...activations, ...body, '</svg>')
  return out.join('\n') + '\n'
}
