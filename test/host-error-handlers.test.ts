/**
 * Whatever error handler answers the plugin's refusals (an app's own central mapper that knows
 * nothing of the plugin, Fastify's default, or idempotencyErrorHandler), every refusal carries its
 * retry signals: Retry-After and Retry-After-Ms where a retry may succeed, Stripe-Should-Retry
 * and X-Should-Retry always. Every place the plugin refuses, on every store, over real HTTP.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { randomBytes } from 'node:crypto'
import Fastify, { type FastifyError, type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions } from '../lib/index.js'
import type { IdempotencyStorage, StorageTransaction, TransactionalStorage } from '../lib/storage/types.js'
import { newKey, withMethods } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

/** An app's own error mapper: status and message, nothing else (NestJS's default answers alike). */
function centralMapper (error: FastifyError, _request: FastifyRequest, reply: FastifyReply): void {
  void reply.code(error.statusCode ?? 500).send({ message: error.message })
}

const handlers = {
  'an app\'s own error mapper': centralMapper,
  'Fastify\'s default error handler': null,
  idempotencyErrorHandler: idempotencyErrorHandler()
} as const

const KEY_1 = randomBytes(32)
const KEY_2 = randomBytes(32)
const HASH_SECRET = randomBytes(32)
const STEP_KEY_PREFIX = '\u0000step:'

/** The signals of a refusal a retry can never turn into a success. */
const DO_NOT_RETRY = { 'stripe-should-retry': 'false', 'x-should-retry': 'false' }

interface Answer { status: number, headers: Headers }

function expectRetryLater (answer: Answer, status: number): void {
  expect(answer.status).toBe(status)
  expect(answer.headers.get('stripe-should-retry')).toBe('true')
  expect(answer.headers.get('x-should-retry')).toBe('true')
  expect(Number(answer.headers.get('retry-after'))).toBeGreaterThanOrEqual(1)
  expect(Number(answer.headers.get('retry-after-ms'))).toBeGreaterThan(0)
}

function expectDoNotRetry (answer: Answer, status: number): void {
  expect(answer.status).toBe(status)
  expect({ 'stripe-should-retry': answer.headers.get('stripe-should-retry'), 'x-should-retry': answer.headers.get('x-should-retry') }).toEqual(DO_NOT_RETRY)
  expect(answer.headers.get('retry-after')).toBeNull()
}

/** `storage` in transaction mode whose every transaction finds its lease lost at completion. */
function losingLeases (storage: IdempotencyStorage): IdempotencyStorage {
  const transactional = storage as TransactionalStorage
  return withMethods(transactional, {
    transaction: async (): Promise<StorageTransaction> => withMethods(await transactional.transaction(), { complete: async () => false })
  })
}

/**
 * One app with a context per way of being refused: the plugin registered in each with its own
 * options, every context under the one error handler of the app.
 */
