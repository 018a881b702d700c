/**
 * Over real sockets: what inject cannot show (raw repeated headers, aborted clients, many
 * connections at once).
 */
import { afterEach, describe, expect, it } from 'vitest'
import { connect } from 'node:net'
import { once } from 'node:events'
import { request as httpRequest } from 'node:http'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage } from '../lib/index.js'
import type { IdempotencyStorage, StoredResponse } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'

let app: FastifyInstance
afterEach(async () => { await app?.close() })

/** Send raw bytes, read the whole answer (the server closes: Connection: close). */
async function raw (port: number, text: string): Promise<string> {
  const socket = connect({ host: '127.0.0.1', port })
  await once(socket, 'connect')
  socket.end(text)
  const chunks: Buffer[] = []
  for await (const chunk of socket) chunks.push(chunk as Buffer)
  return Buffer.concat(chunks).toString()
}

/** A storage that reports when a lease is settled, so a test can wait for it instead of sleeping. */
function observed (inner: IdempotencyStorage): IdempotencyStorage & { settled: Promise<'complete' | 'release'> } {
  let settle!: (how: 'complete' | 'release') => void
  const settled = new Promise<'complete' | 'release'>((resolve) => { settle = resolve })
  return {
    settled,
    begin: (key, fp, lock) => inner.begin(key, fp, lock),
    renew: (key, token, lock) => inner.renew(key, token, lock),
    complete: async (key: string, token: string, response: StoredResponse, expiration: number) => {
      const done = await inner.complete(key, token, response, expiration)
      settle('complete')
      return done
    },
    release: async (key: string, token: string) => {
      const done = await inner.release(key, token)
      settle('release')
      return done
    }
  }
}

