/**
 * `npm run diagrams`: draws every docs/diagrams/*.mmd as the SVG beside it (committed, so that
 * docs and the package show it without any tool). `--check` draws them in memory and fails when a
 * committed SVG differs from its source (test/diagrams.test.ts does the same on every test run).
 */
import { readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { renderSequenceDiagram } from './sequence-diagram.js'

export const DIAGRAMS_DIR = fileURLToPath(new URL('../docs/diagrams/', import.meta.url))

/** Each source and its SVG: the file it is committed as, and what the source draws now. */
export function diagrams (): Array<{ svgPath: string, drawn: string }> {
  return readdirSync(DIAGRAMS_DIR).filter((name) => name.endsWith('.mmd')).sort().map((name) => ({
    svgPath: join(DIAGRAMS_DIR, name.replace(/\.mmd$/, '.svg')),
    drawn: renderSequenceDiagram(readFileSync(join(DIAGRAMS_DIR, name), 'utf8'))
  }))
}

if (process.argv[1] !== undefined && fileURLToPath(import.meta.url) === process.argv[1]) {
  const check = process.argv.includes('--check')
  let stale = 0
  for (const { svgPath, drawn } of diagrams()) {
    let committed = ''
    try { committed = readFileSync(svgPath, 'utf8') } catch {}
    if (committed === drawn) continue
    if (check) {
      stale++
      console.error(`${svgPath} is not what its source draws: run npm run diagrams`)
    } else {
      writeFileSync(svgPath, drawn)
      console.log(`wrote ${svgPath}`)
    }
  }
  process.exitCode = stale === 0 ? 0 : 1
}
