/**
 * Bodies of every shape, over real HTTP on every store: member selections from bodies of another
 * shape, the nesting limit, and the values a custom parser can make (Maps, Sets, BigInts, Dates,
 * typed arrays, cycles, class instances, getters that throw). Two different bodies never replay
 * each other's answer; a body the plugin cannot fingerprint is a clear problem, the client's
 * (400) or the server's (500, naming the route and where in the body), never a bare 500.
 */
import { describe, expect, it } from 'vitest'
import { Readable } from 'node:stream'
import { text as consume } from 'node:stream/consumers'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { MAX_DEPTH } from '../lib/fingerprint/canonical-value.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

class Point {
  readonly #x: number
  constructor (x: number) { this.#x = x }
  get x (): number { return this.#x }
}

/** What the custom parser of `application/x-value` makes of each payload: the server's own values. */
const VALUES: Record<string, () => unknown> = {
  'map-1': () => ({ v: new Map([['a', 1]]) }),
  'map-2': () => ({ v: new Map([['a', 2]]) }),
  'set-1': () => ({ v: new Set([1]) }),
  'set-2': () => ({ v: new Set([2]) }),
  'bigint-1': () => ({ v: 1n }),
  'bigint-2': () => ({ v: 2n }),
  'date-1': () => ({ v: new Date(0) }),
  'date-2': () => ({ v: new Date(1) }),
  'date-as-text': () => ({ v: new Date(0).toJSON() }),
  'floats-1': () => ({ v: new Float64Array([1]) }),
  'floats-2': () => ({ v: new Float64Array([2]) }),
  'bytes-of-floats-1': () => ({ v: new Uint8Array(new Float64Array([1]).buffer) }),
  nan: () => ({ v: Number.NaN }),
  null: () => ({ v: null }),
  'cycle-1': () => { const body: Record<string, unknown> = { v: 1 }; body.self = body; return body },
  'cycle-2': () => { const body: Record<string, unknown> = { v: 2 }; body.self = body; return body },
  'getter-throws': () => ({ order: { get total () { throw new Error('not loaded') } } }),
  'class-instance': () => ({ items: [{ at: new Point(1) }] })
}

async function build (storage: IdempotencyStorage): Promise<{ app: FastifyInstance, runs: () => number }> {
  const app = Fastify({ logger: false })
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  app.addContentTypeParser('application/x-value', { parseAs: 'string' }, (_request, text, done) => {
    const make = VALUES[text as string]
    done(null, make === undefined ? text : make())
  })
  // Parsers that hand the stream on: untouched, as a web stream, or after reading some of it.
  app.addContentTypeParser('application/x-stream', (_request, payload, done) => { done(null, payload) })
  app.addContentTypeParser('application/x-web-stream', (_request, payload, done) => { done(null, Readable.toWeb(payload)) })
  app.addContentTypeParser('application/x-read-stream', (_request, payload, done) => {
    payload.once('readable', () => {
      payload.read(1)
      done(null, payload)
    })
  })
  let runs = 0
  const handler = async (request: FastifyRequest) => {
    // A stream body is the handler's to read: it gets every byte.
    const body = request.body instanceof Readable ? await consume(request.body) : undefined
    return { run: ++runs, ...(body === undefined ? {} : { bytes: body.length }) }
  }
  app.post('/selected', { config: { idempotency: { fingerprint: { body: { include: ['/amount', '/currency'] } } } } }, handler)
  app.post('/values', { config: { idempotency: true } }, handler)
  app.post('/validated', { config: { idempotency: true }, schema: { body: { type: ['object', 'array'] } } }, handler)
  return { app, runs: () => runs }
}

interface Answer { status: number, type: string, detail: string, replayed: string | null, contentType: string | null, bytes?: number }

/** `[[[...]]]` nested `depth` levels deep. */
const nested = (depth: number): string => '['.repeat(depth) + ']'.repeat(depth)

for (const store of cases) {
  describe.skipIf(!store.available)(`bodies of every shape, on ${store.name}${store.reason}`, () => {
    const served = servedOn(store, build)

    const post = async (path: string, key: string, body: string, type = 'application/json'): Promise<Answer> => {
      const res = await fetch(`${served.url}${path}`, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': type }, body })
      const json = await res.json() as { type?: string, detail?: string, bytes?: number }
      return { status: res.status, type: json.type ?? '', detail: json.detail ?? '', replayed: res.headers.get('idempotent-replayed'), contentType: res.headers.get('content-type'), bytes: json.bytes }
    }

    for (const [first, second] of [['[1]', '[2]'], ['"a"', '"b"'], ['{"note":"a"}', '{"note":"b"}'], ['{"0":5}', '[5]'], ['5', '{"amount":5}']] as Array<[string, string]>) {
      it(`a selection of members: ${first} then ${second} under one key is refused`, async () => {
        const key = newKey('selected')
        expect((await post('/selected', key, first)).status).toBe(200)
        const other = await post('/selected', key, second)
        expect(other.status).toBe(409)
        expect(other.type).toMatch(/#fingerprint-mismatch$/)
        expect((await post('/selected', key, first)).replayed).toBe('true')
      })
    }

    it('a selection of members still ignores what it does not select', async () => {
      const key = newKey('selected')
      expect((await post('/selected', key, '{"amount":5,"currency":"eur","note":"a"}')).status).toBe(200)
      expect((await post('/selected', key, '{"currency":"eur","note":"b","amount":5}')).replayed).toBe('true')
    })

    it(`nesting: ${MAX_DEPTH} levels are fingerprinted, ${MAX_DEPTH + 1} and 10,000 are refused with 400, and the server goes on`, async () => {
      const accepted = await post('/values', newKey('deep'), nested(MAX_DEPTH))
      expect(accepted.status).toBe(200)
      for (const depth of [MAX_DEPTH + 1, 10_000]) {
        const refused = await post('/values', newKey('deep'), nested(depth))
        expect(refused.status, `${depth} levels`).toBe(400)
        expect(refused.type).toMatch(/#fingerprint-failed$/)
        expect(refused.contentType).toMatch(/^application\/problem\+json/)
      }
      const deepObject = '{"a":'.repeat(10_000) + '1' + '}'.repeat(10_000)
      expect((await post('/values', newKey('deep'), deepObject)).status).toBe(400)
      // On a route with a body schema the body is fingerprinted before validation: the same answer.
      expect((await post('/validated', newKey('deep'), nested(MAX_DEPTH + 1))).type).toMatch(/#fingerprint-failed$/)
      expect((await post('/values', newKey('after'), '{"a":1}')).status).toBe(200)
    })

    for (const [first, second] of [['map-1', 'map-2'], ['set-1', 'set-2'], ['bigint-1', 'bigint-2'], ['date-1', 'date-2'], ['date-1', 'date-as-text'], ['floats-1', 'floats-2'], ['floats-1', 'bytes-of-floats-1'], ['nan', 'null'], ['cycle-1', 'cycle-2']] as Array<[string, string]>) {
      it(`a parser's values: ${first} is stored and replayed, ${second} under the same key refused`, async () => {
        const key = newKey('values')
        const before = served.runs()
        expect((await post('/values', key, first, 'application/x-value')).status).toBe(200)
        expect((await post('/values', key, first, 'application/x-value')).replayed).toBe('true')
        const other = await post('/values', key, second, 'application/x-value')
        expect(other.status).toBe(409)
        expect(other.type).toMatch(/#fingerprint-mismatch$/)
        expect(served.runs() - before).toBe(1)
      })
    }

    it('a stream a parser hands on is fingerprinted by its bytes, which the handler still reads in full', async () => {
      const key = newKey('stream')
      const first = await post('/values', key, '{"amount":5}', 'application/x-stream')
      expect(first).toMatchObject({ status: 200, bytes: 12 })
      expect((await post('/values', key, '{"amount":5}', 'application/x-stream')).replayed).toBe('true')
      expect((await post('/values', key, '{"amount":6}', 'application/x-stream')).status).toBe(409)
    })

    for (const [type, reason] of [['application/x-web-stream', 'web ReadableStream'], ['application/x-read-stream', 'read before']] as Array<[string, string]>) {
      it(`a stream a parser hands on that cannot be put back (${type}) is a 500 naming the route, the handler not run`, async () => {
        const before = served.runs()
        const answer = await post('/values', newKey('stream'), '{"amount":5}', type)
        expect(answer.status).toBe(500)
        expect(answer.type).toMatch(/#fingerprint-unsupported$/)
        expect(answer.detail).toContain('POST /values')
        expect(answer.detail).toContain(reason)
        expect(served.runs()).toBe(before)
      })
    }

    it('a value a schema route\'s parser made that cannot be fingerprinted is refused before validation, the same way', async () => {
      const answer = await post('/validated', newKey('unsupported'), 'class-instance', 'application/x-value')
      expect(answer.status).toBe(500)
      expect(answer.detail).toContain('POST /validated')
    })

    for (const [payload, path] of [['getter-throws', '/order/total'], ['class-instance', '/items/0/at']] as Array<[string, string]>) {
      it(`a parser's value the plugin cannot fingerprint (${payload}) is a 500 problem naming the route and ${path}, the handler not run`, async () => {
        const before = served.runs()
        const answer = await post('/values', newKey('unsupported'), payload, 'application/x-value')
        expect(answer.status).toBe(500)
        expect(answer.contentType).toMatch(/^application\/problem\+json/)
        expect(answer.type).toMatch(/#fingerprint-unsupported$/)
        expect(answer.detail).toContain('POST /values')
        expect(answer.detail).toContain(path)
        expect(served.runs()).toBe(before)
      })
    }
  })
}
