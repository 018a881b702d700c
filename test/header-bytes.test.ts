/**
 * The bytes of a replay's head, read off a raw socket, on every store: a header value with a
 * character in U+0080..U+00FF (`filename="café.csv"`) reaches a retry as the same bytes as it
 * reached the first client. Node writes a response's head in the same write as a string body, in
 * UTF-8, and on its own before a Buffer or a stream, in latin1: the first answer of a handler that
 * returns a string or JSON carries `é` as two bytes, one that returns a Buffer or a stream as one.
 * A replay is sent from stored bytes, so the plugin keeps what the first head carried.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { once } from 'node:events'
import { connect } from 'node:net'
import { connect as connectHttp2 } from 'node:http2'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify'
import compress from '@fastify/compress'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { http2Post, type Http2Answer } from './helpers/http2.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

const DISPOSITION = 'attachment; filename="café, naïve ÿ.csv"'
const LABEL = 'Bücher à 5 \u00a4'

/** What each route answers: the same headers, the body in another form. */
const BODIES: Record<string, (reply: FastifyReply) => unknown> = {
  string: (reply) => reply.type('text/csv; charset=utf-8').send('name,price\ncafé,4\n'),
  buffer: (reply) => reply.type('text/csv; charset=utf-8').send(Buffer.from('name,price\ncafé,4\n')),
  stream: (reply) => reply.type('text/csv; charset=utf-8').send(Readable.from([Buffer.from('name,price\n'), Buffer.from('café,4\n')])),
  json: () => ({ name: 'café', price: 4 })
}

let runs = 0

async function build (storage: IdempotencyStorage): Promise<{ app: FastifyInstance }> {
  const app = Fastify()
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  for (const [name, body] of Object.entries(BODIES)) {
    const handler = async (_request: unknown, reply: FastifyReply) => {
      runs++
      reply.code(201).header('content-disposition', DISPOSITION).header('x-label', LABEL)
      return await body(reply)
    }
    app.post(`/guarded/${name}`, { config: { idempotency: true } }, handler)
    app.post(`/plain/${name}`, handler)
  }
  return { app }
}

/** POST over a socket of its own (Connection: close), and the answer's head as the bytes that came. */
async function head (url: string, path: string, key?: string, extra = ''): Promise<Buffer> {
  const { hostname, port } = new URL(url)
  const socket = connect({ host: hostname, port: Number(port) })
  await once(socket, 'connect')
  const body = '{"sku":"A1"}'
  // Not half-closed: the server closes the connection once it has answered (Connection: close).
  socket.write(`POST ${path} HTTP/1.1\r\nHost: ${hostname}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n${key === undefined ? '' : `Idempotency-Key: ${key}\r\n`}${extra}\r\n${body}`)
  const chunks: Buffer[] = []
  for await (const chunk of socket) chunks.push(chunk as Buffer)
  const all = Buffer.concat(chunks)
  return all.subarray(0, all.indexOf('\r\n\r\n'))
}

/** The head's lines as raw bytes, by lower-cased name, without the ones that differ per answer. */
function lines (bytes: Buffer): Map<string, Buffer> {
  const found = new Map<string, Buffer>()
  let start = bytes.indexOf('\r\n') + 2
  while (start < bytes.length) {
    const end = bytes.indexOf('\r\n', start) === -1 ? bytes.length : bytes.indexOf('\r\n', start)
    const line = bytes.subarray(start, end)
    const name = line.subarray(0, line.indexOf(':')).toString('latin1').toLowerCase()
    if (!['date', 'idempotent-replayed', 'connection', 'transfer-encoding', 'content-length', 'keep-alive'].includes(name)) found.set(name, line)
    start = end + 2
  }
  return found
}

for (const store of cases) {
  describe.skipIf(!store.available)(`header bytes of a replay, on ${store.name}${store.reason}`, () => {
    const served = servedOn(store, build)

    for (const name of Object.keys(BODIES)) {
      it(`a ${name} body: the retry's head carries the first answer's bytes, and the first answer is the plugin-less one`, async () => {
        const key = newKey()
        const before = runs
        const first = await head(served.url, `/guarded/${name}`, key)
        const retry = await head(served.url, `/guarded/${name}`, key)
        const plain = await head(served.url, `/plain/${name}`)
        expect(runs - before).toBe(2)
        expect(retry.toString('latin1')).toMatch(/\r\nidempotent-replayed: true(\r\n|$)/)
        const [firstLines, retryLines, plainLines] = [lines(first), lines(retry), lines(plain)]
        for (const header of ['content-disposition', 'x-label', 'content-type']) {
          expect(firstLines.get(header), `${header} of the first answer`).toEqual(plainLines.get(header))
          expect(retryLines.get(header)?.toString('hex'), `${header} of the replay`).toBe(firstLines.get(header)?.toString('hex'))
        }
      })
    }
  })
}

