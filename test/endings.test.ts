/**
 * The table of endings (docs/behaviour.md#the-table-of-endings), over real HTTP on every store:
 * each way a guarded request can end, what its key becomes, and what a retry receives. Each test is
 * named after its row. A client that leaves does so for real: the test destroys its socket after
 * the first bytes of the body, as a dropped connection does.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { request as httpRequest } from 'node:http'
import { connect as connectHttp2, constants as http2Constants } from 'node:http2'
import { Readable } from 'node:stream'
import { ReadableStream } from 'node:stream/web'
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify'
import fastifyCompress from '@fastify/compress'
import { fastifySSE } from '@fastify/sse'
import idempotency, { channels, idempotencyErrorHandler, type IdempotencyEvent } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'
import { http2Post } from './helpers/http2.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

/** A body the test releases: the first chunk at once, the rest once `open()` is called. */
class Production {
  readonly first = 'id,amount\n'
  readonly rest = Array.from({ length: 8 }, (_, i) => `${i},${i * 100}\n`)
  #open!: () => void
  readonly opened = new Promise<void>((resolve) => { this.#open = resolve })
  #gone!: () => void
  /** Resolves when the server saw its client go (the raw response's 'close'). */
  readonly clientGone = new Promise<void>((resolve) => { this.#gone = resolve })
  #enter!: () => void
  /** Resolves when the handler runs. */
  readonly entered = new Promise<void>((resolve) => { this.#enter = resolve })
  /** Fail after the first chunk, instead of sending the rest. */
  failing = false

  get whole (): string {
    return this.first + this.rest.join('')
  }

  open (): void {
    this.#open()
  }

  watch (reply: FastifyReply): void {
    this.#enter()
    reply.raw.once('close', () => { this.#gone() })
  }

  async * chunks (): AsyncGenerator<string> {
    yield this.first
    await this.opened
    if (this.failing) throw new Error('the export failed half-way')
    for (const line of this.rest) yield line
  }
}

/** Resolves with the `execute` event of `key`: its request was settled (stored or released). */
function executed (key: string): Promise<IdempotencyEvent> {
  return new Promise((resolve) => {
    const listener = (message: unknown): void => {
      const event = message as IdempotencyEvent
      if (event.idempotencyKey !== key) return
      channels.execute.unsubscribe(listener)
      resolve(event)
    }
    channels.execute.subscribe(listener)
  })
}

/**
 * POST with `key`, read the head and the first bytes of the body, then destroy the connection as a
 * client whose network dropped. Resolves with the status and the bytes it read.
 */
function dropWhileReading (url: string, key: string): Promise<{ status: number, read: string }> {
  const { hostname, port, pathname } = new URL(url)
  return new Promise((resolve, reject) => {
    const req = httpRequest({ host: hostname, port, method: 'POST', path: pathname, headers: { 'content-type': 'application/json', 'idempotency-key': key } }, (res) => {
      res.once('data', (chunk: Buffer) => {
        req.destroy()
        resolve({ status: res.statusCode!, read: chunk.toString() })
      })
    })
    req.on('error', (error) => { if (!req.destroyed) reject(error) })
    req.end('{}')
  })
}

/** The status of a POST with `key`, without waiting for its body (a second run would stream until the test opens it). */
async function statusOf (url: string, key: string): Promise<number> {
  const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
  await res.body?.cancel()
  return res.status
}

for (const store of cases) {
  describe.skipIf(!store.available)(`endings on ${store.name}${store.reason}`, () => {
    let app: FastifyInstance
    let url = ''
    const productions = new Map<string, Production>()
    const runs = new Map<string, number>()
    const production = (key: string): Production => {
      const made = new Production()
      productions.set(key, made)
      return made
    }
    /** The handler's side: count the run, and watch its client. */
    const start = (path: string, request: { headers: Record<string, unknown> }, reply: FastifyReply): Production => {
      runs.set(path, (runs.get(path) ?? 0) + 1)
      const made = productions.get(String(request.headers['idempotency-key']))!
      made.watch(reply)
      return made
    }

    beforeAll(async () => {
      app = Fastify()
      await app.register(fastifySSE)
      await app.register(idempotency, { storage: await store.create() })
      app.setErrorHandler(idempotencyErrorHandler())
      const guarded = { config: { idempotency: true } }
      app.post('/node-stream', guarded, async (request, reply) => {
        const made = start('/node-stream', request, reply)
        reply.code(201).type('text/csv')
        return Readable.from(made.chunks())
      })
      app.post('/web-stream', guarded, async (request, reply) => {
        const made = start('/web-stream', request, reply)
        reply.code(201).type('text/csv')
        return ReadableStream.from(made.chunks())
      })
      app.post('/response', guarded, async (request, reply) => {
        const made = start('/response', request, reply)
        return new Response(ReadableStream.from(made.chunks()) as unknown as ConstructorParameters<typeof Response>[0], { status: 201, headers: { 'content-type': 'text/csv' } })
      })
      app.post('/stream-after-client-gone', guarded, async (request, reply) => {
        const made = start('/stream-after-client-gone', request, reply)
        await made.clientGone
        reply.code(201).type('text/csv')
        return Readable.from(made.chunks())
      })
      app.post('/unfinished-stream', { config: { idempotency: { lockTimeout: 300 } } }, async (request, reply) => {
        const made = start('/unfinished-stream', request, reply)
        reply.code(201).type('text/csv')
        return Readable.from(made.chunks())
      })
      app.post('/oversized-stream', { config: { idempotency: { maxResponseBytes: 16 } } }, async (request, reply) => {
        const made = start('/oversized-stream', request, reply)
        reply.code(201).type('text/csv').header('location', '/exports/1')
        return Readable.from(made.chunks())
      })
      app.post('/sse', { ...guarded, sse: 'manual' }, async (request, reply) => {
        const made = start('/sse', request, reply)
        for await (const chunk of made.chunks()) await reply.sse.send({ data: chunk })
      })
      app.post('/raw-writes', guarded, async (request, reply) => {
        const made = start('/raw-writes', request, reply)
        reply.raw.writeHead(201, { 'content-type': 'text/csv' })
        for await (const chunk of made.chunks()) reply.raw.write(chunk)
        reply.raw.end()
      })
      app.post('/raw-writes-after-client-gone', guarded, async (request, reply) => {
        const made = start('/raw-writes-after-client-gone', request, reply)
        await made.clientGone
        reply.raw.writeHead(201, { 'content-type': 'text/csv' })
        reply.raw.end(made.whole)
      })
      app.post('/hijacked', guarded, async (request, reply) => {
        const made = start('/hijacked', request, reply)
        reply.hijack()
        reply.raw.writeHead(201, { 'content-type': 'text/csv' })
        for await (const chunk of made.chunks()) reply.raw.write(chunk)
        reply.raw.end()
      })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })
    afterAll(async () => {
      await app?.close()
      await store.cleanup()
    })

    for (const path of ['/node-stream', '/web-stream', '/response']) {
      it(`${path.slice(1)}, client gone while reading: the plugin reads it to its end and stores it; a retry gets 409 meanwhile, then the whole body`, async () => {
        const key = newKey()
        const made = production(key)
        const settled = executed(key)
        const dropped = await dropWhileReading(url + path, key)
        expect(dropped).toEqual({ status: 201, read: made.first })
        await made.clientGone
        expect(await statusOf(url + path, key)).toBe(409)
        made.open()
        expect(await settled).toMatchObject({ stored: true })
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, made.whole])
        expect(retry.headers.get('content-type')).toMatch(/^text\/csv/)
        expect(runs.get(path)).toBe(1)
      })
    }

    it('stream, client gone before the body: the plugin reads it and stores it; a retry gets the whole body', async () => {
      const key = newKey()
      const made = production(key)
      made.open()
      const settled = executed(key)
      const { hostname, port } = new URL(url)
      const req = httpRequest({ host: hostname, port, method: 'POST', path: '/stream-after-client-gone', headers: { 'content-type': 'application/json', 'idempotency-key': key } })
      req.on('error', () => {})
      req.end('{}')
      await made.entered
      req.destroy()
      expect(await settled).toMatchObject({ stored: true })
      const retry = await postWithKey(url + '/stream-after-client-gone', key)
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, made.whole])
      expect(runs.get('/stream-after-client-gone')).toBe(1)
    })

    it('raw writes, client gone before the head: the outcome the handler wrote when it ends the response is stored; a retry gets it', async () => {
      const key = newKey()
      const made = production(key)
      const settled = executed(key)
      const { hostname, port } = new URL(url)
      const req = httpRequest({ host: hostname, port, method: 'POST', path: '/raw-writes-after-client-gone', headers: { 'content-type': 'application/json', 'idempotency-key': key } })
      req.on('error', () => {})
      req.end('{}')
      await made.entered
      req.destroy()
      expect(await settled).toMatchObject({ stored: true, bodyOmitted: true })
      const retry = await postWithKey(url + '/raw-writes-after-client-gone', key)
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, ''])
      expect(runs.get('/raw-writes-after-client-gone')).toBe(1)
    })

    for (const path of ['/node-stream', '/web-stream', '/response']) {
      it(`${path.slice(1)}, handler fails while it streams: the client gets a cut response, the key is released before it; a retry runs`, async () => {
        const key = newKey()
        const made = production(key)
        made.failing = true
        const settled = executed(key)
        const res = await fetch(url + path, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
        expect(res.status).toBe(201)
        made.open()
        await expect(res.text()).rejects.toThrow()
        expect(await settled).toMatchObject({ stored: false, reason: 'failed' })
        made.failing = false
        const before = runs.get(path)!
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed, retry.body]).toEqual([201, false, made.whole])
        expect(runs.get(path)).toBe(before + 1)
      })
    }

    it('stream that does not end within lockTimeout of its client going: stopped, its outcome stored without the body', async () => {
      const key = newKey()
      const made = production(key)
      const settled = executed(key)
      await dropWhileReading(url + '/unfinished-stream', key)
      await made.clientGone
      expect(await settled).toMatchObject({ stored: true, bodyOmitted: true })
      const retry = await postWithKey(url + '/unfinished-stream', key)
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, ''])
      expect(runs.get('/unfinished-stream')).toBe(1)
    })

    it('stream over maxResponseBytes, client gone while reading: its outcome is stored without the body; a retry gets it', async () => {
      const key = newKey()
      const made = production(key)
      const settled = executed(key)
      await dropWhileReading(url + '/oversized-stream', key)
      await made.clientGone
      expect(await statusOf(url + '/oversized-stream', key)).toBe(409)
      made.open()
      expect(await settled).toMatchObject({ stored: true, bodyOmitted: true })
      const retry = await postWithKey(url + '/oversized-stream', key)
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, ''])
      expect(retry.headers.get('idempotent-body-omitted')).toBe('true')
      expect(retry.headers.get('location')).toBe('/exports/1')
      expect(runs.get('/oversized-stream')).toBe(1)
    })

    for (const path of ['/sse', '/raw-writes', '/hijacked']) {
      it(`${path.slice(1)}, client gone while reading: its outcome is stored without the body when the client goes; a retry gets it, also while the handler still writes`, async () => {
        const key = newKey()
        const made = production(key)
        const settled = executed(key)
        const dropped = await dropWhileReading(url + path, key)
        expect(dropped.status).toBe(path === '/sse' ? 200 : 201)
        expect(await settled).toMatchObject({ stored: true, bodyOmitted: true })
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed, retry.body]).toEqual([dropped.status, true, ''])
        expect(retry.headers.get('idempotent-body-omitted')).toBe('true')
        made.open()
        expect(runs.get(path)).toBe(1)
      })
    }
  })
}

