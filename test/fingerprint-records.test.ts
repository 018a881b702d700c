/**
 * The fingerprint as the store keeps it (a record of the digest, its version and its option set)
 * and the comparison of a request with a stored record: under the options the record names, as
 * version 1 would have, or not at all when the record cannot be read.
 */
import { describe, expect, it } from 'vitest'
import { createHash } from 'node:crypto'
import { PassThrough, Readable } from 'node:stream'
import type { FastifyRequest } from 'fastify'
import { bodyPart, normalizeFingerprint, type FingerprintOptions } from '../lib/fingerprint/fingerprint.js'
import { fingerprintRecord, legacyOptionSets, readRecord, routeTag } from '../lib/fingerprint/record.js'
import { fingerprintRequest, takeFingerprint } from '../lib/http/request-fingerprint.js'
import { RequestState } from '../lib/engine/request-state.js'
import { IdempotencyFingerprintUnsupportedError } from '../lib/errors.js'
import { captureStream } from '../lib/http/capture.js'
import { RawBodyHash, unparsedBody } from '../lib/http/raw-body.js'
import { toResult } from '../lib/storage/knex/rows.js'
import { UnreadableEntryError } from '../lib/storage/unreadable-entry.js'
import { FingerprintValueError, IncomparableValueError } from '../lib/fingerprint/canonical-value.js'

function request (parts: { body?: unknown, method?: string, url?: string, headers?: Record<string, string> }): FastifyRequest {
  return { body: parts.body, method: parts.method ?? 'POST', url: parts.url ?? '/orders', headers: { 'content-type': 'application/json', ...parts.headers } } as unknown as FastifyRequest
}

const take = (parts: Parameters<typeof request>[0], options: FingerprintOptions = {}, rawHash?: string, route = '/orders') =>
  fingerprintRequest(request(parts), route, normalizeFingerprint(options), null, rawHash)

/** The digest 0.1.0 stored for a JSON body under `options`, written out as version 1's encoding says. */
function version1 (body: string, tag: string, extra = ''): string {
  const part = (type: string, data: string) => `${type}${Buffer.byteLength(data)}:${data}`
  return createHash('sha256').update(part('t', tag) + extra + part('j', body)).digest('base64url')
}

