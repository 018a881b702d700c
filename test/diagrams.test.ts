import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import { diagrams } from '../scripts/diagrams.js'
import { renderSequenceDiagram } from '../scripts/sequence-diagram.js'

describe('docs/diagrams', () => {
  it('every committed SVG is what its Mermaid source draws (npm run diagrams redraws them)', () => {
    const all = diagrams()
    expect(all.length).toBeGreaterThan(0)
    for (const { svgPath, drawn } of all) expect(readFileSync(svgPath, 'utf8'), svgPath).toBe(drawn)
  })

  it('refuses what it would not draw, with the line', () => {
    const head = 'sequenceDiagram\n  participant A as Client\n  participant B as Server\n'
    expect(() => renderSequenceDiagram(`${head}  loop every second\n`)).toThrow('line 4: not in the subset')
    expect(() => renderSequenceDiagram(`${head}  A->>C: hello\n`)).toThrow('line 4: unknown participant C')
    expect(() => renderSequenceDiagram(`${head}  A->>+B: open\n`)).toThrow('"B" starts an activation it never ends')
    expect(() => renderSequenceDiagram(`${head}  B-->>-A: close\n`)).toThrow('"B" ends an activation it did not start')
  })
})
