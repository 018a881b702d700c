/**
 * Beside the @fastify plugins a real app registers, before and after this one, over real HTTP, on
 * every store: a retry gets its own CORS, security, rate-limit headers and the content coding its
 * Accept-Encoding asks for, never another response's cookies, and a rate-limited request never
 * reaches the store, whatever the order of registration.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { request as httpRequest, type IncomingHttpHeaders } from 'node:http'
import { brotliDecompressSync, gunzipSync } from 'node:zlib'
import Fastify, { type FastifyInstance } from 'fastify'
import compress from '@fastify/compress'
import cors from '@fastify/cors'
import cookie from '@fastify/cookie'
import etag from '@fastify/etag'
import helmet from '@fastify/helmet'
import rateLimit from '@fastify/rate-limit'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey, withMethods } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

interface Answer { status: number, headers: IncomingHttpHeaders, body: Buffer }

/** A POST whose headers and raw answer are exactly what went over the wire (no automatic decoding). */
function post (port: number, path: string, headers: Record<string, string>, body = '{"amount":42}'): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = httpRequest({ host: '127.0.0.1', port, path, method: 'POST', headers: { 'content-type': 'application/json', ...headers } }, (res) => {
      const chunks: Buffer[] = []
      res.on('data', (chunk: Buffer) => chunks.push(chunk))
      res.on('end', () => { resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks) }) })
    })
    req.on('error', reject)
    req.end(body)
  })
}

function decoded (answer: Answer): string {
  const coding = answer.headers['content-encoding']
  if (coding === 'gzip') return gunzipSync(answer.body).toString()
  if (coding === 'br') return brotliDecompressSync(answer.body).toString()
  return answer.body.toString()
}

/** The order of registration: the other plugin before this one, or after. */
type Order = 'before' | 'after'

