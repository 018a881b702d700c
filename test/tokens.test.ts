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

  it('write the issue time and the counter in base 36, every digit, across the places where the last two digits roll over', () => {
    const tokens = new TokenGenerator()
    const random = tokens.next(0).slice(10, 25)
    const times = [0, 1, 1295, 1296, 1297, 46_655, 46_656, 1_750_000_000_123, 1_750_000_001_295, 36 ** 9 - 1]
    for (const time of times) {
      const token = tokens.next(time)
      expect(token.slice(0, 10)).toBe(`.${time.toString(36).padStart(9, '0')}`)
      expect(tokenIssuedAt(token)).toBe(time)
    }
    // Counters 1 to 3,000 (the first token was number 1), each written whole.
    const counted = new TokenGenerator()
    for (let count = 1; count <= 3000; count++) {
      const token = counted.next(1_750_000_000_000 + (count % 3))
      expect(token.slice(25)).toBe(count.toString(36).padStart(11, '0'))
      expect(token).toHaveLength(TOKEN_LENGTH)
    }
    expect(random).toHaveLength(15)
  })

  it('do not say it for tokens of earlier versions, or of other stores', () => {
    for (const other of ['kJ3m2Z8r9QxYw0pLd5sT1A000000000001', '', 'short', '.!!!!!!!!!xxxxxxxxxxxxxxxxxxxxxxxxxx', null, undefined]) {
      expect(tokenIssuedAt(other)).toBeNull()
    }
  })
})