describe('header bytes of a replay, in the other ways an answer goes out (memory)', () => {
  let app: FastifyInstance
  let url: string
  let ran = 0
  beforeAll(async () => {
    app = Fastify({ http2: false })
    await app.register(idempotency, { maxResponseBytes: 64 })
    app.setErrorHandler(idempotencyErrorHandler())
    const named = (reply: FastifyReply): FastifyReply => reply.code(201).header('content-disposition', DISPOSITION)
    const trailed = async (_request: unknown, reply: FastifyReply) => {
      ran++
      named(reply).trailer('x-checksum', async () => 'abc').type('text/csv')
      return 'name,price\ncafé,4\n'
    }
    // A body over maxResponseBytes: the outcome is kept without it, and its head as it was sent.
    const large = async (_request: unknown, reply: FastifyReply) => {
      ran++
      named(reply)
      return { rows: 'x'.repeat(100) }
    }
    app.post('/guarded/trailers', { config: { idempotency: true } }, trailed)
    app.post('/plain/trailers', trailed)
    app.post('/guarded/large', { config: { idempotency: true } }, large)
    app.post('/plain/large', large)
    // 204: Fastify drops the body, and Node writes the head alone.
    const empty = async (_request: unknown, reply: FastifyReply) => {
      ran++
      named(reply).code(204)
      return 'dropped'
    }
    app.post('/guarded/empty', { config: { idempotency: true } }, empty)
    app.post('/plain/empty', empty)
    app.post('/guarded/injected', { config: { idempotency: true } }, async (_request, reply) => { ran++; named(reply); return { ok: true } })
    url = await app.listen({ host: '127.0.0.1', port: 0 })
  })
  afterAll(async () => { await app.close() })

  for (const name of ['trailers', 'large', 'empty']) {
    it(`${name}: the retry's head carries the first answer's bytes, and the first answer is the plugin-less one`, async () => {
      const key = newKey()
      const before = ran
      const [first, retry, plain] = [await head(url, `/guarded/${name}`, key), await head(url, `/guarded/${name}`, key), await head(url, `/plain/${name}`)]
      expect(ran - before).toBe(2)
      expect(retry.toString('latin1')).toMatch(/\r\nidempotent-replayed: true(\r\n|$)/)
      expect(lines(first).get('content-disposition')).toEqual(lines(plain).get('content-disposition'))
      expect(lines(retry).get('content-disposition')?.toString('hex')).toBe(lines(first).get('content-disposition')?.toString('hex'))
    })
  }

  it('through app.inject, which writes no bytes: the retry gets the header as the first answer had it', async () => {
    const send = (key: string) => app.inject({ method: 'POST', url: '/guarded/injected', headers: { 'idempotency-key': key }, payload: { sku: 'A1' } })
    const key = newKey()
    const first = await send(key)
    const retry = await send(key)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(first.headers['content-disposition']).toBe(DISPOSITION)
    expect(retry.headers['content-disposition']).toBe(DISPOSITION)
  })
})

describe('header bytes of a replay over HTTP/2 (memory)', () => {
  it('with @fastify/compress registered after the plugin: the retry gets the header as the first answer had it, compressed or not', async () => {
    const app = Fastify({ http2: true }) as unknown as FastifyInstance
    await app.register(idempotency)
    await app.register(compress, { encodings: ['gzip'] })
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/large', { config: { idempotency: true } }, async (_request, reply) => { reply.header('content-disposition', DISPOSITION); return { rows: 'café,4\n'.repeat(300) } })
    const address = await app.listen({ host: '127.0.0.1', port: 0 })
    const session = connectHttp2(address)
    try {
      for (const coding of [{ 'accept-encoding': 'gzip' }, {}] as Array<Record<string, string>>) {
        const key = newKey()
        const first = await http2Post(session, '/large', { 'idempotency-key': key, ...coding }, '')
        const retry = await http2Post(session, '/large', { 'idempotency-key': key, ...coding }, '')
        const disposition = (answer: Http2Answer) => answer.headers.find(([name]) => name === 'content-disposition')?.[1]
        expect(retry.headers).toContainEqual(['idempotent-replayed', 'true'])
        expect(disposition(first)).toBe(DISPOSITION)
        expect(disposition(retry)).toBe(DISPOSITION)
      }
    } finally {
      session.close()
      await app.close()
    }
  })

  it('the retry gets the header as the first answer had it, for a string and a Buffer body', async () => {
    const app = Fastify({ http2: true }) as unknown as FastifyInstance
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/string', { config: { idempotency: true } }, async (_request, reply) => { reply.header('content-disposition', DISPOSITION); return 'café' })
    app.post('/buffer', { config: { idempotency: true } }, async (_request, reply) => { reply.header('content-disposition', DISPOSITION); return Buffer.from('café') })
    const address = await app.listen({ host: '127.0.0.1', port: 0 })
    const session = connectHttp2(address)
    try {
      for (const path of ['/string', '/buffer']) {
        const key = newKey()
        const first = await http2Post(session, path, { 'idempotency-key': key }, '')
        const retry = await http2Post(session, path, { 'idempotency-key': key }, '')
        const disposition = (answer: Http2Answer) => answer.headers.find(([name]) => name === 'content-disposition')?.[1]
        expect(retry.headers).toContainEqual(['idempotent-replayed', 'true'])
        expect(disposition(first), path).toBe(DISPOSITION)
        expect(disposition(retry), path).toBe(DISPOSITION)
      }
    } finally {
      session.close()
      await app.close()
    }
  })
})

