/**
 * Every way Fastify lets a handler answer, on every store, over real HTTP/1.1 and HTTP/2 (h2c) and
 * through `app.inject` (as serverless adapters serve): the first answer with a key is the answer
 * the same app gives without the plugin (status, headers, body), a retry gets that answer again
 * (replayed when it was stored), and no unhandled rejection surfaces.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { connect } from 'node:http2'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey, withMethods } from './helpers/app.js'
import { http2Post } from './helpers/http2.js'
import { storeCases } from './helpers/stores.js'
import { resendWhile } from './helpers/resend.js'

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
  'a web stream': [async (_req, reply) => { reply.type('text/plain'); return new ReadableStream({ start (c) { c.enqueue(new TextEncoder().encode('web')); c.close() } }) }, 'replayed'],
  'a Response': [async () => new Response('from a Response', { status: 201, headers: { 'content-type': 'text/plain', 'x-from': 'response' } }), 'replayed'],
  'a Response without a body': [async () => new Response(null, { status: 202, headers: { 'x-from': 'response' } }), 'replayed'],
  // The Response's status is the one sent, whatever reply.code() said before it.
  'a Response with status 500': [async () => new Response('upstream failed', { status: 500 }), 'run again'],
  // Fastify refuses it (500 FST_ERR_REP_RESPONSE_BODY_CONSUMED): nothing is kept.
  'a Response whose body was read': [async () => { const response = new Response('read', { status: 201 }); await response.text(); return response }, 'run again'],
  'reply.code(500), then a Response with status 201': [async (_req, reply) => { reply.code(500); return new Response('created', { status: 201 }) }, 'replayed'],
  // Post/Redirect/Get: the redirect is the operation's answer (302 and 303 are in the default set).
  'reply.redirect()': [async (_req, reply) => reply.redirect('/elsewhere'), 'replayed'],
  'reply.redirect() with 303': [async (_req, reply) => reply.redirect('/elsewhere', 303), 'replayed'],
  'reply.redirect() with 307': [async (_req, reply) => reply.redirect('/elsewhere', 307), 'run again'],
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

type Protocol = 'HTTP/1.1' | 'HTTP/2' | 'inject'

/** What a client notices of an answer: status, the headers that are not per transmission, body. */
interface Answer { status: number, headers: Record<string, string>, body: string, replayed: string | null }
const PER_TRANSMISSION = new Set(['date', 'connection', 'keep-alive', 'transfer-encoding', 'content-length', 'idempotent-replayed'])

function noticed (status: number, all: Iterable<[string, string]>, body: string): Answer {
  const headers: Record<string, string> = {}
  let replayed: string | null = null
  for (const [name, value] of all) {
    if (name === 'idempotent-replayed') replayed = value
    if (!PER_TRANSMISSION.has(name) && !name.startsWith(':')) headers[name] = value
  }
  return { status, headers, body, replayed }
}

interface Server { answer: (path: string, key: string | undefined) => Promise<Answer>, close: () => Promise<void> }

async function serve (storage: IdempotencyStorage | undefined, protocol: Protocol): Promise<Server> {
  const app = protocol === 'HTTP/2' ? Fastify({ http2: true }) as unknown as FastifyInstance : Fastify()
  if (storage !== undefined) await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  for (const [index, [handler]] of Object.values(styles).entries()) {
    app.post(`/style/${index}`, { config: { idempotency: true } }, handler)
  }
  if (protocol === 'inject') {
    await app.ready()
    return {
      answer: async (path, key) => {
        const res = await app.inject({ method: 'POST', url: path, headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) }, payload: '{"a":1}' })
        return noticed(res.statusCode, Object.entries(res.headers).map(([n, v]) => [n, Array.isArray(v) ? v.join(', ') : String(v)]), res.body)
      },
      close: async () => { await app.close() }
    }
  }
  await app.listen({ host: '127.0.0.1', port: 0 })
  const origin = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`
  const headers = (key: string | undefined): Record<string, string> => ({ 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) })
  if (protocol === 'HTTP/1.1') {
    return {
      answer: async (path, key) => {
        const res = await fetch(origin + path, { method: 'POST', redirect: 'manual', headers: headers(key), body: '{"a":1}' })
        return noticed(res.status, res.headers, await res.text())
      },
      close: async () => { await app.close() }
    }
  }
  const session = connect(origin)
  return {
    answer: async (path, key) => {
      const { status, headers: received, body } = await http2Post(session, path, headers(key), '{"a":1}')
      return noticed(status, received, body.toString())
    },
    close: async () => {
      await new Promise<void>((resolve) => { session.close(() => { resolve() }) })
      await app.close()
    }
  }
}

const rejections: unknown[] = []
const onRejection = (reason: unknown): void => { rejections.push(reason) }
beforeAll(() => { process.on('unhandledRejection', onRejection) })
afterAll(() => { process.off('unhandledRejection', onRejection) })

for (const store of cases) {
  describe.skipIf(!store.available)(`every handler style, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })
    afterEach(() => { expect(rejections).toEqual([]) })

    it('an entry that holds an HTTP/2 pseudo-header (:status) is replayed without it', async () => {
      const holding = withMethods(storage, {
        complete: async (...[key, token, response, expiration]: Parameters<IdempotencyStorage['complete']>) =>
          await storage.complete(key, token, { ...response, headers: { ...response.headers, ':status': String(response.statusCode) } }, expiration)
      })
      const server = await serve(holding, 'HTTP/1.1')
      try {
        const key = newKey()
        const { replayed: _, ...first } = await server.answer('/style/0', key)
        const { replayed, ...retry } = await server.answer('/style/0', key)
        expect(replayed).toBe('true')
        expect(retry).toEqual(first)
      } finally {
        await server.close()
      }
    })

    for (const protocol of ['HTTP/1.1', 'HTTP/2', 'inject'] as const) {
      describe(`over ${protocol}`, () => {
        let guarded: Server
        let bare: Server
        beforeAll(async () => {
          guarded = await serve(storage, protocol)
          bare = await serve(undefined, protocol)
        })
        afterAll(async () => {
          await guarded.close()
          await bare.close()
        })

        for (const [index, [name, [, onRetry]]] of Object.entries(styles).entries()) {
          it(`${name}: the same answer as without the plugin, and ${onRetry} on a retry`, async () => {
            const path = `/style/${index}`
            const { replayed: _, ...expected } = await bare.answer(path, undefined)
            const key = newKey()
            const { replayed: firstReplayed, ...first } = await guarded.answer(path, key)
            expect(first).toEqual(expected)
            expect(firstReplayed).toBeNull()
            // A hijacked reply's outcome is stored once its raw response has closed, after its client
            // got the answer: a retry that comes first gets 409 #request-in-progress, then the outcome.
            const answer = await resendWhile(name.startsWith('reply.hijack()') ? [409] : [], () => guarded.answer(path, key), {
              attempts: 50,
              pause: 20,
              onRefused: (refused) => { expect(refused.body).toMatch(/#request-in-progress/) }
            })
            const { replayed, ...retry } = answer
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
  })
}
