/**
 * Generated hostile input (fast-check): whatever a client sends, the plugin never answers 500,
 * never replays to a request with another fingerprint, and never lets a refused request change
 * a stored entry.
 */
import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import type { FastifyRequest } from 'fastify'
import { buildApp } from './helpers/app.js'
import { normalizeFingerprint } from '../lib/fingerprint/fingerprint.js'
import { fingerprintRequest } from '../lib/http/request-fingerprint.js'

const headerValue = fc.oneof(
  fc.string({ maxLength: 40 }),
  fc.string({ unit: 'binary', maxLength: 40 }),
  fc.string({ unit: fc.constantFrom(...'"\\ ,;=\t\r\n\u0000\u007f{}[]:'.split('')), maxLength: 12 }),
  fc.constantFrom('', '""', '"a', 'a, b', '"a", "b"', '?1', '"x";p=1', 'x'.repeat(256), 'x'.repeat(5000)),
  fc.stringMatching(/^[\x21-\x7E]{1,300}$/)
)
const contentType = fc.constantFrom('application/json', 'text/plain', 'application/octet-stream', 'application/x-www-form-urlencoded', 'application/json; charset=utf-8', 'weird/type', '')
const body = fc.oneof(fc.json(), fc.string({ maxLength: 200 }), fc.constantFrom('{', '{"a":', '[1,2', '\u0000\u0001', '{"__proto__":{"x":1}}', '{"constructor":{"prototype":{"y":1}}}'))
const query = fc.array(fc.tuple(fc.constantFrom('a', 'b', 'a%20b', '%', '%zz', 'x[]', ''), fc.string({ maxLength: 8 })), { maxLength: 5 })
  .map((pairs) => pairs.map(([k, v]) => `${k}=${encodeURIComponent(v)}`).join('&'))

describe('hostile input', () => {
  it('never makes the plugin answer 500, and refuses bad keys with 4xx problem+json', async () => {
    const { app, runs } = await buildApp({ fingerprint: { query: true, contentType: true, headers: ['x-tenant'] } })
    await fc.assert(fc.asyncProperty(headerValue, contentType, body, query, async (key, type, payload, q) => {
      let res
      try {
        res = await app.inject({ method: 'POST', url: `/orders?${q}`, headers: { 'idempotency-key': key, 'content-type': type }, payload })
      } catch {
        return // light-my-request refuses some header values itself (as Node's HTTP client would): nothing reached the server
      }
      expect(res.statusCode, `key ${JSON.stringify(key)} type ${type} body ${JSON.stringify(payload)}`).not.toBe(500)
      if (res.statusCode >= 400 && res.headers['content-type']?.toString().startsWith('application/problem+json')) {
        expect(res.json().status).toBe(res.statusCode)
      }
    }), { numRuns: 400 })
    expect(runs.get('/orders') ?? 0).toBeGreaterThanOrEqual(0)
    await app.close()
  })

  it('never replays to a request with another fingerprint, and a refused request never changes the stored entry', async () => {
    const { app } = await buildApp({ fingerprint: { method: false, query: true } })
    let n = 0
    await fc.assert(fc.asyncProperty(fc.json(), fc.json(), query, query, async (first, second, q1, q2) => {
      // Fastify's own JSON parser refuses these members (prototype poisoning) with a 400 before
      // any hook runs: such a body never reaches the plugin.
      fc.pre(!/"(?:__proto__|constructor)"/.test(first + second))
      const key = `prop-${++n}`
      const send = (payload: string, q: string) => app.inject({ method: 'POST', url: `/orders?${q}`, headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload })
      const original = await send(first, q1)
      expect(original.statusCode).toBe(201)
      const other = await send(second, q2)
      const same = JSON.stringify(JSON.parse(first)) === JSON.stringify(JSON.parse(second)) && new URLSearchParams(q1).toString() === new URLSearchParams(q2).toString()
      if (other.headers['idempotent-replayed'] === 'true') {
        // A replay is allowed only for the same logical request.
        expect(other.body).toBe(original.body)
      } else {
        expect(same).toBe(false)
        expect(other.statusCode).toBe(409)
      }
      const again = await send(first, q1)
      expect(again.headers['idempotent-replayed']).toBe('true')
      expect(again.body).toBe(original.body)
    }), { numRuns: 200 })
    await app.close()
  })

  it('fingerprints a JSON body the same whatever its member order and white space', () => {
    const settings = normalizeFingerprint({})
    const fp = (value: unknown) => fingerprintRequest({ body: value, method: 'POST', url: '/', headers: {} } as unknown as FastifyRequest, '/', settings, null, undefined).record
    const shuffle = (value: unknown, seed: number): unknown => {
      if (Array.isArray(value)) return value.map((item, i) => shuffle(item, seed + i))
      if (value === null || typeof value !== 'object') return value
      const entries = Object.entries(value)
      entries.sort((a, b) => ((a[0].length * 31 + seed) % 7) - ((b[0].length * 31 + seed) % 7) || (seed % 2 === 0 ? 1 : -1))
      return Object.fromEntries(entries.map(([k, v]) => [k, shuffle(v, seed + 1)]))
    }
    fc.assert(fc.property(fc.jsonValue(), fc.nat(), (value, seed) => {
      const spaced = JSON.parse(JSON.stringify(shuffle(value, seed), null, 3))
      expect(fp(spaced)).toBe(fp(JSON.parse(JSON.stringify(value))))
    }), { numRuns: 500 })
  })
})
