/**
 * Reading Markdown pages as a renderer does: the anchors their headings get, and the links they
 * hold (outside code), for the tests that check the documentation.
 */

const FENCED = /^[ \t]*(```+|~~~+)[^\n]*\n[\s\S]*?^[ \t]*\1[ \t]*$/gm

/** Text outside fenced code blocks and inline code, where links are. */
function prose (markdown: string): string {
  return markdown.replace(FENCED, '').replace(/`[^`\n]*`/g, '')
}

/**
 * GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a repeated one
 * numbered (`-1`, `-2`); plus explicit `<a id>` / `<a name>` targets.
 */
export function anchorsOf (markdown: string): Set<string> {
  const seen = new Map<string, number>()
  const anchors = new Set<string>()
  const text = markdown.replace(FENCED, '')
  for (const [, heading] of text.matchAll(/^#{1,6} (.+)$/gm)) {
    const base = heading!.trim().toLowerCase().replace(/[^\p{L}\p{M}\p{N}_\- ]/gu, '').replace(/ /g, '-')
    const count = seen.get(base) ?? 0
    seen.set(base, count + 1)
    anchors.add(count === 0 ? base : `${base}-${count}`)
  }
  for (const [, id] of text.matchAll(/<a\s+(?:id|name)="([^"]+)"/g)) anchors.add(id!)
  return anchors
}

/** Every link target of a page: inline links and images, reference definitions, HTML href/src. */
export function linksOf (markdown: string): string[] {
  const text = prose(markdown)
  const targets: string[] = []
  for (const [, target] of text.matchAll(/!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/g)) targets.push(target!)
  for (const [, target] of text.matchAll(/^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$/gm)) targets.push(target!)
  for (const [, target] of text.matchAll(/\b(?:href|src)="([^"]+)"/g)) targets.push(target!)
  return targets
}

/** A link that leaves the page's package: a URL with a scheme (https:, mailto:). */
export function isExternal (target: string): boolean {
  return /^[a-z][a-z0-9+.-]*:/i.test(target)
}
