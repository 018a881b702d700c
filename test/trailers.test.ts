/**
 * Trailers (`reply.trailer()`), over real HTTP on every store: a replay sends the trailers the first
 * answer sent, with the values computed then, whatever the body (a string, a Buffer, a stream) and
 * whether the trailer function answers through a promise or a callback. Read with node:http's
 * `res.trailers`, and over HTTP/2 with the stream's 'trailers' event.
 */
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import { request as httpRequest, type IncomingHttpHeaders } from 'node:http'
import { connect as connectHttp2 } from 'node:http2'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify'
import fastifyPackage from 'fastify/package.json' with { type: 'json' }
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

interface Answer { status: number, headers: IncomingHttpHeaders, body: string, trailers: NodeJS.Dict<string> }

/** A POST over node:http, its body read to the end, and its trailers. */
async function post (url: string, path: string, key?: string): Promise<Answer> {
  const { hostname, port } = new URL(url)
  return await new Promise((resolve, reject) => {
    const req = httpRequest({ host: hostname, port, path, method: 'POST', headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) } }, (res) => {
      const chunks: Buffer[] = []
      res.on('data', (chunk: Buffer) => chunks.push(chunk))
      res.on('end', () => { resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks).toString(), trailers: res.trailers }) })
      res.on('error', reject)
    })
    req.on('error', reject)
    req.end('{"sku":"A1"}')
  })
}

/** The POST retried until it is answered 201 (the first one's answer is being kept meanwhile). */
async function answeredOnce (url: string, path: string, key: string): Promise<Answer> {
  return await vi.waitFor(async () => {
    const answer = await post(url, path, key)
    expect(answer.status).toBe(201)
    return answer
  })
}

/** Each computation of a trailer gives a new value: a replay must carry the first one's. */
let computed = 0
let ran = 0

/** What each route answers, and how its trailer is computed. */
const ROUTES: Record<string, (reply: FastifyReply) => unknown> = {
  string: (reply) => {
    reply.trailer('x-checksum', async () => `sum-${++computed}`)
    return 'name,price\ncafé,4\n'
  },
  buffer: (reply) => {
    reply.trailer('x-checksum', (_reply, _payload, done) => { done(null, `sum-${++computed}`) })
    return Buffer.from('name,price\n')
  },
  json: (reply) => {
    reply.trailer('x-checksum', async () => `sum-${++computed}`).trailer('server-timing', async () => `db;dur=${++computed}`)
    return { sku: 'A1' }
  },
  // Computed from what was streamed, as a checksum trailer is.
  stream: (reply) => {
    let bytes = 0
    async function * lines (): AsyncGenerator<Buffer> {
      for (const line of ['id,amount\n', '1,100\n', '2,200\n']) {
        bytes += line.length
        yield Buffer.from(line)
      }
    }
    reply.trailer('x-checksum', async () => `bytes-${bytes}-${++computed}`)
    return Readable.from(lines())
  }
}

async function build (storage: IdempotencyStorage): Promise<{ app: FastifyInstance }> {
  const app = Fastify()
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  for (const [name, answer] of Object.entries(ROUTES)) {
    const handler = async (_request: unknown, reply: FastifyReply) => {
      ran++
      reply.code(201)
      return answer(reply)
    }
    app.post(`/guarded/${name}`, { config: { idempotency: true } }, handler)
    app.post(`/plain/${name}`, handler)
  }
  return { app }
}

/**
 * Fastify 6.0.0-alpha.4 sends no trailers after a stream body, with the plugin or without it (its
 * `Trailer` header, then none), although it calls their functions: a stream's trailers reach the
 * client only on Fastify 5, and on Fastify 6 only the replay carries them.
 */
const STREAM_TRAILERS = Number(fastifyPackage.version.split('.')[0]) < 6

for (const store of cases) {
  describe.skipIf(!store.available)(`trailers, on ${store.name}${store.reason}`, () => {
    const served = servedOn(store, build)

    for (const name of Object.keys(ROUTES)) {
      it(`a ${name} body: the replay sends the first answer's trailers, with the values computed then`, async () => {
        const key = newKey()
        const before = ran
        const plain = await post(served.url, `/plain/${name}`)
        const first = await post(served.url, `/guarded/${name}`, key)
        const retry = await post(served.url, `/guarded/${name}`, key)
        expect(ran - before).toBe(2)
        expect(first.status).toBe(201)
        // The first answer is the plugin-less one: its trailers, announced in `Trailer`.
        expect(Object.keys(first.trailers).sort()).toEqual(Object.keys(plain.trailers).sort())
        expect(first.headers.trailer).toBe(plain.headers.trailer)
        if (name !== 'stream' || STREAM_TRAILERS) expect(first.trailers['x-checksum']).toBeDefined()
        expect(first.body).toBe(plain.body)
        expect(first.body.length).toBeGreaterThan(0)
        expect(retry.headers['idempotent-replayed']).toBe('true')
        expect(retry.status).toBe(201)
        expect(retry.body).toBe(first.body)
        expect(retry.headers.trailer).toBe(first.headers.trailer)
        if (name === 'stream' && !STREAM_TRAILERS) {
          // Fastify 6's first answer computes the trailer and does not send it; the plugin keeps it
          // as computed (docs/headers.md#trailers).
          expect(first.trailers).toEqual({})
          expect(retry.trailers['x-checksum']).toMatch(/^bytes-/)
        } else {
          expect(retry.trailers).toEqual(first.trailers)
        }
      })
    }
  })
}