async function serve (storage: IdempotencyStorage, transactional: boolean, handler: (typeof handlers)[keyof typeof handlers], gate: Gate): Promise<{ app: FastifyInstance, origin: string }> {
  const app = Fastify()
  if (handler !== null) app.setErrorHandler(handler)
  const context = (options: IdempotencyOptions, routes: (child: FastifyInstance) => void) => app.register(async (child) => {
    await child.register(idempotency, options)
    routes(child)
  })
  await context({ storage }, (child) => {
    child.post('/orders', { config: { idempotency: true } }, async (request) => {
      if ((request.body as { hold?: boolean }).hold === true) await gate.hold()
      return { ok: true }
    })
    child.post('/required', { config: { idempotency: { required: true } } }, async () => ({ ok: true }))
  })
  const down = withMethods(storage, { begin: async () => { throw new Error('connection refused') } })
  await context({ storage: down }, (child) => { child.post('/down', { config: { idempotency: true } }, async () => ({ ok: true })) })
  const stepsDown = withMethods(storage, {
    begin: async (...[key, fingerprint, lockTimeout]: Parameters<IdempotencyStorage['begin']>) => {
      if (key.startsWith(STEP_KEY_PREFIX)) throw new Error('connection refused')
      return await storage.begin(key, fingerprint, lockTimeout)
    }
  })
  await context({ storage: stepsDown }, (child) => {
    child.post('/steps', { config: { idempotency: true } }, async (request) => ({ charged: await request.idempotency!.step('charge', () => 42) }))
  })
  await context({ storage, encryption: { keys: [KEY_1], keyHashSecret: HASH_SECRET } }, (child) => {
    child.post('/sealed', { config: { idempotency: true } }, async () => ({ ok: true }))
  })
  await context({ storage, encryption: { keys: [KEY_2], keyHashSecret: HASH_SECRET } }, (child) => {
    child.post('/rotated-away', { config: { idempotency: true } }, async () => ({ ok: true }))
  })
  if (transactional) {
    await context({ storage: losingLeases(storage), transaction: true }, (child) => {
      child.post('/trx', { config: { idempotency: true } }, async (_request, reply) => reply.code(201).send({ ok: true }))
    })
  }
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, origin: `http://127.0.0.1:${(app.server.address() as { port: number }).port}` }
}

for (const store of cases) {
  describe.skipIf(!store.available)(`refusals carry their retry signals through any error handler, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })
    const transactional = store.name !== 'memory' && store.name !== 'redis'

    for (const [name, handler] of Object.entries(handlers)) {
      describe(`answered by ${name}`, () => {
        let server: Awaited<ReturnType<typeof serve>>
        const gate = new Gate()
        beforeAll(async () => { server = await serve(storage, transactional, handler, gate) })
        afterAll(async () => {
          gate.open()
          await server.app.close()
        })

        const post = async (path: string, key: string | null, body: unknown = {}): Promise<Answer> => {
          const res = await fetch(server.origin + path, {
            method: 'POST',
            headers: { 'content-type': 'application/json', ...(key === null ? {} : { 'idempotency-key': key }) },
            body: typeof body === 'string' ? body : JSON.stringify(body)
          })
          await res.arrayBuffer()
          return { status: res.status, headers: res.headers }
        }

        it('onRequest, an invalid key: 400, do not retry', async () => {
          expectDoNotRetry(await post('/orders', ''), 400)
        })

        it('onRequest, a missing key on a route that requires one: 400, do not retry', async () => {
          expectDoNotRetry(await post('/required', null), 400)
        })

        it('preHandler, a body that cannot be fingerprinted: 400, do not retry', async () => {
          expectDoNotRetry(await post('/orders', newKey(), '['.repeat(20_000) + ']'.repeat(20_000)), 400)
        })

        it('preHandler, a key reused for another request: 409, do not retry', async () => {
          const key = newKey()
          expect((await post('/orders', key, { amount: 1 })).status).toBe(200)
          expectDoNotRetry(await post('/orders', key, { amount: 2 }), 409)
        })

        it('preHandler, a duplicate while the first is in flight: 409, retry after', async () => {
          const key = newKey()
          const first = post('/orders', key, { hold: true })
          await gate.entered
          expectRetryLater(await post('/orders', key, { hold: true }), 409)
          gate.open()
          expect((await first).status).toBe(200)
        })

        it('preHandler, the store is unreachable: 503, retry after', async () => {
          expectRetryLater(await post('/down', newKey()), 503)
        })

        it('preHandler, a stored answer that cannot be opened: 409, do not retry', async () => {
          const key = newKey()
          expect((await post('/sealed', key)).status).toBe(200)
          expectDoNotRetry(await post('/rotated-away', key), 409)
        })

        it('in the handler, a recovery point whose store is unreachable: 503, retry after', async () => {
          expectRetryLater(await post('/steps', newKey()), 503)
        })

        it.skipIf(!transactional)('onSend, transaction mode whose lease was lost before commit: 503, retry after', async () => {
          expectRetryLater(await post('/trx', newKey()), 503)
        })
      })
    }
  })
}
