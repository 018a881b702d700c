/**
 * Reading Markdown pages as a renderer does: the anchors their headings get, and the links they
 * hold (outside code), for the tests that check the documentation.
 */
import { existsSync, readFileSync, statSync } from 'node:fs'
import { dirname, join, relative, resolve } from 'node:path'

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

/** The address of this repository's files on its main branch, which this checkout will be once merged. */
export const REPOSITORY_FILES = 'https://github.com/fastify-idempotency/fastify-idempotency/blob/main/'

export interface LinkCheck {
  /** Each link that leads nowhere, with its page (relative to `base`) and why. */
  broken: string[]
  /** How many links were followed, and how many of them into the repository by its address. */
  followed: number
  inRepository: number
}

/**
 * Follows the links of `pages`: a relative one must name a file under `base` (the package, or the
 * repository), an address of REPOSITORY_FILES a file of the checkout at `repository`, and an
 * anchor a heading of the page it names. Other addresses are not followed.
 */
export function checkLinks (pages: string[], base: string, repository: string): LinkCheck {
  const result: LinkCheck = { broken: [], followed: 0, inRepository: 0 }
  for (const page of pages) {
    for (const link of linksOf(readFileSync(page, 'utf8'))) {
      const inRepository = link.startsWith(REPOSITORY_FILES)
      if (!inRepository && isExternal(link)) continue
      const [path = '', anchor] = (inRepository ? link.slice(REPOSITORY_FILES.length) : link).split('#') as [string, string | undefined]
      const within = inRepository ? repository : base
      const target = path === '' ? page : inRepository ? join(repository, decodeURIComponent(path)) : resolve(dirname(page), decodeURIComponent(path))
      result.followed++
      if (inRepository) result.inRepository++
      const where = `${relative(base, page)}: ${link}`
      if (relative(within, target).startsWith('..') || !existsSync(target)) result.broken.push(`${where} (${inRepository ? 'not in the repository' : 'no such file here'})`)
      else if (anchor !== undefined && statSync(target).isFile() && target.endsWith('.md') && !anchorsOf(readFileSync(target, 'utf8')).has(anchor)) result.broken.push(`${where} (no such heading)`)
    }
  }
  return result
}