describe('trailers over HTTP/2 (memory)', () => {
  it('the replay sends the first answer\'s trailers', async () => {
    const app = Fastify({ http2: true }) as unknown as FastifyInstance
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    let n = 0
    app.post('/trailed', { config: { idempotency: true } }, async (_request, reply) => {
      reply.code(201).trailer('x-checksum', async () => `sum-${++n}`)
      return 'body'
    })
    const address = await app.listen({ host: '127.0.0.1', port: 0 })
    const session = connectHttp2(address)
    const send = async (key: string): Promise<{ headers: Record<string, unknown>, trailers: Record<string, unknown>, body: string }> => await new Promise((resolve, reject) => {
      const stream = session.request({ ':method': 'POST', ':path': '/trailed', 'idempotency-key': key })
      let headers: Record<string, unknown> = {}
      let trailers: Record<string, unknown> = {}
      const chunks: Buffer[] = []
      stream.on('response', (h) => { headers = h })
      stream.on('trailers', (t) => { trailers = t })
      stream.on('data', (chunk: Buffer) => chunks.push(chunk))
      stream.on('end', () => { resolve({ headers, trailers, body: Buffer.concat(chunks).toString() }) })
      stream.on('error', reject)
      stream.end()
    })
    try {
      const key = newKey()
      const first = await send(key)
      const retry = await send(key)
      expect(first.trailers['x-checksum']).toBe('sum-1')
      expect(retry.headers['idempotent-replayed']).toBe('true')
      expect(retry.body).toBe(first.body)
      expect(retry.trailers['x-checksum']).toBe('sum-1')
      expect(n).toBe(1)
    } finally {
      session.close()
      await app.close()
    }
  })
})