// Cases of their own: a case's store is dropped once its describe is done.
for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`header bytes of a replay beside @fastify/compress, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })
    for (const order of ['before', 'after'] as const) {
      it(`registered ${order} the plugin: every retry's head carries the first answer's bytes, compressed or not, and the first answer is the plugin-less one`, async () => {
        const app = Fastify()
        if (order === 'before') await app.register(compress, { encodings: ['gzip'] })
        await app.register(idempotency, { storage })
        if (order === 'after') await app.register(compress, { encodings: ['gzip'] })
        app.setErrorHandler(idempotencyErrorHandler())
        let ran = 0
        const answers: Record<string, (reply: FastifyReply) => unknown> = {
        // Over @fastify/compress's threshold (1024 bytes): compressed for a client that accepts gzip.
          large: () => ({ rows: 'café,4\n'.repeat(300) }),
          small: () => ({ name: 'café' }),
          empty: (reply) => { reply.code(204); return 'dropped' }
        }
        for (const [name, body] of Object.entries(answers)) {
          const handler = async (_request: unknown, reply: FastifyReply) => {
            ran++
            reply.code(201).header('content-disposition', DISPOSITION)
            return body(reply)
          }
          app.post(`/guarded/${name}`, { config: { idempotency: true } }, handler)
          app.post(`/plain/${name}`, handler)
        }
        // A body over maxResponseBytes, on a route that frees the key for it: the retry runs again.
        let released = 0
        app.post('/guarded/released', { config: { idempotency: { maxResponseBytes: 16, unstorableResponse: 'release' } } }, async (_request, reply) => {
          released++
          reply.code(201).header('content-disposition', DISPOSITION)
          return { rows: 'café,4\n'.repeat(300) }
        })
        // A header with several values.
        app.post('/guarded/values', { config: { idempotency: true } }, async (_request, reply) => {
          reply.code(201).header('x-labels', [LABEL, 'plain'])
          return { name: 'café' }
        })
        const url = await app.listen({ host: '127.0.0.1', port: 0 })
        try {
          const releasedKey = newKey()
          await head(url, '/guarded/released', releasedKey, 'Accept-Encoding: gzip\r\n')
          await head(url, '/guarded/released', releasedKey, 'Accept-Encoding: gzip\r\n')
          expect(released).toBe(2)
          const valuesKey = newKey()
          const [firstValues, retryValues] = [await head(url, '/guarded/values', valuesKey), await head(url, '/guarded/values', valuesKey)]
          expect(retryValues.toString('latin1')).toMatch(/\r\nidempotent-replayed: true(\r\n|$)/)
          expect(lines(retryValues).get('x-labels')?.toString('hex')).toBe(lines(firstValues).get('x-labels')?.toString('hex'))
          const gzip = 'Accept-Encoding: gzip\r\n'
          for (const name of Object.keys(answers)) {
            for (const [firstCoding, retryCoding] of [[gzip, gzip], [gzip, ''], ['', gzip], ['', '']]) {
              const key = newKey()
              const before = ran
              const first = await head(url, `/guarded/${name}`, key, firstCoding)
              const retry = await head(url, `/guarded/${name}`, key, retryCoding)
              const plain = await head(url, `/plain/${name}`, undefined, firstCoding)
              const label = `${name}, first ${JSON.stringify(firstCoding)}, retry ${JSON.stringify(retryCoding)}`
              expect(ran - before, label).toBe(2)
              expect(retry.toString('latin1'), label).toMatch(/\r\nidempotent-replayed: true(\r\n|$)/)
              expect(lines(first).get('content-disposition'), label).toEqual(lines(plain).get('content-disposition'))
              expect(lines(retry).get('content-disposition')?.toString('hex'), label).toBe(lines(first).get('content-disposition')?.toString('hex'))
            }
          }
        } finally {
          await app.close()
        }
      })
    }
  })
}
