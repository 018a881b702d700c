import { describe, expect, it } from 'vitest'
import { TOKEN_LENGTH, TokenGenerator, tokenIssuedAt } from '../lib/storage/tokens.js'

describe('fencing tokens', () => {
  it('are unique, of one length, and say when they were issued', () => {
    const tokens = new TokenGenerator()
    const issued = 1_750_000_000_123
    const [a, b] = [tokens.next(issued), tokens.next(issued)]
    expect(a).not.toBe(b)
    expect([a.length, b.length]).toEqual([TOKEN_LENGTH, TOKEN_LENGTH])
    expect(a).not.toContain('|')
    expect(tokenIssuedAt(a)).toBe(issued)
    expect(new TokenGenerator().next(issued).slice(0, 10)).toBe(a.slice(0, 10))
  })

  it('do not say it for tokens of earlier versions, or of other stores', () => {
    for (const other of ['kJ3m2Z8r9QxYw0pLd5sT1A000000000001', '', 'short', '.!!!!!!!!!xxxxxxxxxxxxxxxxxxxxxxxxxx', null, undefined]) {
      expect(tokenIssuedAt(other)).toBeNull()
    }
  })
})
