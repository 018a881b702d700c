/**
 * Every way Fastify lets a handler answer, on every store, over real HTTP: the first answer with a
 * key is the answer the same app gives without the plugin (status, headers, body), a retry gets
 * that answer again (replayed when it was stored), and no unhandled rejection surfaces.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

type Style = (request: FastifyRequest, reply: FastifyReply) => unknown
const later = (fn: () => void): void => { setTimeout(fn, 5) }

/**
 * name -> [handler, what a retry gets]: the answer replayed whole, its outcome replayed without the
 * body (a body the plugin cannot keep), or the handler run again (an answer that is not stored).
 */
type OnRetry = 'replayed' | 'outcome' | 'run again'
const styles: Record<string, [Style, OnRetry]> = {
  'async, returns a value': [async (_req, reply) => { reply.code(201); return { id: 1 } }, 'replayed'],
  'sync, returns a value': [(_req, reply) => { reply.code(201); return { id: 1 } }, 'replayed'],
  'async, send then return reply': [async (_req, reply) => { reply.code(201).send({ id: 1 }); return reply }, 'replayed'],
  'async, send without return reply': [async (_req, reply) => { reply.code(202).send({ queued: true }) }, 'replayed'],
  'async, 204 without return reply': [async (_req, reply) => { reply.code(204).send() }, 'replayed'],
  'sync, send without return': [(_req, reply) => { reply.code(201).send({ id: 1 }) }, 'replayed'],
  'sync, send later from a callback': [(_req, reply) => { later(() => { reply.code(201).send({ id: 1 }) }) }, 'replayed'],
  'async, return reply then send later': [async (_req, reply) => { later(() => { reply.code(201).send({ id: 1 }) }); return reply }, 'replayed'],
  'a Node stream': [async (_req, reply) => { reply.type('text/plain'); return Readable.from(['a', 'b', 'c']) }, 'replayed'],
  'a Buffer': [async (_req, reply) => { reply.type('application/octet-stream'); return Buffer.from([0, 1, 2, 255]) }, 'replayed'],
  'a string': [async () => 'plain text', 'replayed'],
  'a web stream': [async (_req, reply) => { reply.type('text/plain'); return new ReadableStream({ start (c) { c.enqueue(new TextEncoder().encode('web')); c.close() } }) }, 'outcome'],
  'a Response': [async () => new Response('from a Response', { status: 201, headers: { 'content-type': 'text/plain', 'x-from': 'response' } }), 'outcome'],
  'reply.redirect()': [async (_req, reply) => reply.redirect('/elsewhere', 303), 'run again'],
  'an error thrown': [async () => { throw Object.assign(new Error('declined'), { statusCode: 402 }) }, 'run again'],
  'reply.send(error)': [(_req, reply) => { reply.send(Object.assign(new Error('declined'), { statusCode: 402 })) }, 'run again'],
  'reply.hijack() then a raw write': [async (_req, reply) => {
    reply.hijack()
    // Headers set with setHeader are part of the outcome kept; those passed to writeHead are not seen.
    reply.raw.setHeader('content-type', 'text/plain')
    reply.raw.writeHead(200)
    reply.raw.end('hijacked')
  }, 'outcome']
}

async function serve (storage: IdempotencyStorage | undefined): Promise<{ app: FastifyInstance, url: string }> {
  const app = Fastify()
  if (storage !== undefined) await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  for (const [index, [handler]] of Object.values(styles).entries()) {
    app.post(`/style/${index}`, { config: { idempotency: true } }, handler)
  }
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, url: `http://127.0.0.1:${(app.server.address() as { port: number }).port}` }
}

/** What a client notices of an answer: status, the headers that are not per transmission, body. */
async function answer (url: string, key: string | undefined): Promise<{ status: number, headers: Record<string, string>, body: string, replayed: string | null }> {
  const res = await fetch(url, { method: 'POST', redirect: 'manual', headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) }, body: '{"a":1}' })
  const headers: Record<string, string> = {}
  for (const [name, value] of res.headers) {
    if (!['date', 'connection', 'keep-alive', 'transfer-encoding', 'content-length', 'idempotent-replayed'].includes(name)) headers[name] = value
  }
  return { status: res.status, headers, body: await res.text(), replayed: res.headers.get('idempotent-replayed') }
}

const rejections: unknown[] = []
const onRejection = (reason: unknown): void => { rejections.push(reason) }
beforeAll(() => { process.on('unhandledRejection', onRejection) })
afterAll(() => { process.off('unhandledRejection', onRejection) })

for (const store of cases) {
  describe.skipIf(!store.available)(`every handler style, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    let guarded: Awaited<ReturnType<typeof serve>>
    let bare: Awaited<ReturnType<typeof serve>>
    beforeAll(async () => {
      storage = await store.create()
      guarded = await serve(storage)
      bare = await serve(undefined)
    })
    afterAll(async () => {
      await guarded.app.close()
      await bare.app.close()
      await store.cleanup()
    })
    afterEach(() => { expect(rejections).toEqual([]) })

    for (const [index, [name, [, onRetry]]] of Object.entries(styles).entries()) {
      it(`${name}: the same answer as without the plugin, and ${onRetry} on a retry`, async () => {
        const path = `/style/${index}`
        const { replayed: _, ...expected } = await answer(bare.url + path, undefined)
        const key = newKey()
        const { replayed: firstReplayed, ...first } = await answer(guarded.url + path, key)
        expect(first).toEqual(expected)
        expect(firstReplayed).toBeNull()
        const { replayed, ...retry } = await answer(guarded.url + path, key)
        if (onRetry === 'outcome') {
          const { 'idempotent-body-omitted': omitted, ...headers } = retry.headers
          expect({ ...retry, headers }).toEqual({ ...expected, body: '' })
          expect(omitted).toBe('true')
        } else {
          expect(retry).toEqual(expected)
        }
        expect(replayed).toBe(onRetry === 'run again' ? null : 'true')
      })
    }
  })
}