describe('trailers that fail, that are taken away, that a retry sets itself, of a stream that fails or whose client leaves (memory)', () => {
  let app: FastifyInstance
  let url: string
  let runs = 0
  let release!: () => void
  let failing = false
  beforeAll(async () => {
    app = Fastify()
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    // The retry's own trailer, set by the app's hook on every request: the replay keeps it.
    app.addHook('onRequest', async (request, reply) => {
      if (request.headers['x-own-trailer'] !== undefined) reply.trailer('x-own', async () => String(request.headers['x-own-trailer']))
    })
    app.post('/failing', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201)
        .trailer('x-ok', async () => `ok-${runs}`)
        .trailer('x-rejected', async () => { throw new Error('no checksum') })
        .trailer('x-callback-error', (_reply, _payload, done) => { done(new Error('no digest')) })
        .trailer('x-nothing', async () => undefined)
        .trailer('x-own', async () => 'the first answer\'s')
      return 'body'
    })
    app.post('/throwing', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201).trailer('x-ok', async () => `ok-${runs}`).trailer('x-thrown', () => { throw new Error('thrown') })
      return 'thrown'
    })
    // An onSend hook that runs after the plugin's (added by an onRoute hook after it) replaces a trailer.
    app.addHook('onRoute', (route) => {
      if (route.url !== '/replaced') return
      route.onSend = [...(route.onSend === undefined ? [] : Array.isArray(route.onSend) ? route.onSend : [route.onSend]), async (_request, reply, payload) => {
        reply.trailer('x-checksum', async () => 'replaced')
        return payload
      }]
    })
    app.post('/replaced', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201).trailer('x-checksum', async () => 'original').trailer('x-other', async () => 'other')
      return 'replaced'
    })
    // One trailer taken away beside one whose callback is called twice, and a route whose only trailer fails.
    app.post('/mixed', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201).trailer('x-gone', async () => 'never sent').removeTrailer('x-gone')
        .trailer('x-twice', (_reply, _payload, done) => { done(null, `first-${runs}`); done(null, 'second') })
      return 'mixed'
    })
    app.post('/none', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201).trailer('x-rejected', async () => { throw new Error('no checksum') })
      return 'none'
    })
    app.post('/removed', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201).trailer('x-checksum', async () => 'never sent').removeTrailer('x-checksum')
      return `removed ${runs}`
    })
    app.post('/stream', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      const opened = new Promise<void>((resolve) => { release = resolve })
      async function * lines (): AsyncGenerator<string> {
        yield 'first\n'
        await opened
        if (failing) throw new Error('the export failed half-way')
        yield 'rest\n'
      }
      reply.code(201).trailer('x-checksum', async () => `stream-${runs}`)
      return Readable.from(lines())
    })
    url = await app.listen({ host: '127.0.0.1', port: 0 })
  })
  afterAll(async () => { await app.close() })

  it('a trailer whose function fails or throws is not sent, and not replayed; the others are, as Fastify sent them', async () => {
    const key = newKey()
    const first = await post(url, '/failing', key)
    const retry = await post(url, '/failing', key)
    // Fastify sends a value of undefined as the text 'undefined'.
    expect(first.trailers).toEqual({ 'x-ok': 'ok-1', 'x-nothing': 'undefined', 'x-own': 'the first answer\'s' })
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.trailers).toEqual(first.trailers)
  })

  it('a trailer function that throws: the response is cut as without the plugin, and kept (the handler answered) without that trailer', async () => {
    const key = newKey()
    const before = runs
    await expect(post(url, '/throwing', key)).rejects.toThrow()
    const retry = await answeredOnce(url, '/throwing', key)
    expect(runs).toBe(before + 1)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.body).toBe('thrown')
    expect(retry.trailers['x-thrown']).toBeUndefined()
  })

  it('a trailer taken away beside one whose callback is called twice, a route whose only trailer fails, a trailer replaced by a later onSend hook: replayed as sent', async () => {
    for (const path of ['/mixed', '/none', '/replaced']) {
      const key = newKey()
      const first = await post(url, path, key)
      const retry = await post(url, path, key)
      expect(retry.headers['idempotent-replayed'], path).toBe('true')
      expect(retry.body, path).toBe(first.body)
      expect(retry.trailers, path).toEqual(first.trailers)
    }
  })

  it("a trailer the retry's own hooks set is the retry's", async () => {
    const key = newKey()
    const first = await post(url, '/failing', key)
    const retry = await new Promise<Answer>((resolve, reject) => {
      const { port } = new URL(url)
      const req = httpRequest({ host: '127.0.0.1', port, path: '/failing', method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key, 'x-own-trailer': 'the retry\'s' } }, (res) => {
        res.resume()
        res.on('end', () => { resolve({ status: res.statusCode ?? 0, headers: res.headers, body: '', trailers: res.trailers }) })
      })
      req.on('error', reject)
      req.end('{"sku":"A1"}')
    })
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.trailers).toEqual({ ...first.trailers, 'x-own': 'the retry\'s' })
  })

  it('a trailer taken away (removeTrailer): the response has none, and is stored at once', async () => {
    const key = newKey()
    const first = await post(url, '/removed', key)
    const retry = await post(url, '/removed', key)
    expect(first.headers.trailer).toBeUndefined()
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.body).toBe(first.body)
    expect(retry.trailers).toEqual({})
  })

  it('a stream with trailers that fails: the key is given back, and a retry runs', async () => {
    failing = true
    try {
      const key = newKey()
      const before = runs
      const first = post(url, '/stream', key).catch((error: Error) => error)
      await vi.waitFor(() => { expect(runs).toBe(before + 1) })
      release()
      await first
      failing = false
      const again = post(url, '/stream', key)
      await vi.waitFor(() => { expect(runs).toBe(before + 2) })
      release()
      const answer = await again
      expect(answer.headers['idempotent-replayed']).toBeUndefined()
      expect(answer.trailers).toEqual(STREAM_TRAILERS ? { 'x-checksum': `stream-${before + 2}` } : {})
    } finally {
      failing = false
    }
  })

  it('a stream with trailers whose client leaves before its end: read to its end and kept without trailers (none was sent)', async () => {
    const key = newKey()
    const before = runs
    const { port } = new URL(url)
    await new Promise<void>((resolve, reject) => {
      const req = httpRequest({ host: '127.0.0.1', port, path: '/stream', method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key } }, (res) => {
        res.once('data', () => { req.destroy(); resolve() })
      })
      req.on('error', () => {})
      req.on('close', () => { resolve() })
      req.end('{"sku":"A1"}')
      setTimeout(() => { reject(new Error('no first chunk')) }, 5000).unref()
    })
    release()
    const retry = await answeredOnce(url, '/stream', key)
    expect(runs).toBe(before + 1)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.body).toBe('first\nrest\n')
  })
})
