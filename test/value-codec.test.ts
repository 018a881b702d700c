/**
 * How results are kept (lib/engine/value-codec.ts): plain data as JSON, what JSON would change
 * through devalue, and records written by this version readable by every later one.
 */
import { describe, expect, it } from 'vitest'
import { decodeValue, encodeValue, lostRecord, RESULT_ENCODING, ValueLostError, ValueNotRecordableError } from '../lib/engine/value-codec.js'

const LIMIT = 1 << 20
const encode = (value: unknown) => encodeValue(value, 'it returned', LIMIT)

describe('value codec', () => {
  it('writes plain data as JSON, and objects with toJSON as their toJSON says', () => {
    class Decimal { constructor (readonly text: string) {} toJSON () { return this.text } }
    for (const value of [{ a: [1, 'b', null, true, { c: -1.5 }] }, 'text', 0, null, [], { price: new Decimal('9.99') }]) {
      const record = encode(value)
      expect(record.contentType, JSON.stringify(value)).toBe(RESULT_ENCODING.json)
      expect(record.body.toString()).toBe(JSON.stringify(value))
    }
  })

  it('writes through devalue every value JSON would change, and reads it back as it was', () => {
    const cyclic: Record<string, unknown> = { name: 'loop' }
    cyclic.self = cyclic
    const values: unknown[] = [
      { at: new Date(0) }, 10n, { big: -(2n ** 70n) }, new Map([['k', 1]]), new Set([1, 2]), { gone: undefined }, [undefined, 1],
      NaN, Infinity, -0, { nested: Buffer.from('ab') }, new Uint8Array([1, 2]), /a+b/gi, new URL('https://example.com/x'), cyclic
    ]
    for (const value of values) {
      const record = encode(value)
      expect(record.contentType, String(value)).toBe(RESULT_ENCODING.devalue)
      const back = decodeValue(record)
      expect(back).toEqual(value)
    }
    expect(Object.is(decodeValue(encode(-0)), -0)).toBe(true)
    expect(Buffer.isBuffer((decodeValue(encode({ nested: Buffer.from('ab') })) as { nested: unknown }).nested)).toBe(true)
    const loop = decodeValue(encode(cyclic)) as typeof cyclic
    expect(loop.self).toBe(loop)
  })

  it('keeps bytes and undefined as they are', () => {
    expect(encode(Buffer.from([0, 255])).contentType).toBe(RESULT_ENCODING.bytes)
    expect(decodeValue(encode(Buffer.from([0, 255])))).toEqual(Buffer.from([0, 255]))
    expect(encode(undefined).contentType).toBe(RESULT_ENCODING.none)
    expect(decodeValue(encode(undefined))).toBeUndefined()
  })

  it('refuses what no encoding keeps, and what is over the limit, saying why', () => {
    class Response { constructor (readonly socket: object) {} }
    expect(() => encode(new Response({}))).toThrow(ValueNotRecordableError)
    expect(() => encode({ callback: () => {} })).toThrow(/cannot be kept/)
    expect(() => encodeValue('x'.repeat(10), 'step \'a\' returned', 5)).toThrow(/step 'a' returned 12 bytes; a result is kept up to maxResponseBytes \(5\)/)
  })

  it('reads a lost record as ValueLostError with its reason, and refuses a record of an unknown kind', () => {
    expect(() => decodeValue(lostRecord('too large'))).toThrow(ValueLostError)
    expect(() => decodeValue(lostRecord('too large'))).toThrow(/too large/)
    expect(() => decodeValue({ statusCode: 200, contentType: 'application/vnd.fastify-idempotency.value+v9', headers: {}, body: Buffer.alloc(0) })).toThrow(/unknown kind/)
  })

  it('reads records as this version writes them: their bytes must stay readable by every later version', () => {
    // Written once by this version; a change to the codec or to devalue that breaks them breaks stored results.
    const records: Array<[string, string, unknown]> = [
      [RESULT_ENCODING.json, '{"id":"ch_1","amount":4200}', { id: 'ch_1', amount: 4200 }],
      [RESULT_ENCODING.devalue, '[{"id":1,"at":2,"tags":3},["BigInt","9007199254740993"],["Date","2026-01-02T03:04:05.678Z"],["Set",4],"a"]',
        { id: 9007199254740993n, at: new Date('2026-01-02T03:04:05.678Z'), tags: new Set(['a']) }],
      [RESULT_ENCODING.devalue, '[{"pdf":1},["Buffer",2],"JVBERg=="]', { pdf: Buffer.from('%PDF') }],
      [RESULT_ENCODING.bytes, 'raw', Buffer.from('raw')],
      [RESULT_ENCODING.none, '', undefined]
    ]
    for (const [contentType, body, value] of records) {
      expect(decodeValue({ statusCode: 200, contentType, headers: {}, body: Buffer.from(body) })).toEqual(value)
      if (value !== undefined && !Buffer.isBuffer(value)) expect(encode(value).body.toString()).toBe(body)
    }
  })
})
