import { describe, expect, it } from 'vitest'
import { decodeValue, encodeEntry, encodeLease, fenceOf, FENCE_LENGTH, joinLeaseToken, LEASE_END_OFFSET, splitLeaseToken, TOKEN_OFFSET, WAITERS_OFFSET, type DecodedEntry } from '../lib/storage/redis/codec.js'
import { TOKEN_LENGTH, TokenGenerator } from '../lib/storage/tokens.js'
import type { StoredResponse } from '../lib/storage/types.js'
import { UnreadableEntryError } from '../lib/storage/unreadable-entry.js'

const FINGERPRINT = 'v2:0123456789abcdef0123456789abcdef0123456789a'
const STORED_AT = 1_795_595_189_585

/** What a value encodes to and back, as Redis hands it back: bytes. */
function roundTrip (response: StoredResponse, fingerprint = FINGERPRINT): DecodedEntry {
  const encoded = encodeEntry(fingerprint, response, STORED_AT)
  const decoded = decodeValue(Buffer.isBuffer(encoded) ? encoded : Buffer.from(encoded))
  if (decoded.state !== 'completed') throw new Error('not an entry')
  return decoded
}

const shapes: Array<[string, StoredResponse]> = [
  ['a JSON body', { statusCode: 201, contentType: 'application/json; charset=utf-8', headers: { location: '/orders/1' }, body: Buffer.from('{"id":1}') }],
  ['an empty body', { statusCode: 204, contentType: null, headers: {}, body: Buffer.alloc(0) }],
  ['an omitted body', { statusCode: 200, contentType: 'text/csv', headers: { 'x-export': 'big' }, body: Buffer.alloc(0), bodyOmitted: true }],
  ['a binary body', { statusCode: 200, contentType: 'application/octet-stream', headers: {}, body: Buffer.from([0, 0xff, 0xfe, 0x7c, 0x43, 0x4c, 0x80, 0xc3, 0x28, 10]) }],
  ['a body that is only separators and tags', { statusCode: 200, contentType: 'text/plain', headers: {}, body: Buffer.from('|C12|L|W-|') }],
  ['headers with unicode and several values', { statusCode: 200, contentType: 'text/plain; charset=utf-8', headers: { 'x-name': 'caf\u00e9 \u{1F600} \u540d\u524d', 'set-cookie': ['a=1', 'b=\u00fc'] }, body: Buffer.from('h\u00e9llo \u{1F600}') }],
  ['a big text body', { statusCode: 200, contentType: 'application/json', headers: {}, body: Buffer.from(JSON.stringify({ items: Array.from({ length: 40_000 }, (_, i) => ({ i, name: `item ${i} \u00e9` })) })) }],
  ['a big binary body', { statusCode: 200, contentType: 'image/png', headers: {}, body: Buffer.from(Array.from({ length: 3 * 1024 * 1024 }, (_, i) => (i * 7919) % 256)) }]
]

