import { describe, expect, it } from 'vitest'
import { createHash } from 'node:crypto'
import type { FastifyRequest } from 'fastify'
import { Readable } from 'node:stream'
import canonicalizeModule from 'canonicalize'
import fc from 'fast-check'
import { BodyNestedTooDeeplyError, canonicalValue, FingerprintValueError, IncomparableValueError, MAX_DEPTH } from '../lib/fingerprint/canonical-value.js'
import { normalizeFingerprint, type FingerprintOptions } from '../lib/fingerprint/fingerprint.js'
import { canonicalMediaType } from '../lib/fingerprint/media-type.js'
import { routeTag } from '../lib/fingerprint/record.js'
import { fingerprintRequest } from '../lib/http/request-fingerprint.js'

const canonicalize = canonicalizeModule as unknown as (input: unknown) => string

function request (parts: { body?: unknown, method?: string, url?: string, headers?: Record<string, string | string[]> }): FastifyRequest {
  return { body: parts.body, method: parts.method ?? 'POST', url: parts.url ?? '/orders', headers: parts.headers ?? {} } as unknown as FastifyRequest
}
/** The digest of a request's fingerprint record. */
const fp = (parts: Parameters<typeof request>[0], options: FingerprintOptions = {}) => fingerprintRequest(request(parts), '/orders', normalizeFingerprint(options), null, undefined).record.slice(-43)

