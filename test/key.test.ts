import { describe, expect, it } from 'vitest'
import { readIdempotencyKey } from '../lib/http/key.js'
import { IdempotencyKeyInvalidError } from '../lib/errors.js'

const read = (value: string | string[] | undefined, max = 255) => readIdempotencyKey(value, 'Idempotency-Key', max)

describe('readIdempotencyKey', () => {
  it('returns undefined when the header is absent', () => {
    expect(read(undefined)).toBeUndefined()
  })

  it('accepts a bare value of visible ASCII, 1 to maxLength characters', () => {
    expect(read('8e03978e-40d5-43e8-bc93-6894a57f9324')).toBe('8e03978e-40d5-43e8-bc93-6894a57f9324')
    expect(read('a')).toBe('a')
    expect(read('x'.repeat(255))).toBe('x'.repeat(255))
    expect(read('!#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~')).toBe('!#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~')
  })

  it('unquotes the RFC 8941 sf-string form, escapes included, and ignores parameters', () => {
    expect(read('"abc"')).toBe('abc')
    expect(read('"with space"')).toBe('with space')
    expect(read('"q\\"uote\\\\"')).toBe('q"uote\\')
    expect(read('"abc";v=1')).toBe('abc')
  })

  it('measures the length after unquoting', () => {
    expect(read(`"${'x'.repeat(10)}"`, 10)).toBe('x'.repeat(10))
    expect(() => read(`"${'x'.repeat(11)}"`, 10)).toThrow(/longer than 10/)
    expect(() => read('x'.repeat(11), 10)).toThrow(/longer than 10/)
  })

  const invalid: Array<[string, string | string[]]> = [
    ['empty', ''],
    ['a space', 'a b'],
    ['a control character', 'a\u0001b'],
    ['a tab', 'a\tb'],
    ['non-ASCII', 'caf\u00e9'],
    ['an unterminated quote', '"abc'],
    ['an empty quoted string', '""'],
    ['a bad escape', '"a\\b"'],
    ['a quoted non-ASCII', '"caf\u00e9"'],
    ['a header sent twice (joined by Node)', 'a, b'],
    ['a quoted header sent twice (joined by Node)', '"a", "a"'],
    ['a header sent twice (as an array)', ['a', 'b']],
    ['too long', 'x'.repeat(256)]
  ]
  for (const [name, value] of invalid) {
    it(`refuses ${name}`, () => {
      expect(() => read(value)).toThrow(IdempotencyKeyInvalidError)
    })
  }
})
