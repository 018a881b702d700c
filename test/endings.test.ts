/**
 * The table of endings (docs/behaviour.md#the-table-of-endings), over real HTTP on every store:
 * each way a guarded request can end, what its key becomes, and what a retry receives. Each test is
 * named after its row. A client that leaves does so for real: the test destroys its socket after
 * the first bytes of the body, as a dropped connection does.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { request as httpRequest } from 'node:http'
import { connect as connectHttp2, constants as http2Constants } from 'node:http2'
import { readFileSync } from 'node:fs'
import { Readable } from 'node:stream'
import { ReadableStream } from 'node:stream/web'
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify'
import fastifyCompress from '@fastify/compress'
import { fastifySSE } from '@fastify/sse'
import idempotency, { channels, idempotencyErrorHandler, type IdempotencyEvent } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { postWithKey, type HttpAnswer } from './helpers/http-client.js'
import { http2Post } from './helpers/http2.js'
import { storeCases } from './helpers/stores.js'
import { scaled } from './helpers/pace.js'

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
    const start = (_path: string, request: { headers: Record<string, unknown> }, reply: FastifyReply): Production => {
      const key = String(request.headers['idempotency-key'])
      runs.set(key, (runs.get(key) ?? 0) + 1)
      const made = productions.get(key)!
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
      // Kept for lockTimeout after its client left: long enough that the lease, renewed every
      // lockTimeout / 8, outlives the event loop's stalls on a loaded machine.
      app.post('/unfinished-stream', { config: { idempotency: { lockTimeout: scaled(300) } } }, async (request, reply) => {
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
        // Stop once the client is gone, as a stream's producer should: an SSE handler that
        // throws after its head is sent makes Fastify 6 (6.0.0-alpha.4) write a second head.
        for await (const chunk of made.chunks()) {
          if (!reply.sse.isConnected) break
          await reply.sse.send({ data: chunk })
        }
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
      /** Count a run of the request's key. */
      const count = (request: { headers: Record<string, unknown> }): number => {
        const key = String(request.headers['idempotency-key'])
        runs.set(key, (runs.get(key) ?? 0) + 1)
        return runs.get(key)!
      }
      app.post('/string', guarded, async (request, reply) => { reply.code(201).type('text/plain'); return `order ${count(request)}` })
      app.post('/buffer', guarded, async (request, reply) => { reply.code(201).type('application/octet-stream'); return Buffer.from([count(request), 0, 255]) })
      app.post('/empty', guarded, async (request, reply) => { count(request); reply.code(204).send() })
      app.post('/redirect-302', guarded, async (request, reply) => reply.redirect(`/orders/${count(request)}`))
      app.post('/redirect-303', guarded, async (request, reply) => reply.redirect(`/orders/${count(request)}`, 303))
      app.post('/status/:code', guarded, async (request, reply) => {
        const { code } = request.params as { code: string }
        reply.code(Number(code)).header('location', '/elsewhere')
        return { run: count(request) }
      })
      app.post('/declined', { config: { idempotency: { storeIf: () => false } } }, async (request) => ({ run: count(request) }))
      app.post('/fails-before', guarded, async (request) => {
        count(request)
        throw Object.assign(new Error('declined by the bank'), { statusCode: 402 })
      })
      app.post('/response-read', guarded, async (request) => {
        count(request)
        const response = new Response('read', { status: 201 })
        await response.text()
        return response
      })
      app.post('/fails-after', guarded, async (request, reply) => {
        count(request)
        reply.raw.setHeader('content-type', 'text/plain')
        reply.raw.writeHead(201)
        reply.raw.end('written')
        throw new Error('after the answer')
      })
      app.post('/bytes-after-client-gone', guarded, async (request, reply) => {
        const made = start('/bytes-after-client-gone', request, reply)
        await made.clientGone
        reply.code(201)
        return { order: 'kept' }
      })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })
    afterAll(async () => {
      await app?.close()
      await store.cleanup()
    })

    /** A POST with `key` to `path`, its answer read whole; redirects are not followed. */
    const send = async (path: string, key: string): Promise<HttpAnswer> => {
      const res = await fetch(url + path, { method: 'POST', redirect: 'manual', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
      return { status: res.status, body: await res.text(), replayed: res.headers.get('idempotent-replayed') === 'true', headers: res.headers }
    }
    /** A POST to `path` under a new key, read whole and settled, then its retry: both answers, and the key. */
    const twice = async (path: string, key = newKey()): Promise<[HttpAnswer, HttpAnswer, string]> => {
      const settled = executed(key)
      const first = await send(path, key)
      await settled
      return [first, await send(path, key), key]
    }
    /** Send a POST with `key` to `path`, and leave once its handler runs. */
    const leaveOnceRunning = async (path: string, key: string, made: Production): Promise<void> => {
      const { hostname, port } = new URL(url)
      const req = httpRequest({ host: hostname, port, method: 'POST', path, headers: { 'content-type': 'application/json', 'idempotency-key': key } })
      req.on('error', () => {})
      req.end('{}')
      await made.entered
      req.destroy()
    }

    it('a string, a Buffer or no body, with a cacheable status', async () => {
      for (const path of ['/string', '/buffer', '/empty']) {
        const [first, retry, key] = await twice(path)
        expect([retry.status, retry.replayed, retry.body], path).toEqual([first.status, true, first.body])
        expect(runs.get(key), path).toBe(1)
      }
    })

    for (const path of ['/node-stream', '/web-stream', '/response']) {
      it(`a stream within maxResponseBytes: Node stream, web ReadableStream, Response (${path.slice(1)})`, async () => {
        const key = newKey()
        const made = production(key)
        const settled = executed(key)
        const res = await fetch(url + path, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
        const reader = res.body!.getReader()
        await reader.read()
        expect(await statusOf(url + path, key)).toBe(409)
        made.open()
        while (!(await reader.read()).done);
        expect(await settled).toMatchObject({ stored: true })
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, made.whole])
        expect(runs.get(key)).toBe(1)
      })
    }

    for (const path of ['/sse', '/raw-writes', '/hijacked']) {
      it(`a hijacked reply, raw writes or SSE, ended by the handler (${path.slice(1)})`, async () => {
        const key = newKey()
        production(key).open()
        const [first, retry] = await twice(path, key)
        expect(first.body).toContain('0,0')
        expect([retry.status, retry.replayed, retry.body]).toEqual([first.status, true, ''])
        expect(retry.headers.get('idempotent-body-omitted')).toBe('true')
        expect(runs.get(key)).toBe(1)
      })
    }

    it("a redirect after a POST: 303, or reply.redirect's 302", async () => {
      for (const path of ['/redirect-302', '/redirect-303']) {
        const key = newKey()
        const settled = executed(key)
        const first = await fetch(url + path, { method: 'POST', redirect: 'manual', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
        await settled
        const retry = await fetch(url + path, { method: 'POST', redirect: 'manual', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{}' })
        expect([retry.status, retry.headers.get('location'), retry.headers.get('idempotent-replayed')], path).toEqual([first.status, '/orders/1', 'true'])
        expect(runs.get(key), path).toBe(1)
      }
    })

    it('a status outside the cacheable set (400, 500, 307...), or one the route\'s storeIf declines', async () => {
      for (const path of ['/status/400', '/status/500', '/status/307', '/status/301', '/declined']) {
        const [, retry] = await twice(path)
        expect([retry.status, retry.replayed, JSON.parse(retry.body).run], path).toEqual([Number(path.split('/')[2] ?? 200), false, 2])
      }
    })

    it('the handler fails before it answers', async () => {
      for (const [path, status] of [['/fails-before', 402], ['/response-read', 500]] as const) {
        const [first, retry, key] = await twice(path)
        expect([first.status, retry.status, retry.replayed], path).toEqual([status, status, false])
        expect(runs.get(key), path).toBe(2)
      }
    })

    for (const path of ['/node-stream', '/web-stream', '/response']) {
      it(`the handler fails while it streams (${path.slice(1)})`, async () => {
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
        const before = runs.get(key)!
        // The key was given back before the client saw the cut: this retry runs at once.
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed, retry.body]).toEqual([201, false, made.whole])
        expect(runs.get(key)).toBe(before + 1)
      })
    }

    it('the handler fails after it answered', async () => {
      const [first, retry, key] = await twice('/fails-after')
      expect([first.status, first.body]).toEqual([201, 'written'])
      expect([retry.status, retry.replayed, retry.headers.get('idempotent-body-omitted')]).toEqual([201, true, 'true'])
      expect(runs.get(key)).toBe(1)
    })

    it('the client is gone before the handler answers', async () => {
      for (const path of ['/bytes-after-client-gone', '/stream-after-client-gone']) {
        const key = newKey()
        const made = production(key)
        made.open()
        const settled = executed(key)
        await leaveOnceRunning(path, key, made)
        expect(await settled, path).toMatchObject({ stored: true })
        const retry = await postWithKey(url + path, key)
        expect([retry.status, retry.replayed], path).toEqual([201, true])
        expect(retry.body, path).toBe(path === '/bytes-after-client-gone' ? '{"order":"kept"}' : made.whole)
        expect(runs.get(key), path).toBe(1)
      }
    })

    it('the client is gone after the body', async () => {
      const key = newKey()
      const settled = executed(key)
      const { hostname, port } = new URL(url)
      const body = await new Promise<string>((resolve, reject) => {
        const req = httpRequest({ host: hostname, port, method: 'POST', path: '/string', headers: { 'content-type': 'application/json', 'idempotency-key': key } }, (res) => {
          let text = ''
          res.on('data', (chunk: Buffer) => { text += chunk.toString() })
          res.on('end', () => { req.destroy(); resolve(text) })
        })
        req.on('error', reject)
        req.end('{}')
      })
      await settled
      const retry = await postWithKey(url + '/string', key)
      expect([retry.replayed, retry.body]).toEqual([true, body])
    })

    for (const path of ['/node-stream', '/web-stream', '/response']) {
      it(`the client is gone while reading a stream (${path.slice(1)})`, async () => {
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
        expect(runs.get(key)).toBe(1)
      })
    }

    it('the client is gone before the head of raw writes', async () => {
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
      expect(runs.get(key)).toBe(1)
    })

    it('the client is gone and the stream does not end within lockTimeout', async () => {
      const key = newKey()
      const made = production(key)
      const settled = executed(key)
      await dropWhileReading(url + '/unfinished-stream', key)
      await made.clientGone
      expect(await settled).toMatchObject({ stored: true, bodyOmitted: true })
      const retry = await postWithKey(url + '/unfinished-stream', key)
      expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, ''])
      expect(runs.get(key)).toBe(1)
    })

    it('the client is gone while reading a stream over maxResponseBytes', async () => {
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
      expect(runs.get(key)).toBe(1)
    })

    for (const path of ['/sse', '/raw-writes', '/hijacked']) {
      it(`the client is gone while reading raw writes, SSE or a hijacked reply (${path.slice(1)})`, async () => {
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
        expect(runs.get(key)).toBe(1)
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

describe('the table of endings in docs/behaviour.md', () => {
  it('names a test for each row, and each test it names exists', () => {
    const page = readFileSync(new URL('../docs/behaviour.md', import.meta.url), 'utf8')
    const section = page.slice(page.indexOf('## The table of endings'), page.indexOf('### Redirects after a POST'))
    const rows = section.split('\n').filter((line) => line.startsWith('| ') && !line.startsWith('| **') && !line.startsWith('| Ending'))
    expect(rows.length).toBeGreaterThan(20)
    const source = (file: string): string => readFileSync(new URL(file, import.meta.url), 'utf8').replaceAll("\\'", "'")
    for (const row of rows) {
      const cells = row.split(' | ')
      const ending = cells[0]!.slice(2).replaceAll('`', '')
      const tests = cells.at(-1)!.replace(/ \|$/, '')
      if (tests === '`endings`') {
        expect(source('./endings.test.ts'), ending).toContain(`${ending}`)
        continue
      }
      const cited = [...tests.matchAll(/`([\w.-]+\.test\.ts)` › ((?:"[^"]+"(?:, )?)+)/g)]
      expect(cited.length, ending).toBeGreaterThan(0)
      for (const [, file, titles] of cited) {
        for (const [, title] of titles!.matchAll(/"([^"]+)"/g)) expect(source(`./${file!}`), `${ending}: ${file!}`).toContain(title)
      }
    }
  })
})
