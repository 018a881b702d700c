/**
 * The repository's pages (the README, the changes, docs/, the examples' and the benchmarks'
 * pages) link to files the repository has and to headings those pages have. The package ships
 * the README and the changes only; test/package.test.ts checks their links from the tarball.
 */
import { describe, expect, it } from 'vitest'
import { readdirSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { checkLinks } from './helpers/markdown.js'

const root = resolve(import.meta.dirname, '..')

describe('the documentation', () => {
  it('links to files of the repository and to headings they have', () => {
    const docs = readdirSync(join(root, 'docs'), { recursive: true, encoding: 'utf8' }).filter((file) => file.endsWith('.md') && !file.startsWith('api'))
    const pages = [
      ...['README.md', 'CHANGELOG.md', 'CONTRIBUTING.md', 'examples/README.md', 'bench/README.md'],
      ...docs.map((file) => join('docs', file))
    ].map((file) => join(root, file))
    expect(pages.length).toBeGreaterThan(30)
    const { broken, followed } = checkLinks(pages, root, root)
    expect(broken).toEqual([])
    expect(followed).toBeGreaterThan(300)
  })
})