async function serve (storage: IdempotencyStorage, register: (app: FastifyInstance) => Promise<void>, order: Order): Promise<{ app: FastifyInstance, port: number, charges: () => number }> {
  const app = Fastify()
  if (order === 'before') await register(app)
  await app.register(idempotency, { storage })
  if (order === 'after') await register(app)
  app.setErrorHandler(idempotencyErrorHandler())
  let runs = 0
  // Long enough for @fastify/compress (threshold 1024 bytes by default) to compress it.
  app.post('/payments', { config: { idempotency: true } }, async (request, reply) => {
    reply.code(201)
    return { run: ++runs, request: request.body, receipt: 'r'.repeat(2000) }
  })
  // A charge whose answer is the same every time, so its ETag is too.
  let charges = 0
  app.post('/charge', { config: { idempotency: true } }, async (_request, reply) => {
    charges++
    reply.code(201)
    return { charged: true }
  })
  // Signs a client in: its answer sets a session cookie (with @fastify/cookie registered).
  let sessions = 0
  app.post('/sessions', { config: { idempotency: true } }, async (_request, reply) => {
    const session = `s${++sessions}`
    reply.setCookie('session', session, { httpOnly: true, path: '/' }).code(201)
    return { session }
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, port: (app.server.address() as { port: number }).port, charges: () => charges }
}

/** The store, with a count of the `begin` calls that reach it. */
function countingBegins (storage: IdempotencyStorage): { storage: IdempotencyStorage, begins: () => number } {
  let begins = 0
  const counted = withMethods(storage, {
    begin: async (...args: Parameters<IdempotencyStorage['begin']>) => { begins++; return await storage.begin(...args) }
  })
  return { storage: counted, begins: () => begins }
}

/** A first request with a new key (201), then its retry, replayed with the same body. */
async function firstAndReplay (port: number, path: string): Promise<{ key: string, first: Answer, retry: Answer }> {
  const key = newKey()
  const first = await post(port, path, { 'idempotency-key': key })
  expect(first.status).toBe(201)
  const retry = await post(port, path, { 'idempotency-key': key })
  expect(retry.headers['idempotent-replayed']).toBe('true')
  expect(retry.body.equals(first.body)).toBe(true)
  return { key, first, retry }
}

for (const store of cases) {
  describe.skipIf(!store.available)(`with the usual @fastify plugins, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    for (const order of ['before', 'after'] as const) {
      it(`@fastify/etag registered ${order}: a POST turned into 304 after the handler ran does not free the key for a second run`, async () => {
        const { app, port, charges } = await serve(storage, async (app) => { await app.register(etag) }, order)
        try {
          const first = await post(port, '/charge', { 'idempotency-key': newKey() })
          expect(first.status).toBe(201)
          const tag = String(first.headers.etag)
          // Another operation whose answer has the same ETag, sent with If-None-Match: the handler
          // charges, then @fastify/etag answers 304.
          const key = newKey()
          const conditional = await post(port, '/charge', { 'idempotency-key': key, 'if-none-match': tag })
          expect(conditional.status).toBe(304)
          expect(charges()).toBe(2)
          const retry = await post(port, '/charge', { 'idempotency-key': key, 'if-none-match': tag })
          expect(retry.status).toBe(304)
          expect(retry.headers['idempotent-replayed']).toBe('true')
          expect(retry.headers.etag).toBe(tag)
          expect(charges()).toBe(2)
        } finally {
          await app.close()
        }
      })

      it(`@fastify/cors registered ${order}: a retry from another origin gets its own Access-Control-Allow-Origin`, async () => {
        const { app, port } = await serve(storage, async (app) => { await app.register(cors, { origin: true, exposedHeaders: ['Idempotent-Replayed', 'Retry-After'] }) }, order)
        try {
          const key = newKey()
          const first = await post(port, '/payments', { origin: 'https://shop.example', 'idempotency-key': key })
          expect(first.status).toBe(201)
          expect(first.headers['access-control-allow-origin']).toBe('https://shop.example')
          const retry = await post(port, '/payments', { origin: 'https://admin.example', 'idempotency-key': key })
          expect(retry.headers['idempotent-replayed']).toBe('true')
          expect(retry.headers['access-control-allow-origin']).toBe('https://admin.example')
          expect(retry.headers['access-control-expose-headers']).toBe('Idempotent-Replayed, Retry-After')
          expect(retry.body.equals(first.body)).toBe(true)
        } finally {
          await app.close()
        }
      })

      it(`@fastify/rate-limit registered ${order}: a limited request gets 429 without reaching the store; each answer carries its own budget`, async () => {
        const counted = countingBegins(storage)
        const { app, port } = await serve(counted.storage, async (app) => { await app.register(rateLimit, { max: 2, timeWindow: 60_000 }) }, order)
        try {
          const { key, first, retry } = await firstAndReplay(port, '/payments')
          expect(first.headers['x-ratelimit-remaining']).toBe('1')
          // The retry's own budget, not the one stored with the first answer.
          expect(retry.headers['x-ratelimit-remaining']).toBe('0')
          const begins = counted.begins()
          expect(begins).toBe(2)
          const limited = await post(port, '/payments', { 'idempotency-key': newKey() })
          expect(limited.status).toBe(429)
          const limitedRetry = await post(port, '/payments', { 'idempotency-key': key })
          expect(limitedRetry.status).toBe(429)
          expect(limitedRetry.headers['idempotent-replayed']).toBeUndefined()
          expect(counted.begins()).toBe(begins)
        } finally {
          await app.close()
        }
      })

      it(`@fastify/rate-limit with hook 'preHandler', registered ${order}: its preHandler runs before this plugin's, so a limited request, and a limited retry, never reach the store`, async () => {
        const counted = countingBegins(storage)
        const { app, port } = await serve(counted.storage, async (app) => { await app.register(rateLimit, { max: 1, timeWindow: 60_000, hook: 'preHandler' }) }, order)
        try {
          const key = newKey()
          expect((await post(port, '/payments', { 'idempotency-key': key })).status).toBe(201)
          const limited = await post(port, '/payments', { 'idempotency-key': newKey() })
          expect(limited.status).toBe(429)
          const retry = await post(port, '/payments', { 'idempotency-key': key })
          // Whatever the order of registration, the limiter's preHandler runs first (the plugin's
          // request hooks are the route's last): neither the limited request nor the limited retry
          // took a lease, and the retry is limited, not replayed.
          expect(counted.begins()).toBe(1)
          expect(retry.status).toBe(429)
          expect(retry.headers['idempotent-replayed']).toBeUndefined()
        } finally {
          await app.close()
        }
      })

      it(`@fastify/helmet registered ${order}: a replay carries the security headers, the Content-Security-Policy nonce its own`, async () => {
        const { app, port } = await serve(storage, async (app) => { await app.register(helmet, { enableCSPNonces: true }) }, order)
        try {
          const { first, retry } = await firstAndReplay(port, '/payments')
          expect(first.headers['x-content-type-options']).toBe('nosniff')
          expect(retry.headers['x-content-type-options']).toBe('nosniff')
          expect(retry.headers['strict-transport-security']).toBe(first.headers['strict-transport-security'])
          const nonce = (answer: Answer): string | undefined => /'nonce-([^']+)'/.exec(String(answer.headers['content-security-policy']))?.[1]
          expect(nonce(first)).toBeDefined()
          expect(nonce(retry)).toBeDefined()
          expect(nonce(retry)).not.toBe(nonce(first))
        } finally {
          await app.close()
        }
      })

      it(`@fastify/cookie registered ${order}: the cookie an answer set is not replayed to a retry`, async () => {
        const { app, port } = await serve(storage, async (app) => { await app.register(cookie) }, order)
        try {
          const { first, retry } = await firstAndReplay(port, '/sessions')
          expect(first.headers['set-cookie']).toHaveLength(1)
          expect(first.headers['set-cookie']?.[0]).toMatch(new RegExp(`^session=${JSON.parse(first.body.toString()).session};`))
          expect(retry.headers['set-cookie']).toBeUndefined()
        } finally {
          await app.close()
        }
      })

      it(`@fastify/compress registered ${order}: every retry gets the coding its Accept-Encoding asks for, the same body`, async () => {
        const { app, port } = await serve(storage, async (app) => { await app.register(compress, { encodings: ['br', 'gzip'] }) }, order)
        try {
          const key = newKey()
          const first = await post(port, '/payments', { 'accept-encoding': 'br', 'idempotency-key': key })
          expect(first.status).toBe(201)
          expect(first.headers['content-encoding']).toBe('br')
          const text = decoded(first)
          expect(JSON.parse(text).run).toBe(1)
          // Whichever coding the retry gets, it is one it accepts (q > 0), and the body is the same.
          for (const [accept, allowed] of [['identity', [undefined]], ['gzip', ['gzip']], ['br', ['br']], ['gzip;q=0.5, br;q=0.1', ['gzip', 'br']], ['gzip, br;q=0', ['gzip']]] as const) {
            const retry = await post(port, '/payments', { 'accept-encoding': accept, 'idempotency-key': key })
            expect(retry.headers['idempotent-replayed'], accept).toBe('true')
            expect(allowed, accept).toContain(retry.headers['content-encoding'])
            expect(decoded(retry), accept).toBe(text)
          }
          const plain = await post(port, '/payments', { 'idempotency-key': key })
          expect(plain.headers['content-encoding']).toBeUndefined()
          expect(plain.body.toString()).toBe(text)
        } finally {
          await app.close()
        }
      })
    }
  })
}