describe('RedisStorage value codec', () => {
  describe('entries', () => {
    for (const [label, response] of shapes) {
      it(`round-trips ${label} byte for byte`, () => {
        const decoded = roundTrip(response)
        expect(decoded.fingerprint).toBe(FINGERPRINT)
        expect(decoded.storedAt).toBe(STORED_AT)
        expect(decoded.response.statusCode).toBe(response.statusCode)
        expect(decoded.response.contentType).toBe(response.contentType)
        expect(decoded.response.headers).toEqual(response.headers)
        expect(Buffer.compare(decoded.response.body, response.body)).toBe(0)
        expect(decoded.response.bodyOmitted).toBe(response.bodyOmitted)
      })
    }

    it('keeps an omitted body apart from an empty one', () => {
      expect(roundTrip({ statusCode: 200, contentType: null, headers: {}, body: Buffer.alloc(0) }).response).not.toHaveProperty('bodyOmitted')
      expect(roundTrip({ statusCode: 200, contentType: null, headers: {}, body: Buffer.alloc(0), bodyOmitted: true }).response.bodyOmitted).toBe(true)
    })

    it('sends a UTF-8 body as a string and any other as bytes', () => {
      expect(typeof encodeEntry(FINGERPRINT, shapes[0]![1], STORED_AT)).toBe('string')
      expect(Buffer.isBuffer(encodeEntry(FINGERPRINT, shapes[3]![1], STORED_AT))).toBe(true)
    })

    it('counts a fingerprint in bytes', () => {
      const decoded = roundTrip(shapes[0]![1], 'fp-\u00e9')
      // Fingerprints are read back as latin1, as they always were: an ASCII fingerprint is the same text.
      expect(Buffer.from(decoded.fingerprint, 'latin1').toString('utf8')).toBe('fp-\u00e9')
      expect(Buffer.compare(decoded.response.body, shapes[0]![1].body)).toBe(0)
    })

    it('reads entries of earlier versions, which end after headers or after bodyOmitted', () => {
      const head = JSON.stringify([200, 'text/plain', { a: 'b' }])
      const short = decodeValue(Buffer.from(`C2|fp${Buffer.byteLength(head)}|${head}body`))
      expect(short).toEqual({ state: 'completed', fingerprint: 'fp', response: { statusCode: 200, contentType: 'text/plain', headers: { a: 'b' }, body: Buffer.from('body') }, storedAt: null })
      const omitted = JSON.stringify([200, null, {}, 1])
      const withFlag = decodeValue(Buffer.from(`C2|fp${omitted.length}|${omitted}`))
      expect(withFlag).toMatchObject({ state: 'completed', response: { bodyOmitted: true }, storedAt: null })
    })
  })

  describe('leases', () => {
    it('round-trips a lease: its token, lease end and fingerprint', () => {
      const token = new TokenGenerator().next()
      const value = encodeLease(token, 1_800_000_000_123, FINGERPRINT)
      expect(decodeValue(Buffer.from(value))).toEqual({ state: 'in-flight', token, fingerprint: FINGERPRINT, lockExpiresAt: 1_800_000_000_123 })
    })

    it('places the fence, the waiters byte and the lease end where the scripts look for them', () => {
      const token = new TokenGenerator().next()
      const value = encodeLease(token, 1_800_000_000_123, FINGERPRINT)
      expect(value.slice(0, FENCE_LENGTH)).toBe(fenceOf(token))
      expect(value.slice(TOKEN_OFFSET, TOKEN_OFFSET + TOKEN_LENGTH)).toBe(token)
      expect(value[WAITERS_OFFSET]).toBe('-')
      expect(value.slice(LEASE_END_OFFSET)).toBe(`1800000000123|${FINGERPRINT}`)
      // A lease somebody waits for (the waiters byte set by SETRANGE) reads the same.
      const marked = Buffer.from(value)
      marked[WAITERS_OFFSET] = 0x57
      expect(decodeValue(marked)).toEqual(decodeValue(Buffer.from(value)))
    })

    it('hands out a token that carries the fingerprint, and splits it back', () => {
      const token = new TokenGenerator().next()
      const joined = joinLeaseToken({ token, fingerprint: FINGERPRINT })
      expect(joined.slice(0, TOKEN_LENGTH)).toBe(token)
      expect(splitLeaseToken(joined)).toEqual({ token, fingerprint: FINGERPRINT })
      // A bare token (what begin releases when its SET went unanswered) has an empty fingerprint.
      expect(splitLeaseToken(token)).toEqual({ token, fingerprint: '' })
    })
  })

  describe('unreadable values', () => {
    it('refuses a value of an unknown layout version', () => {
      for (const value of ['X1|fp', 'D{"v":3}', '', 'L-no-separator', 'C-no-separator']) {
        expect(() => decodeValue(Buffer.from(value)), value).toThrow(UnreadableEntryError)
      }
    })

    it('refuses a damaged entry, with the parse error as its cause', () => {
      const error = (() => {
        try { decodeValue(Buffer.from('C2|fp5|[oops')) } catch (caught) { return caught }
      })()
      expect(error).toBeInstanceOf(UnreadableEntryError)
      expect((error as Error).cause).toBeInstanceOf(Error)
      expect(() => decodeValue(Buffer.from('C2|fp9|{"a":1}xx'))).toThrow(UnreadableEntryError)
    })
  })

  describe('values written by 0.x (captured from its encoder)', () => {
    // Written by RedisStorage before the codec had a module of its own: begin, then complete, then
    // the raw value read back with GET. Decoding them must give what was stored.
    const captured = {
      json: { fingerprint: 'v2:json:abcdef0123456789', value: 'QzI0fHYyOmpzb246YWJjZGVmMDEyMzQ1Njc4OTY5fFsyMDEsImFwcGxpY2F0aW9uL2pzb247IGNoYXJzZXQ9dXRmLTgiLHsieC1pZCI6IjQyIn0sMCwxNzk1NTk1MTg5NTg1XXsiaWQiOjEsInN0YXR1cyI6ImNyZWF0ZWQifQ==' },
      empty: { fingerprint: 'v2:empty:abcdef0123456789', value: 'QzI1fHYyOmVtcHR5OmFiY2RlZjAxMjM0NTY3ODkyOXxbMjA0LG51bGwse30sMCwxNzk1NTk1MTg5NTg3XQ==' },
      omitted: { fingerprint: 'v2:omitted:abcdef0123456789', value: 'QzI3fHYyOm9taXR0ZWQ6YWJjZGVmMDEyMzQ1Njc4OTYzfFsyMDAsInRleHQvcGxhaW4iLHsic2V0LWNvb2tpZSI6WyJhPTEiLCJiPTIiXX0sMSwxNzk1NTk1MTg5NTg3XQ==' },
      binary: { fingerprint: 'v2:binary:abcdef0123456789', value: 'QzI2fHYyOmJpbmFyeTphYmNkZWYwMTIzNDU2Nzg5Nzl8WzIwMCwiYXBwbGljYXRpb24vb2N0ZXQtc3RyZWFtIix7IngtbmFtZSI6ImNhZsOpIPCfmIAg5ZCN5YmNIn0sMCwxNzk1NTk1MTg5NTg4XQD//nxDgAo=' },
      lease: { fingerprint: 'v2:lease:fp', value: 'TC4wbXd2djBqZjk4SDFIcllnNnVIWmxNcjMwMDAwMDAwMDAwNS0xNzk1NTk1MTk5NTg5fHYyOmxlYXNlOmZw' }
    }
    const decode = (name: keyof typeof captured): ReturnType<typeof decodeValue> => decodeValue(Buffer.from(captured[name].value, 'base64'))

    it('reads a JSON entry', () => {
      expect(decode('json')).toEqual({
        state: 'completed',
        fingerprint: captured.json.fingerprint,
        response: { statusCode: 201, contentType: 'application/json; charset=utf-8', headers: { 'x-id': '42' }, body: Buffer.from('{"id":1,"status":"created"}') },
        storedAt: 1795595189585
      })
    })

    it('reads an empty body and an omitted one', () => {
      expect(decode('empty')).toEqual({ state: 'completed', fingerprint: captured.empty.fingerprint, response: { statusCode: 204, contentType: null, headers: {}, body: Buffer.alloc(0) }, storedAt: 1795595189587 })
      expect(decode('omitted')).toEqual({ state: 'completed', fingerprint: captured.omitted.fingerprint, response: { statusCode: 200, contentType: 'text/plain', headers: { 'set-cookie': ['a=1', 'b=2'] }, body: Buffer.alloc(0), bodyOmitted: true }, storedAt: 1795595189587 })
    })

    it('reads a binary body with unicode headers', () => {
      expect(decode('binary')).toEqual({
        state: 'completed',
        fingerprint: captured.binary.fingerprint,
        response: { statusCode: 200, contentType: 'application/octet-stream', headers: { 'x-name': 'caf\u00e9 \u{1F600} \u540d\u524d' }, body: Buffer.from([0, 255, 254, 0x7c, 0x43, 0x80, 10]) },
        storedAt: 1795595189588
      })
    })

    it('reads a lease, and encodes one to the same layout', () => {
      const value = Buffer.from(captured.lease.value, 'base64')
      const lease = decode('lease')
      expect(lease).toMatchObject({ state: 'in-flight', fingerprint: 'v2:lease:fp' })
      if (lease.state !== 'in-flight') return
      expect(encodeLease(lease.token, lease.lockExpiresAt, lease.fingerprint)).toBe(value.toString('latin1'))
    })

    it('encodes today the bytes it encoded then', () => {
      const value = Buffer.from(captured.json.value, 'base64')
      const response = { statusCode: 201, contentType: 'application/json; charset=utf-8', headers: { 'x-id': '42' }, body: Buffer.from('{"id":1,"status":"created"}') }
      expect(Buffer.from(encodeEntry(captured.json.fingerprint, response, 1795595189585))).toEqual(value)
      const binary = { statusCode: 200, contentType: 'application/octet-stream', headers: { 'x-name': 'caf\u00e9 \u{1F600} \u540d\u524d' }, body: Buffer.from([0, 255, 254, 0x7c, 0x43, 0x80, 10]) }
      expect(encodeEntry(captured.binary.fingerprint, binary, 1795595189588)).toEqual(Buffer.from(captured.binary.value, 'base64'))
    })
  })
})