describe('fingerprint records', () => {
  it('carry the version and the option set, and are read back', () => {
    const settings = normalizeFingerprint({ headers: ['X-Tenant'], body: { include: ['/b', '/a'] }, query: true })
    const route = routeTag('/orders/:id')
    expect(route).toMatch(/^[\w-]{8}$/)
    const record = fingerprintRecord(route, settings, 'd'.repeat(43))
    expect(record).toBe(`3.${route}.{"body":{"include":["/a","/b"]},"query":true,"headers":["x-tenant"]}.${'d'.repeat(43)}`)
    const read = readRecord(record)
    expect(read).toMatchObject({ version: 3, route, digest: 'd'.repeat(43) })
    expect(read instanceof Error || read.version === 1 ? null : read.settings.options).toBe(settings.options)
    // Version 2's records (0.2.0's pre-releases) are read back as such.
    expect(readRecord(`2${record.slice(1)}`)).toMatchObject({ version: 2, route, digest: 'd'.repeat(43) })
    expect(readRecord('s7kIgi6ycrWn1XO8A93yrnkzrp-uJHYHsfCLl2W6Xvo')).toEqual({ version: 1, digest: 's7kIgi6ycrWn1XO8A93yrnkzrp-uJHYHsfCLl2W6Xvo' })
  })

  it('of version 3 hash the parts alone: the default options hash the body part only, other options each part in order', () => {
    const body = '{"amount":4200,"currency":"eur","item":"book"}'
    const part = (type: string, data: string) => `${type}${Buffer.byteLength(data)}:${data}`
    const digest = (text: string) => createHash('sha256').update(text).digest('base64url')
    expect(take({ body: JSON.parse(body) }).record).toBe(`3.${routeTag('/orders')}.{}.${digest(part('j', body))}`)
    expect(take({ body: 'café', headers: { 'content-type': 'text/plain' } }).record.slice(-43)).toBe(digest(part('r', 'café')))
    expect(take({ body: 'café' }).record.slice(-43)).toBe(digest(part('j', '"café"')))
    expect(take({ body: JSON.parse(body), method: 'PUT' }, { method: true }).record.slice(-43)).toBe(digest(part('m', 'PUT') + part('j', body)))
    expect(take({ body: undefined }).record.slice(-43)).toBe(digest('n'))
    expect(take({ body: JSON.parse(body) }, { body: false, method: true }).record.slice(-43)).toBe(digest(part('m', 'POST')))
  })

  it('of another version, damaged, or naming options this version does not write, cannot be read', () => {
    const digest = 'd'.repeat(43)
    const route = routeTag('/orders')
    for (const record of [`4.${route}.{}.${digest}`, `3.${route}.{}${digest}`, `3.${route}.{}.${digest.slice(1)}!`, `3.${route}{}.${digest}`, '3..', `2.${route}.{}${digest}`, `2.${route}.{}.${digest.slice(1)}!`, `2.${route}{}.${digest}`, '2..', 'fp-1', '',
      `2.${route}.{"body":true}.${digest}`, `2.${route}.{"colour":"red"}.${digest}`, `2.${route}.{not json}.${digest}`, `2.${route}.{"method":"yes"}.${digest}`,
      `2.${route}.{"path":true,"method":true}.${digest}`]) {
      expect(readRecord(record), record).toBeInstanceOf(Error)
    }
  })

  it('read back many option sets without keeping them all', () => {
    for (let i = 0; i < 200; i++) {
      const settings = normalizeFingerprint({ headers: [`x-h${i}`] })
      expect(readRecord(fingerprintRecord(routeTag('/'), settings, 'd'.repeat(43)))).toMatchObject({ version: 3 })
    }
  })

  it('of version 1 are compared under every combination of the on/off parts, the route\'s own set first', () => {
    const route = normalizeFingerprint({})
    const plain = legacyOptionSets(route)
    expect(plain).toHaveLength(32)
    expect(plain[0]!.options).toBe('{}')
    // Worked out once per route.
    expect(legacyOptionSets(route)).toBe(plain)
    const selective = legacyOptionSets(normalizeFingerprint({ method: true, headers: ['x-t'], body: { exclude: ['/at'] } }))
    expect(selective).toHaveLength(16 * 2 * 3)
    expect(selective[0]!.options).toBe('{"body":{"exclude":["/at"]},"method":true,"headers":["x-t"]}')
  })
})