describe('fingerprint', () => {
  it('is a SHA-256 in base64url', () => {
    expect(fp({ body: { a: 1 } })).toMatch(/^[A-Za-z0-9_-]{43}$/)
  })

  it('canonicalizes JSON: member order does not matter, nested or not', () => {
    expect(fp({ body: { a: 1, b: { c: [1, { d: 2, e: 3 }] } } })).toBe(fp({ body: { b: { c: [1, { e: 3, d: 2 }] }, a: 1 } }))
  })

  it('pins the documented encoding: a stored fingerprint stays valid across releases', () => {
    const part = (type: string, data: string) => `${type}${Buffer.byteLength(data)}:${data}`
    // RFC 8785: members sorted by UTF-16 code units, so "10" before "2"; 1.50 written as 1.5.
    const canonical = '{"10":"x","2":{"a":1.5,"b":"\u00e9"}}'
    // Version 3: the parts alone; the record says the version and the option set.
    const expected = createHash('sha256').update(part('j', canonical)).digest('base64url')
    const body = JSON.parse('{ "2": { "b": "\u00e9", "a": 1.50 }, "10": "x" }')
    expect(fingerprintRequest(request({ body }), '/orders', normalizeFingerprint({}), null, undefined).record).toBe(`3.${routeTag('/orders')}.{}.${expected}`)
    const withPath = normalizeFingerprint({ path: true, method: true, headers: ['X-B', 'x-a'] })
    expect(fingerprintRequest(request({ body, method: 'POST', url: '/orders?x=1', headers: { 'x-a': '1' } }), '/orders', withPath, null, undefined).record)
      .toBe(`3.${routeTag('/orders')}.{"method":true,"path":true,"headers":["x-a","x-b"]}.${createHash('sha256').update(part('m', 'POST') + part('p', '/orders') + part('h', '1') + 'a' + part('j', canonical)).digest('base64url')}`)
  })

  it('keeps array order', () => {
    expect(fp({ body: [1, 2] })).not.toBe(fp({ body: [2, 1] }))
  })

  it('sorts integer-like member names as strings (RFC 8785), unlike JavaScript objects', () => {
    const parsed = JSON.parse('{"10":"x","2":"y"}')
    const rebuilt: Record<string, string> = {}
    rebuilt['2'] = 'y'
    rebuilt['10'] = 'x'
    expect(fp({ body: parsed })).toBe(fp({ body: rebuilt }))
  })

  it('tells values apart by type and content', () => {
    const bodies = [{ a: 1 }, { a: '1' }, { a: true }, { a: null }, { a: [] }, { a: {} }, { a: 1, b: undefined, c: 2 }, 'a', Buffer.from('b'), null]
    const prints = new Set(bodies.map((body) => fp({ body })))
    expect(prints.size).toBe(bodies.length)
  })

  it('hashes a string and a Buffer of the same bytes alike, and JSON text differently from its parse', () => {
    expect(fp({ body: 'abc' })).toBe(fp({ body: Buffer.from('abc') }))
    expect(fp({ body: '{"a":1}' })).not.toBe(fp({ body: { a: 1 } }))
  })

  it('tells an absent body from an empty one and from a JSON null', () => {
    expect(fp({ body: undefined })).not.toBe(fp({ body: null }))
    expect(fp({ body: undefined })).not.toBe(fp({ body: '' }))
  })

  it('tells a JSON string body from the same text sent as text', () => {
    const json = { 'content-type': 'application/json' }
    expect(fp({ body: 'abc', headers: json })).not.toBe(fp({ body: 'abc', headers: { 'content-type': 'text/plain' } }))
    expect(fp({ body: 'abc', headers: { 'content-type': 'application/problem+json' } })).toBe(fp({ body: 'abc', headers: json }))
  })

  it('tells a missing Content-Type from an empty one', () => {
    expect(fp({ headers: {} }, { contentType: true })).not.toBe(fp({ headers: { 'content-type': '' } }, { contentType: true }))
  })

  it('includes only the selected components, and each changes it when selected', () => {
    const base = { body: { a: 1 }, method: 'POST', url: '/a?x=1', headers: { 'content-type': 'application/json', 'x-tenant': 't1' } }
    const changes: Array<[FingerprintOptions, Parameters<typeof request>[0]]> = [
      [{ method: true }, { ...base, method: 'PUT' }],
      [{ path: true }, { ...base, url: '/b?x=1' }],
      [{ query: true }, { ...base, url: '/a?x=2' }],
      [{ contentType: true }, { ...base, headers: { ...base.headers, 'content-type': 'text/plain' } }],
      [{ headers: ['X-Tenant'] }, { ...base, headers: { ...base.headers, 'x-tenant': 't2' } }],
      [{}, { ...base, body: { a: 2 } }]
    ]
    for (const [options, changed] of changes) {
      expect(fp(changed, options), JSON.stringify(options)).not.toBe(fp(base, options))
      if (Object.keys(options).length > 0) expect(fp(changed), JSON.stringify(options)).toBe(fp(base))
    }
  })

  it('differs between option sets for the same request: the record names the set, the digest need not differ', () => {
    const req = { body: { a: 1 } }
    const sets: FingerprintOptions[] = [{}, { method: true }, { path: true }, { query: true }, { contentType: true }, { headers: ['x'] }, { body: false }, { body: { include: ['/a'] } }, { body: { exclude: ['/b'] } }]
    const records = sets.map((options) => fingerprintRequest(request(req), '/orders', normalizeFingerprint(options), null, undefined).record)
    expect(new Set(records).size).toBe(sets.length)
    // Version 3 hashes the parts alone: excluding a member the body does not have leaves the same parts.
    expect(fp(req, { body: { exclude: ['/b'] } })).toBe(fp(req, {}))
  })

  it('sorts query parameters by name, keeps the order of repeated ones, and decodes them', () => {
    const q = { query: true }
    expect(fp({ url: '/?b=2&a=1' }, q)).toBe(fp({ url: '/?a=1&b=2' }, q))
    expect(fp({ url: '/?a=1&a=2' }, q)).not.toBe(fp({ url: '/?a=2&a=1' }, q))
    expect(fp({ url: '/?a=%41' }, q)).toBe(fp({ url: '/?a=A' }, q))
    expect(fp({ url: '/' }, q)).toBe(fp({ url: '/?' }, q))
    expect(fp({ url: '/?a=1&b' }, q)).not.toBe(fp({ url: '/?a=1b' }, q))
  })

  it('does not let part boundaries shift (length-prefixed encoding)', () => {
    const o = { headers: ['x-a', 'x-b'] }
    expect(fp({ headers: { 'x-a': 'ab', 'x-b': 'c' } }, o)).not.toBe(fp({ headers: { 'x-a': 'a', 'x-b': 'bc' } }, o))
    expect(fp({ headers: { 'x-a': '' } }, o)).not.toBe(fp({ headers: {} }, o))
  })

  it('compares header names case-insensitively and the content type case-insensitively', () => {
    expect(fp({ headers: { 'x-t': '1' } }, { headers: ['X-T'] })).toBe(fp({ headers: { 'x-t': '1' } }, { headers: ['x-t'] }))
    expect(fp({ headers: { 'content-type': 'Application/JSON' } }, { contentType: true })).toBe(fp({ headers: { 'content-type': 'application/json' } }, { contentType: true }))
  })

  it('counts the content type as a media type: case, spacing, quoting and order aside, the boundary left out', () => {
    const alike = (a: string, b: string, options: FingerprintOptions = { contentType: true }) => expect(fp({ headers: { 'content-type': a } }, options), `${a} | ${b}`).toBe(fp({ headers: { 'content-type': b } }, options))
    const unlike = (a: string, b: string) => expect(fp({ headers: { 'content-type': a } }, { contentType: true }), `${a} | ${b}`).not.toBe(fp({ headers: { 'content-type': b } }, { contentType: true }))
    alike('multipart/form-data; boundary=----formdata-undici-1', 'multipart/form-data; boundary=----formdata-undici-2')
    alike('multipart/form-data; boundary="a b"', 'Multipart/Form-Data')
    alike('multipart/form-data; boundary=x1', 'multipart/form-data; boundary=x2', { headers: ['content-type'] })
    alike('text/plain; Charset="UTF-8"; format=flowed', 'text/plain;format=flowed;charset=utf-8')
    alike('application/x-custom; a="x;y"; b=1', 'application/x-custom;b=1;a="x;y"')
    unlike('application/json', 'application/json; charset=utf-8')
    unlike('text/plain; charset=utf-8', 'text/plain; charset=latin1')
    unlike('application/x-custom; version=A', 'application/x-custom; version=a')
    unlike('application/x-custom; a="x;y"', 'application/x-custom; a=x')
    unlike('application/x-custom; flag', 'application/x-custom')
    unlike('text/plain; a=1; a=2', 'text/plain; a=2; a=1')
    expect(canonicalMediaType('Text/Plain ;Charset="UTF-8"; Name="a b"; boundary=z; odd; q="\\\\"')).toBe('text/plain;charset=utf-8;name="a b";odd;q="\\\\"')
    // Empty parameters, a trailing ';', a quoted string never closed, an escape at the very end.
    expect(canonicalMediaType('text/plain;; a=1;')).toBe('text/plain;a=1')
    expect(canonicalMediaType('text/plain; a="open; b=2')).toBe('text/plain;a="open; b=2"')
    expect(canonicalMediaType('text/plain; a="x\\')).toBe('text/plain;a="x\\\\"')
    expect(canonicalMediaType('text/plain; a=')).toBe('text/plain;a=""')
  })

  it('selects JSON members by pointer: include keeps only those, exclude drops those', () => {
    const include = { body: { include: ['/amount', '/payer/id'] } }
    expect(fp({ body: { amount: 1, payer: { id: 'p', name: 'x' }, note: 'a' } }, include))
      .toBe(fp({ body: { amount: 1, payer: { id: 'p', name: 'y' }, note: 'b' } }, include))
    expect(fp({ body: { amount: 1, payer: { id: 'p' } } }, include)).not.toBe(fp({ body: { amount: 1, payer: { id: 'q' } } }, include))
    expect(fp({ body: { amount: 1 } }, include)).not.toBe(fp({ body: { payer: { id: 1 } } }, include))

    const exclude = { body: { exclude: ['/meta/sentAt', '/items/0', '/a~1b'] } }
    expect(fp({ body: { x: 1, meta: { sentAt: 1, v: 2 }, items: ['t1', 'keep'], 'a/b': 1 } }, exclude))
      .toBe(fp({ body: { x: 1, meta: { sentAt: 2, v: 2 }, items: ['t2', 'keep'], 'a/b': 2 } }, exclude))
    expect(fp({ body: { x: 1, items: ['t1', 'keep'] } }, exclude)).not.toBe(fp({ body: { x: 1, items: ['t1', 'other'] } }, exclude))
  })

  it('does not change the request body while selecting members', () => {
    const body = { a: 1, meta: { sentAt: 1 } }
    fp({ body }, { body: { exclude: ['/meta/sentAt'] } })
    expect(body).toEqual({ a: 1, meta: { sentAt: 1 } })
  })
})