/**
 * The same promise where something else stands between the handler and the client: an HTTP/2
 * client that cancels its stream mid-body (RST_STREAM, not a closed socket), and @fastify/compress,
 * whose gzip stream is the payload the plugin reads. The store sees the same calls as above.
 */
describe('streams whose client leaves, through HTTP/2 and @fastify/compress', () => {
  it('HTTP/2 stream cancelled by its client while reading: read to its end and stored; a retry on the same connection gets 409, then the whole body', async () => {
    const app = Fastify({ http2: true })
    await app.register(idempotency)
    let runs = 0
    const made = new Production()
    app.post('/export', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      made.watch(reply as unknown as FastifyReply)
      reply.code(201).type('text/csv')
      return Readable.from(made.chunks())
    })
    const url = await app.listen({ host: '127.0.0.1', port: 0 })
    const session = connectHttp2(url)
    try {
      const key = newKey()
      const settled = executed(key)
      const headers = { 'content-type': 'application/json', 'idempotency-key': key }
      const first = session.request({ ':method': 'POST', ':path': '/export', ...headers })
      first.end('{}')
      await new Promise<void>((resolve) => first.once('data', () => { first.close(http2Constants.NGHTTP2_CANCEL); resolve() }))
      await made.clientGone
      expect((await http2Post(session, '/export', headers, '{}')).status).toBe(409)
      made.open()
      expect(await settled).toMatchObject({ stored: true })
      const retry = await http2Post(session, '/export', headers, '{}')
      expect([retry.status, retry.body.toString()]).toEqual([201, made.whole])
      expect(retry.headers).toContainEqual(['idempotent-replayed', 'true'])
      expect(runs).toBe(1)
    } finally {
      session.close()
      await app.close()
    }
  })

  it('gzip stream of @fastify/compress, client gone before the body: the compressed body is stored, and replayed as sent', async () => {
    const app = Fastify()
    await app.register(fastifyCompress, { threshold: 0 })
    await app.register(idempotency)
    let runs = 0
    const made = new Production()
    made.open()
    app.post('/export', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      made.watch(reply)
      await made.clientGone
      reply.code(201).type('text/csv')
      return Readable.from(made.chunks())
    })
    const url = await app.listen({ host: '127.0.0.1', port: 0 })
    try {
      const key = newKey()
      const settled = executed(key)
      const { hostname, port } = new URL(url)
      const req = httpRequest({ host: hostname, port, method: 'POST', path: '/export', headers: { 'content-type': 'application/json', 'idempotency-key': key, 'accept-encoding': 'gzip' } })
      req.on('error', () => {})
      req.end('{}')
      await made.entered
      req.destroy()
      expect(await settled).toMatchObject({ stored: true })
      const retry = await postWithKey(`${url}/export`, key, {}, { 'accept-encoding': 'gzip' })
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, made.whole])
      expect(retry.headers.get('content-encoding')).toBe('gzip')
      expect(runs).toBe(1)
    } finally {
      await app.close()
    }
  })
})