describe('comparing a request with a stored fingerprint', () => {
  it('is the same request under the options the record was made with, and a different one when it differs under them', () => {
    const stored = take({ body: { a: 1, note: 'x' } }, { body: { include: ['/a'] } }).record
    expect(take({ body: { note: 'y', a: 1 } }, { method: true }).compare(stored)).toBe('same')
    expect(take({ body: { a: 2, note: 'x' } }, { method: true }).compare(stored)).toBe('different')
    // Under the record's own options a different text is a different request.
    expect(take({ body: { a: 2 } }).compare(take({ body: { a: 1 } }).record)).toBe('different')
    // Another route's entry under other options: the key was reused for another operation.
    expect(take({ body: { note: 'y', a: 1 } }, { method: true }, undefined, '/payments').compare(stored)).toBe('different')
    // Under the same options, the digests tell, whichever route made the entry.
    expect(take({ body: { a: 1 } }, {}, undefined, '/payments').compare(take({ body: { a: 1 } }).record)).toBe('same')
  })

  it('compares under options that leave the body out, and with a 0.1.0 entry of a route that counts raw bytes', () => {
    const bodiless = take({ body: { a: 1 } }, { body: false, method: true }).record
    expect(take({ body: { a: 2 } }).compare(bodiless)).toBe('same')
    expect(take({ body: { a: 2 } }, {}, undefined).compare(take({ body: { a: 1 } }, { body: false, method: true }, undefined).record)).toBe('same')
    const part = (type: string, data: string) => `${type}${Buffer.byteLength(data)}:${data}`
    const raw = createHash('sha256').update(part('t', '["fastify-idempotency/fingerprint/v1","raw",null,null,false,false,false,false,[]]') + part('R', 'hash-of-abc')).digest('base64url')
    expect(take({ body: 'abc' }, { body: 'raw', method: true }, 'hash-of-abc').compare(raw)).toBe('same')
    expect(take({ body: 'abd' }, { body: 'raw', method: true }, 'hash-of-abd').compare(raw)).toBe('different')
  })

  it('cannot compare a request with a record of an unknown version, or one made of raw bytes it does not have', () => {
    expect(take({ body: { a: 1 } }).compare(`4.{}.${'d'.repeat(43)}`)).toBeInstanceOf(Error)
    expect(take({ body: { a: 1 } }).compare(`4.${routeTag('/orders')}.{}.${'d'.repeat(43)}`)).toBeInstanceOf(Error)
    const raw = take({ body: 'abc' }, { body: 'raw' }, 'hash-of-abc').record
    expect(take({ body: 'abc' }).compare(raw)).toBeInstanceOf(Error)
    expect(take({ body: 'abc' }, { method: true }, 'hash-of-abc').compare(raw)).toBe('same')
  })

  it('compares with a version 2 record (0.2.0\'s pre-releases) as version 2 computed it: the option tag hashed first', () => {
    const part = (type: string, data: string) => `${type}${Buffer.byteLength(data)}:${data}`
    const version2 = (body: string, tag: string, options: string, extra = ''): string =>
      `2.${routeTag('/orders')}.${options}.${createHash('sha256').update(part('t', tag) + extra + part('j', body)).digest('base64url')}`
    const defaults = version2('{"amount":5}', '["fastify-idempotency/fingerprint/v2",true,null,null,false,false,false,false,[]]', '{}')
    expect(take({ body: { amount: 5 } }).compare(defaults)).toBe('same')
    expect(take({ body: { amount: 6 } }).compare(defaults)).toBe('different')
    // Made under other options than the route's now: fingerprinted again under them, as version 2.
    const withMethod = version2('{"amount":5}', '["fastify-idempotency/fingerprint/v2",true,null,null,true,false,false,false,[]]', '{"method":true}', part('m', 'POST'))
    expect(take({ body: { amount: 5 } }).compare(withMethod)).toBe('same')
    expect(take({ body: { amount: 6 } }).compare(withMethod)).toBe('different')
    // The same request under version 3 has another digest: only the version tells them apart.
    expect(take({ body: { amount: 5 } }).record.slice(-43)).not.toBe(defaults.slice(-43))
  })

  it('compares with a version 1 record as 0.1.0 computed it, under the options it may have been made with', () => {
    const body = '{"amount":5}'
    const defaults = version1(body, '["fastify-idempotency/fingerprint/v1",true,null,null,false,false,false,false,[]]')
    const withPath = version1(body, '["fastify-idempotency/fingerprint/v1",true,null,null,false,true,false,false,[]]', 'p7:/orders')
    for (const stored of [defaults, withPath]) {
      expect(take({ body: { amount: 5 } }, { method: true, path: true }).compare(stored)).toBe('same')
      expect(take({ body: { amount: 6 } }, { method: true, path: true }).compare(stored)).toBe('different')
    }
    expect(take({ body: { tags: new Set(['a']) } }).compare(defaults)).toBeInstanceOf(Error)
  })
})

