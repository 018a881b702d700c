/**
 * Routes whose schema changes the body (fastify-type-provider-zod with transforms and defaults,
 * TypeBox with Fastify's Ajv), over real HTTP on every store: the body counts as it arrived, so
 * different bodies never replay each other's answer, a transform into a value JSON cannot hold
 * never refuses the request, and a default made anew for each request never turns a retry into a
 * mismatch.
 */
import { describe, expect, it } from 'vitest'
import { randomUUID } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import { serializerCompiler, validatorCompiler, type ZodTypeProvider } from 'fastify-type-provider-zod'
import { z } from 'zod'
import { Type, type TypeBoxTypeProvider } from '@fastify/type-provider-typebox'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

/** A class the schema builds, with no toJSON: its data is a private field no walk can see. */
class Money {
  readonly #cents: bigint
  constructor (cents: bigint) { this.#cents = cents }
  get cents (): string { return this.#cents.toString() }
}

async function build (storage: IdempotencyStorage): Promise<{ app: FastifyInstance, runs: Map<string, number> }> {
  const app = Fastify()
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  const runs = new Map<string, number>()
  const run = (path: string): number => {
    runs.set(path, (runs.get(path) ?? 0) + 1)
    return runs.get(path)!
  }
  // zod's compilers in a context of their own; TypeBox's routes keep Fastify's Ajv.
  await app.register(async (context) => {
    context.setValidatorCompiler(validatorCompiler)
    context.setSerializerCompiler(serializerCompiler)
    const zod = context.withTypeProvider<ZodTypeProvider>()
    zod.post('/tags', {
      config: { idempotency: true },
      schema: { body: z.object({ tags: z.array(z.string()).transform((tags) => new Set(tags)) }) }
    }, async (request) => ({ run: run('/tags'), tags: [...request.body.tags] }))
    zod.post('/limits', {
      config: { idempotency: true },
      schema: { body: z.object({ limits: z.record(z.string(), z.number()).transform((limits) => new Map(Object.entries(limits))) }) }
    }, async (request) => ({ run: run('/limits'), size: request.body.limits.size }))
    zod.post('/transfers', {
      config: { idempotency: { required: true } },
      schema: { body: z.object({ amount: z.string().regex(/^\d+$/).transform(BigInt), to: z.string() }) }
    }, async (request) => ({ run: run('/transfers'), amount: request.body.amount.toString(), to: request.body.to }))
    zod.post('/payments', {
      config: { idempotency: true },
      schema: { body: z.object({ cents: z.string().transform((cents) => new Money(BigInt(cents))), requestId: z.string().default(() => randomUUID()) }) }
    }, async (request) => ({ run: run('/payments'), cents: request.body.cents.cents }))
  })
  app.withTypeProvider<TypeBoxTypeProvider>().post('/products', {
    config: { idempotency: true },
    schema: { body: Type.Object({ name: Type.String(), price: Type.Integer() }, { additionalProperties: false }) }
  }, async (request) => ({ run: run('/products'), price: request.body.price }))
  return { app, runs }
}

interface Answer { status: number, body: Record<string, unknown>, replayed: string | null }

for (const store of cases) {
  describe.skipIf(!store.available)(`type providers, on ${store.name}${store.reason}`, () => {
    const served = servedOn(store, build)

    const post = async (path: string, key: string, body: unknown): Promise<Answer> => {
      const res = await fetch(`${served.url}${path}`, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: JSON.stringify(body) })
      return { status: res.status, body: await res.json() as Record<string, unknown>, replayed: res.headers.get('idempotent-replayed') }
    }
    const expectMismatch = (answer: Answer) => {
      expect(answer.status).toBe(409)
      expect(answer.body.type).toMatch(/#fingerprint-mismatch$/)
    }

    it('zod: bodies a transform turns into Sets are told apart: a different one is refused, the same one replayed', async () => {
      const key = newKey('tags')
      const first = await post('/tags', key, { tags: ['a', 'b'] })
      expect(first).toMatchObject({ status: 200, body: { run: 1, tags: ['a', 'b'] } })
      expectMismatch(await post('/tags', key, { tags: ['c'] }))
      expect(await post('/tags', key, { tags: ['a', 'b'] })).toMatchObject({ status: 200, replayed: 'true', body: first.body })
      expect(served.runs.get('/tags')).toBe(1)
    })

    it('zod: bodies a transform turns into Maps are told apart', async () => {
      const key = newKey('limits')
      expect((await post('/limits', key, { limits: { eur: 5 } })).status).toBe(200)
      expectMismatch(await post('/limits', key, { limits: { eur: 6 } }))
      expect(served.runs.get('/limits')).toBe(1)
    })

    it('zod: a route that transforms into BigInt takes keys (it requires them): the retry is replayed, another amount refused', async () => {
      const key = newKey('transfer')
      const first = await post('/transfers', key, { amount: '9007199254740993', to: 'acct-1' })
      expect(first).toMatchObject({ status: 200, body: { run: 1, amount: '9007199254740993' } })
      expect(await post('/transfers', key, { to: 'acct-1', amount: '9007199254740993' })).toMatchObject({ status: 200, replayed: 'true', body: first.body })
      expectMismatch(await post('/transfers', key, { amount: '9007199254740992', to: 'acct-1' }))
      expect(served.runs.get('/transfers')).toBe(1)
    })

    it('zod: a default made anew for each request (a random id) and a class instance do not turn a retry into a mismatch', async () => {
      const key = newKey('payment')
      const first = await post('/payments', key, { cents: '1250' })
      expect(first).toMatchObject({ status: 200, body: { run: 1, cents: '1250' } })
      expect(await post('/payments', key, { cents: '1250' })).toMatchObject({ status: 200, replayed: 'true', body: first.body })
      expectMismatch(await post('/payments', key, { cents: '1251' }))
      expect(served.runs.get('/payments')).toBe(1)
    })

    it('TypeBox: the body counts as sent, before Ajv coerces it or strips members', async () => {
      const key = newKey('product')
      const first = await post('/products', key, { name: 'pen', price: 5 })
      expect(first).toMatchObject({ status: 200, body: { run: 1, price: 5 } })
      expect(await post('/products', key, { price: 5, name: 'pen' })).toMatchObject({ status: 200, replayed: 'true' })
      // The handler would see the same body, but the client sent another: a client retries with the same bytes.
      expectMismatch(await post('/products', key, { name: 'pen', price: '5' }))
      expectMismatch(await post('/products', key, { name: 'pen', price: 5, note: 'x' }))
      expect(served.runs.get('/products')).toBe(1)
    })
  })
}
