/**
 * Sections of docs/benchmarks.md that one command writes and the others keep: each between its
 * own pair of markers. `npm run bench` rebuilds the page and puts back the sections
 * `bench:instructions` and `bench:rate -- --docs` wrote, as they stand.
 */

export interface Markers {
  readonly start: string
  readonly end: string
}

/** The section as it stands in `doc` (markers included), or null. */
export function sectionOf (doc: string, markers: Markers): string | null {
  const start = doc.indexOf(markers.start)
  const end = doc.indexOf(markers.end)
  return start >= 0 && end > start ? doc.slice(start, end + markers.end.length) : null
}

/**
 * `doc` with `section` (markers included) in place of the one between `markers`; where there is
 * none, inserted before the first of `anchors` found in the page, or at its end.
 */
export function withSection (doc: string, markers: Markers, section: string, anchors: readonly string[]): string {
  const start = doc.indexOf(markers.start)
  const end = doc.indexOf(markers.end)
  if (start >= 0 && end > start) return doc.slice(0, start) + section + doc.slice(end + markers.end.length)
  for (const anchor of anchors) {
    const at = doc.indexOf(anchor)
    if (at >= 0) return doc.slice(0, at + 1) + section + '\n\n' + doc.slice(at + 1)
  }
  return doc.trimEnd() + '\n\n' + section + '\n'
}