describe('member selections and their version 1 form', () => {
  const json = 'application/json'
  it('say what kind of container each member came from, and select array elements by index only', () => {
    const settings = normalizeFingerprint({ body: { include: ['/items/0', '/items/length'] } })
    const part = (body: unknown) => bodyPart(body, json, settings)
    expect(part({ items: ['a'] })).not.toEqual(part({ items: { 0: 'a' } }))
    expect(part({ items: ['a'] })[0]).toBe('s')
    // `length` is no element, and an index past the end selects nothing: the body counts whole.
    expect(part({ items: [] })).toEqual(['j', '{"items":[]}'])
    expect(part({ items: [] })).not.toEqual(part({ items: { length: 0 } }))
  })

  it('as version 1 wrote them, cannot be compared where version 1 could not tell bodies apart', () => {
    const include = normalizeFingerprint({ body: { include: ['/a/b'] } })
    expect(bodyPart({ a: { b: 1 } }, json, include, true)).toEqual(['j', '[[1]]'])
    expect(() => bodyPart({ a: {} }, json, include, true)).toThrow(IncomparableValueError)
    expect(() => bodyPart([1], json, include, true)).toThrow(IncomparableValueError)
    const exclude = normalizeFingerprint({ body: { exclude: ['/m/x'] } })
    expect(() => bodyPart({ m: new Map() }, 'text/x-custom', exclude, true)).toThrow(IncomparableValueError)
    expect(bodyPart({ m: new Map([['x', 1]]) }, 'text/x-custom', exclude)[1]).toContain('\u0000M')
  })
})

describe('bodies no parser made a value of', () => {
  const withBody = (body: unknown) => ({ body, raw: Readable.from([]), headers: { 'content-type': 'application/json' } }) as unknown as FastifyRequest

  it('a stream handed on as the body is hashed by its bytes; one already read, or a web stream, cannot be', () => {
    expect(unparsedBody(withBody({ a: 1 }))).toBeNull()
    expect(unparsedBody(withBody(new PassThrough()))).toBeInstanceOf(RawBodyHash)
    const read = new PassThrough()
    read.end('x')
    read.read()
    expect(() => unparsedBody(withBody(read))).toThrow(FingerprintValueError)
    expect(() => unparsedBody(withBody(new ReadableStream()))).toThrow(/web ReadableStream/)
  })
})

describe('a body that throws where no member is read', () => {
  it('is a 500 naming the route, with what was thrown', () => {
    const body = new Proxy({}, { getPrototypeOf () { throw new Error('revoked') } })
    const state = new RequestState('k', 'POST', console)
    const request = { body, method: 'POST', url: '/orders', headers: { 'content-type': 'application/json' }, log: { error () {} } } as unknown as FastifyRequest
    let error: unknown
    try {
      takeFingerprint(request, normalizeFingerprint({}), state, undefined, '/orders')
    } catch (caught) {
      error = caught
    }
    expect(error).toBeInstanceOf(IdempotencyFingerprintUnsupportedError)
    expect((error as Error).message).toMatch(/route POST \/orders: fingerprinting it threw Error: revoked/)
  })
})

describe('a streamed response with a Content-Length', () => {
  it('holds its last bytes until the response is settled, so a client cannot read the whole answer before it is stored', async () => {
    const capture = captureStream(Readable.from([Buffer.from('ab'), Buffer.from('cd')]), 1024, 4)
    let settle = (): void => {}
    capture.holdEndUntil(new Promise<void>((resolve) => { settle = resolve }))
    const received: string[] = []
    capture.stream.on('data', (chunk: Buffer) => { received.push(chunk.toString()) })
    expect(await capture.captured).toEqual({ body: Buffer.from('abcd') })
    expect(received).toEqual(['ab'])
    const ended = new Promise((resolve) => capture.stream.once('end', resolve))
    settle()
    await ended
    expect(received).toEqual(['ab', 'cd'])
  })
})

describe('a table row this version cannot read', () => {
  it('is refused as unreadable: a state it does not know, headers that are not an object', () => {
    const row = { fingerprint: 'f', leaseend: 0, statuscode: 200, contenttype: null, body: Buffer.alloc(0) }
    expect(() => toResult({ ...row, state: 'archived', headers: null })).toThrow(UnreadableEntryError)
    expect(() => toResult({ ...row, state: 'completed', headers: '[1]' })).toThrow(UnreadableEntryError)
    expect(() => toResult({ ...row, state: 'completed', headers: '{' })).toThrow(UnreadableEntryError)
  })
})