describe('over real HTTP', () => {
  it('refuses an Idempotency-Key header sent twice with 400', async () => {
    app = Fastify()
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async () => { runs++; return { ok: true } })
    await app.listen({ host: '127.0.0.1', port: 0 })
    const port = (app.server.address() as { port: number }).port
    for (const [first, second] of [['k1', 'k1'], ['k1', 'k2'], ['"k1"', '"k1"']]) {
      const answer = await raw(port, `POST /orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nIdempotency-Key: ${first}\r\nIdempotency-Key: ${second}\r\nContent-Length: 2\r\n\r\n{}`)
      expect(answer).toMatch(/^HTTP\/1\.1 400 /)
      expect(answer).toMatch(/content-type: application\/problem\+json/i)
      expect(answer).toContain('#key-invalid')
    }
    expect(runs).toBe(0)
  })

  it('runs the handler once for 20 simultaneous requests on 20 connections', async () => {
    app = Fastify()
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    const gate = new Gate()
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; await gate.hold(); reply.code(201); return { id: 'o1' } })
    const address = await app.listen({ host: '127.0.0.1', port: 0 })
    const key = newKey()
    const refused: number[] = []
    const all = Array.from({ length: 20 }, async () => {
      const res = await fetch(`${address}/orders`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{"a":1}' })
      if (res.status === 409) refused.push(res.status)
      return { status: res.status, body: await res.text() }
    })
    while (refused.length < 19) await new Promise((resolve) => setTimeout(resolve, 5))
    gate.open()
    const answers = await Promise.all(all)
    expect(answers.filter((a) => a.status === 201)).toHaveLength(1)
    expect(answers.filter((a) => a.status === 409)).toHaveLength(19)
    expect(runs).toBe(1)
    const replay = await fetch(`${address}/orders`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: '{"a":1}' })
    expect(replay.headers.get('idempotent-replayed')).toBe('true')
    expect(await replay.text()).toBe('{"id":"o1"}')
  })

  it('keeps the lease of a request whose client went away until the handler answers, then stores its response', async () => {
    const storage = observed(new MemoryStorage())
    app = Fastify()
    await app.register(idempotency, { storage })
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    const gate = new Gate()
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; await gate.hold(); reply.code(201); return { id: 'kept' } })
    await app.listen({ host: '127.0.0.1', port: 0 })
    const port = (app.server.address() as { port: number }).port
    const key = newKey()
    const body = '{"a":1}'
    const aborted = httpRequest({ host: '127.0.0.1', port, method: 'POST', path: '/orders', headers: { 'content-type': 'application/json', 'idempotency-key': key, 'content-length': body.length } })
    aborted.on('error', () => {})
    aborted.end(body)
    await gate.entered
    const closed = new Promise((resolve) => aborted.once('close', resolve))
    aborted.destroy()
    await closed
    const duringHandler = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload: body })
    expect(duringHandler.statusCode).toBe(409)
    gate.open()
    expect(await storage.settled).toBe('complete')
    const retry = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload: body })
    expect(retry.statusCode).toBe(201)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.json()).toEqual({ id: 'kept' })
    expect(runs).toBe(1)
  })

  it('frees the key of a handler that never answers once its client has gone and lockTimeout has passed', async () => {
    app = Fastify()
    // Its handler never answers: closing the app waits for it only this long.
    await app.register(idempotency, { lockTimeout: 300, closeTimeout: 100 })
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    let started!: () => void
    const running = new Promise<void>((resolve) => { started = resolve })
    app.post('/orders', { config: { idempotency: true } }, async () => {
      runs++
      if (runs === 1) { started(); await new Promise(() => {}) }
      return { run: runs }
    })
    await app.listen({ host: '127.0.0.1', port: 0 })
    const port = (app.server.address() as { port: number }).port
    const key = newKey()
    const hung = httpRequest({ host: '127.0.0.1', port, method: 'POST', path: '/orders', headers: { 'content-type': 'application/json', 'idempotency-key': key, 'content-length': 2 } })
    hung.on('error', () => {})
    hung.end('{}')
    await running
    const closed = new Promise((resolve) => hung.once('close', resolve))
    hung.destroy()
    await closed
    // The lease is time-based: past lockTimeout (with renewal stopped) the key is free again.
    await new Promise((resolve) => setTimeout(resolve, 700))
    const retry = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload: '{}' })
    expect(retry.statusCode).toBe(200)
    expect(retry.json()).toEqual({ run: 2 })
  })

  it('frees the key when Fastify\'s handlerTimeout answers 503, so an immediate retry runs', async () => {
    app = Fastify({ handlerTimeout: 100 })
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      // The first run outlives the timeout (Fastify answers 503 while it keeps running).
      if (runs === 1) await new Promise((resolve) => setTimeout(resolve, 1000))
      reply.code(201)
      return { run: runs }
    })
    const key = newKey()
    const send = () => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: {} })
    expect((await send()).statusCode).toBe(503)
    const retry = await send()
    expect(retry.statusCode).toBe(201)
    expect(retry.json()).toEqual({ run: 2 })
    expect((await send()).headers['idempotent-replayed']).toBe('true')
  })

  it('stores the response of a handler that outlives connectionTimeout, so the retry replays it', async () => {
    const storage = observed(new MemoryStorage())
    app = Fastify({ connectionTimeout: 150 })
    await app.register(idempotency, { storage })
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      await new Promise((resolve) => setTimeout(resolve, 400))
      reply.code(201)
      return { run: runs }
    })
    await app.listen({ host: '127.0.0.1', port: 0 })
    const port = (app.server.address() as { port: number }).port
    const key = newKey()
    const failed = await new Promise<string>((resolve) => {
      const req = httpRequest({ host: '127.0.0.1', port, method: 'POST', path: '/orders', headers: { 'content-type': 'application/json', 'idempotency-key': key, 'content-length': 2 } }, (res) => resolve(`answered ${res.statusCode}`))
      req.on('error', (error) => resolve(error.message))
      req.end('{}')
    })
    expect(failed).toBe('socket hang up')
    expect(await storage.settled).toBe('complete')
    const retry = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload: '{}' })
    expect(retry.statusCode).toBe(201)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(runs).toBe(1)
  })

  it('gives unflagged routes no hook at all, and lets them behave as if the plugin were absent', async () => {
    app = Fastify()
    await app.register(idempotency, { required: true })
    // An onRoute hook added after the plugin's sees each route as the plugin left it.
    const routes = new Map<string, { onRequest?: unknown, preHandler?: unknown, onSend?: unknown }>()
    app.addHook('onRoute', (route) => { routes.set(route.url, route) })
    let runs = 0
    app.post('/plain', async () => { runs++; return { run: runs } })
    app.post('/guarded', { config: { idempotency: true } }, async () => ({}))
    await app.ready()
    const plain = routes.get('/plain')!
    expect([plain.onRequest, plain.preHandler, plain.onSend]).toEqual([undefined, undefined, undefined])
    expect(routes.get('/guarded')?.onRequest).toHaveLength(1)
    for (const headers of [{ 'idempotency-key': 'k' }, { 'idempotency-key': 'k' }, { 'idempotency-key': 'not valid' }, {}]) {
      const res = await app.inject({ method: 'POST', url: '/plain', headers, payload: {} })
      expect(res.statusCode).toBe(200)
      expect(res.headers['idempotent-replayed']).toBeUndefined()
    }
    expect(runs).toBe(4)
  })
})