describe('canonicalValue (bodies other parsers made)', () => {
  it('writes exactly what canonicalize writes for every JSON value', () => {
    fc.assert(fc.property(fc.jsonValue(), (value) => {
      expect(canonicalValue(value)).toBe(canonicalize(value))
    }), { numRuns: 300 })
  })

  it('writes the same for values whose members are already in canonical order (written by JSON.stringify alone)', () => {
    const sorted = (value: unknown): unknown => {
      if (Array.isArray(value)) return value.map(sorted)
      if (value === null || typeof value !== 'object') return value
      return Object.fromEntries(Object.keys(value).sort().map((name) => [name, sorted((value as Record<string, unknown>)[name])]))
    }
    fc.assert(fc.property(fc.jsonValue(), (value) => {
      const inOrder = sorted(value)
      expect(canonicalValue(inOrder)).toBe(canonicalize(value))
      expect(canonicalValue(inOrder, 'json')).toBe(canonicalize(value))
    }), { numRuns: 300 })
    // What JSON.stringify writes otherwise than the canonical text must not take that way.
    expect(canonicalValue({ a: 1, toJSON: () => 'x' })).toBe('\u0000oObject:"x"')
    expect(canonicalValue({ a: [1, , 3] })).toBe('{"a":[1,null,3]}') // eslint-disable-line no-sparse-arrays
    expect(canonicalValue({ a: undefined, b: 1 })).toBe('{"b":1}')
    expect(canonicalValue({ a: 1n })).toBe('{"a":\u0000n1}')
    expect(canonicalValue({ a: Number.NaN })).toBe('{"a":\u0000fNaN}')
    expect(canonicalValue({ a: new Date(0) })).toBe(`{"a":\u0000oDate:${JSON.stringify(new Date(0))}}`)
    // Integer-like names come first in an object, whatever order canonical JSON puts them in.
    expect(canonicalValue({ 9: 'a', 10: 'b', '-': 'c' })).toBe('{"-":"c","10":"b","9":"a"}')
    const bare = Object.assign(Object.create(null) as Record<string, unknown>, { a: 1, b: { c: 'd' } })
    expect(canonicalValue(bare)).toBe('{"a":1,"b":{"c":"d"}}')
    class Point { x = 1 }
    expect(canonicalValue({ a: new Point() })).toBe('{"a":{"x":1}}')
    let deep: unknown = 'end'
    for (let depth = 0; depth < 40; depth++) deep = { a: deep }
    expect(canonicalValue(deep)).toBe(canonicalize(deep))
    const cyclic: Record<string, unknown> = { a: 1 }
    cyclic.b = cyclic
    expect(canonicalValue(cyclic)).toBe('{"a":1,"b":\u0000r1}')
    // A short string with something to escape, and a long one, written as JSON writes them.
    for (const text of ['a"b', 'a\\b', 'tab\there', 'lone \ud800', 'é €', 'x'.repeat(40) + '"']) {
      expect(canonicalValue({ [text]: text })).toBe(`{${JSON.stringify(text)}:${JSON.stringify(text)}}`)
    }
  })

  it('handles cycles, Buffers, streams and functions, and tells different file bytes apart', () => {
    const entry = (bytes: Buffer) => {
      const body: Record<string, unknown> = { note: { value: 'monthly' } }
      body.file = { type: 'file', filename: 'a.bin', _buf: bytes, file: Readable.from([]), fields: body, toBuffer: async () => bytes }
      return body
    }
    const one = canonicalValue(entry(Buffer.from('one')))
    expect(one).toBe(canonicalValue(entry(Buffer.from('one'))))
    expect(one).not.toBe(canonicalValue(entry(Buffer.from('two'))))
    expect(one).toContain('\u0000r2')
    expect(one).toContain('\u0000s')
    expect(one).not.toContain('toBuffer')
  })

  it('refuses a body nested deeper than its limit with an error of its own, and takes one nested exactly that deep', () => {
    const nest = (depth: number): unknown => JSON.parse('['.repeat(depth) + ']'.repeat(depth))
    expect(canonicalValue(nest(MAX_DEPTH))).toHaveLength(2 * MAX_DEPTH)
    expect(() => canonicalValue(nest(MAX_DEPTH + 1))).toThrow(BodyNestedTooDeeplyError)
    let deep: unknown = {}
    for (let i = 0; i < MAX_DEPTH + 5; i++) deep = { deep }
    expect(() => canonicalValue(deep)).toThrow(BodyNestedTooDeeplyError)
  })

  it('writes every value JSON cannot hold as a token of its own, so no two values are alike', () => {
    const floats = new Float64Array([1])
    const values: unknown[] = [
      new Map([['a', 1]]), new Map([['a', 2]]), { a: 1 }, new Set([1]), new Set([2]), [1], {},
      1n, 2n, '1', 1, Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, null,
      new Date(0), new Date(0).toJSON(), new Date(Number.NaN), floats, new Uint8Array(floats.buffer), Buffer.from(floats.buffer),
      floats.buffer, new DataView(floats.buffer), Readable.from([]), new URL('https://a.example/'), 'https://a.example/'
    ]
    const texts = values.map((value) => canonicalValue(value))
    // A Buffer and a Uint8Array of the same bytes are the same bytes.
    expect(new Set(texts).size).toBe(values.length - 1)
    expect(texts[19]).toBe(texts[20])
    expect(canonicalValue({ when: new Date(0) })).toBe('{"when":\u0000oDate:"1970-01-01T00:00:00.000Z"}')
    expect(canonicalValue([() => 1, Symbol('s'), undefined])).toBe('[null,null,null]')
    expect(canonicalValue({ f: () => 1, s: Symbol('s'), u: undefined, a: 1 })).toBe('{"a":1}')
    expect(canonicalValue({ toJSON: () => undefined })).toBe('\u0000oObject:null')
  })

  it('walks objects whose prototypes hold no methods: null, a query-string parser\'s, a class of fields only', () => {
    const Empty = function (this: Record<string, unknown>) {} as unknown as new () => Record<string, unknown>
    Empty.prototype = Object.create(null)
    const parsed = new Empty()
    parsed.b = '2'
    parsed.a = '1'
    class Fields { a = '1'; b = '2' }
    const plain = canonicalValue({ a: '1', b: '2' })
    expect(canonicalValue(parsed)).toBe(plain)
    expect(canonicalValue(new Fields())).toBe(plain)
    expect(canonicalValue(Object.assign(Object.create(null), { b: '2', a: '1' }))).toBe(plain)
  })

  it('refuses a value of the server\'s making that has no canonical form, saying where it is', () => {
    class Point { readonly #x = 1; get x (): number { return this.#x } }
    const cases: Array<[unknown, string, RegExp]> = [
      [{ items: [{ at: new Point() }] }, '/items/0/at', /instance of Point/],
      [{ 'a/b': { get c () { throw new Error('not loaded') } } }, '/a~1b/c', /reading a member threw/],
      [{ m: new Map([['k', new Point()]]) }, '/m/0/1', /instance of Point/],
      [{ d: { toJSON () { throw new Error('no') } } }, '/d', /toJSON of an instance of Object threw/],
      [new WeakMap(), '', /instance of WeakMap/],
      [[new (class { method (): void {} })()], '/0', /instance of an object without a class name/],
      [() => 1, '', /the body is a function/]
    ]
    for (const [value, path, reason] of cases) {
      let error: unknown
      try {
        canonicalValue(value)
      } catch (caught) {
        error = caught
      }
      expect(error, path).toBeInstanceOf(FingerprintValueError)
      expect((error as FingerprintValueError).path).toBe(path)
      expect((error as FingerprintValueError).message).toMatch(reason)
    }
  })
})

describe('canonicalValue as version 1 wrote it (for entries 0.1.0 stored)', () => {
  it('on the JSON path, writes what canonicalize wrote, Dates and other toJSON values included', () => {
    fc.assert(fc.property(fc.jsonValue(), fc.date({ noInvalidDate: true }), (value, date) => {
      const body = { value, date, nested: [{ date }] }
      expect(canonicalValue(body, 'json')).toBe(canonicalize(body))
    }), { numRuns: 200 })
  })

  it('on the path for other parsers, writes the tokens 0.1.0 wrote: bytes (of any view) by length and hash, streams, back-references', () => {
    const body: Record<string, unknown> = { file: Buffer.from('one'), floats: new Float64Array([1]), stream: Readable.from([]), fn: () => 1 }
    body.self = body
    const bytes = (data: Buffer) => `\u0000b${data.length}:${createHash('sha256').update(data).digest('base64url')}`
    expect(canonicalValue(body, 'value')).toBe(`{"file":${bytes(Buffer.from('one'))},"floats":${bytes(Buffer.from(new Float64Array([1]).buffer))},"self":\u0000r1,"stream":\u0000s}`)
  })

  it('cannot compare a value version 1 wrote as it wrote another', () => {
    const cycle: Record<string, unknown> = {}
    cycle.self = cycle
    const json: unknown[] = [new Map(), new Set(), 1n, Number.NaN, Buffer.from('a'), { f: () => 1 }, [() => 1], cycle, Readable.from([]), { toJSON: () => undefined }, () => 1]
    for (const value of json) expect(() => canonicalValue(value, 'json'), String(value)).toThrow(IncomparableValueError)
    for (const value of [new Map(), new ArrayBuffer(2), 1n]) expect(() => canonicalValue(value, 'value')).toThrow(IncomparableValueError)
  })
})
