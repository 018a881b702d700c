/**
 * Deployments and upgrades that share a store, over real HTTP on every store: an app of
 * fastify-idempotency 0.1.0 as released (test/fixtures/fastify-idempotency-0.1.0.tgz) stores,
 * then the upgraded app with other fingerprint options answers the retry; a deployment that
 * changes its fingerprint options answers the retries of the previous one; an entry of a version
 * or a layout this release does not know is refused, and kept.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify'
import formbody from '@fastify/formbody'
import { validatorCompiler, type ZodTypeProvider } from 'fastify-type-provider-zod'
import { z } from 'zod'
import { Redis } from 'ioredis'
import * as v010 from 'fastify-idempotency-0.1.0'
import { RedisStorage as RedisStorage010 } from 'fastify-idempotency-0.1.0/redis'
import { KnexStorage as KnexStorage010 } from 'fastify-idempotency-0.1.0/knex'
import idempotency, { idempotencyErrorHandler, type FingerprintOptions, type IdempotencyOptions } from '../lib/index.js'
import type { KnexStorage } from '../lib/knex.js'
import type { RedisStorage } from '../lib/redis.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { REDIS } from './helpers/services.js'
import { storeCases, type StorageClasses, type StoreCase } from './helpers/stores.js'

const cases = await storeCases()

/** The 0.1.0 plugin, typed as a plugin of this Fastify (its declarations augment Fastify's types too). */
const plugin010 = v010.default as unknown as typeof idempotency
const classes010 = { RedisStorage: RedisStorage010, KnexStorage: KnexStorage010 } as unknown as StorageClasses

interface Served {
  app: FastifyInstance
  url: string
  runs: () => number
  /** Resolves the handler of the request that is waiting in it (see `hold`). */
  release: () => void
  /** The handler is running and waits for `release`. */
  holding: Promise<void>
}

/**
 * An app served on a free port with guarded routes that answer 201 with the run number: POST
 * /orders (JSON; with `hold`, the handler waits for `release` before it answers), /forms
 * (@fastify/formbody), /selected (only /amount counts) and /tags (zod turns the tags into a Set).
 */
async function serve (register: typeof idempotency, options: IdempotencyOptions, hold = false): Promise<Served> {
  const app = Fastify()
  await app.register(register, options)
  app.setErrorHandler(idempotencyErrorHandler())
  let runs = 0
  let release = (): void => {}
  let entered = (): void => {}
  const holding = new Promise<void>((resolve) => { entered = resolve })
  const released = new Promise<void>((resolve) => { release = resolve })
  app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
    const run = ++runs
    if (hold) {
      entered()
      await released
    }
    reply.code(201).header('x-run', String(run))
    return { run, received: request.body }
  })
  await app.register(formbody)
  const counted = async (_request: unknown, reply: FastifyReply) => reply.code(201).send({ run: ++runs })
  app.post('/forms', { config: { idempotency: true } }, counted)
  app.post('/selected', { config: { idempotency: { fingerprint: { body: { include: ['/amount'] } } } } }, counted)
  await app.register(async (context) => {
    context.setValidatorCompiler(validatorCompiler)
    context.withTypeProvider<ZodTypeProvider>().post('/tags', {
      config: { idempotency: true },
      schema: { body: z.object({ tags: z.array(z.string()).transform((tags) => new Set(tags)) }) }
    }, counted)
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, url: `http://127.0.0.1:${(app.server.address() as { port: number }).port}`, runs: () => runs, release, holding }
}

interface Answer { status: number, body: Record<string, unknown>, replayed: string | null, retry: string | null }

async function post (target: Served, key: string, body: unknown, path = '/orders'): Promise<Answer> {
  const form = body instanceof URLSearchParams
  const res = await fetch(`${target.url}${path}`, {
    method: 'POST',
    headers: { 'idempotency-key': key, 'content-type': form ? 'application/x-www-form-urlencoded' : 'application/json' },
    body: form ? body : JSON.stringify(body)
  })
  return { status: res.status, body: await res.json() as Record<string, unknown>, replayed: res.headers.get('idempotent-replayed'), retry: res.headers.get('stripe-should-retry') }
}

const ADDED: FingerprintOptions = { method: true, path: true }

for (const store of cases) {
  describe.skipIf(!store.available)(`fingerprints and layouts across deployments and versions, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    /** The same store as 0.1.0 opens it. */
    let storage010: IdempotencyStorage
    const apps: Served[] = []
    const started = async (register: typeof idempotency, options: IdempotencyOptions, hold = false): Promise<Served> => {
      const served = await serve(register, options, hold)
      apps.push(served)
      return served
    }

    beforeAll(async () => {
      storage = await store.create()
      // In one process the in-memory store is one object, whichever version's plugin uses it.
      storage010 = store.sibling?.(classes010) ?? storage
    })
    afterAll(async () => {
      for (const served of apps) {
        served.release()
        await served.app.close()
      }
      await store.cleanup()
    })

    it('0.1.0 stored, then the upgraded app with method and path added replays the retry and refuses another body', async () => {
      const before = await started(plugin010, { storage: storage010 })
      const after = await started(idempotency, { storage, fingerprint: ADDED })
      const key = newKey('upgrade')
      const first = await post(before, key, { amount: 5, items: [{ sku: 'a' }] })
      expect(first.status).toBe(201)

      const retry = await post(after, key, { items: [{ sku: 'a' }], amount: 5 })
      expect(retry).toMatchObject({ status: 201, replayed: 'true', body: first.body })
      const other = await post(after, key, { amount: 6, items: [{ sku: 'a' }] })
      expect(other.status).toBe(409)
      expect(other.body.type).toMatch(/#fingerprint-mismatch$/)
      expect(other.retry).toBe('false')
      expect(after.runs()).toBe(0)
      // The entry is still the one 0.1.0 stored, and 0.1.0 still replays it.
      expect(await post(before, key, { amount: 5, items: [{ sku: 'a' }] })).toMatchObject({ status: 201, replayed: 'true', body: first.body })
    })

    it('a lease 0.1.0 holds: the upgraded app answers the same request 409 in progress, another body a mismatch', async () => {
      const before = await started(plugin010, { storage: storage010 }, true)
      const after = await started(idempotency, { storage, fingerprint: ADDED })
      const key = newKey('upgrade-lease')
      const first = post(before, key, { amount: 5 })
      await before.holding
      const duplicate = await post(after, key, { amount: 5 })
      expect(duplicate.status).toBe(409)
      expect(duplicate.body.type).toMatch(/#request-in-progress$/)
      const other = await post(after, key, { amount: 7 })
      expect(other.body.type).toMatch(/#fingerprint-mismatch$/)
      before.release()
      expect((await first).status).toBe(201)
      expect(await post(after, key, { amount: 5 })).toMatchObject({ status: 201, replayed: 'true' })
      expect(after.runs()).toBe(0)
    })

    it('0.1.0 stored a form and a selection of members: the upgraded app replays their retries and refuses other requests', async () => {
      const before = await started(plugin010, { storage: storage010 })
      const after = await started(idempotency, { storage })
      const form = newKey('upgrade-form')
      expect((await post(before, form, new URLSearchParams({ amount: '5', currency: 'eur' }), '/forms')).status).toBe(201)
      expect((await post(after, form, new URLSearchParams({ currency: 'eur', amount: '5' }), '/forms')).replayed).toBe('true')
      expect((await post(after, form, new URLSearchParams({ amount: '6', currency: 'eur' }), '/forms')).status).toBe(409)
      const selected = newKey('upgrade-selected')
      expect((await post(before, selected, { amount: 5, note: 'a' }, '/selected')).status).toBe(201)
      expect((await post(after, selected, { amount: 5, note: 'b' }, '/selected')).replayed).toBe('true')
      expect((await post(after, selected, { amount: 6, note: 'a' }, '/selected')).status).toBe(409)
      expect(after.runs()).toBe(0)
    })

    it('0.1.0 stored what its fingerprint could not tell apart (a Set a schema made, a selection that selected nothing): refused with 409 unreadable, never replayed', async () => {
      const before = await started(plugin010, { storage: storage010 })
      const after = await started(idempotency, { storage })
      for (const [path, body] of [['/tags', { tags: ['a'] }], ['/selected', [1]]] as Array<[string, unknown]>) {
        const key = newKey('upgrade-incomparable')
        expect((await post(before, key, body, path)).status).toBe(201)
        const answer = await post(after, key, body, path)
        expect(answer.status, path).toBe(409)
        expect(answer.body.type).toMatch(/#stored-response-unreadable$/)
      }
      expect(after.runs()).toBe(0)
    })

    for (const [from, to] of [[{}, ADDED], [ADDED, {}], [{ headers: ['x-tenant'] }, { body: { include: ['/amount'] }, query: true }]] as Array<[FingerprintOptions, FingerprintOptions]>) {
      it(`a deployment that changes the fingerprint from ${JSON.stringify(from)} to ${JSON.stringify(to)} replays the previous one's retries and refuses another body`, async () => {
        const before = await started(idempotency, { storage, fingerprint: from })
        const after = await started(idempotency, { storage, fingerprint: to })
        const key = newKey('deploy')
        const first = await post(before, key, { amount: 5, note: 'a' })
        expect(await post(after, key, { note: 'a', amount: 5 })).toMatchObject({ status: 201, replayed: 'true', body: first.body })
        // Different under the options the entry was made with, though alike under the new ones.
        const other = await post(after, key, { amount: 5, note: 'b' })
        expect(other.status).toBe(409)
        expect(other.body.type).toMatch(/#fingerprint-mismatch$/)
        expect(after.runs()).toBe(0)
      })
    }

    it('a key reused on another route, whose options differ, is refused: the entry is another operation\'s', async () => {
      const app = await started(idempotency, { storage })
      const key = newKey('across-routes')
      expect((await post(app, key, { amount: 5 }, '/orders')).status).toBe(201)
      const other = await post(app, key, { amount: 5 }, '/selected')
      expect(other.status).toBe(409)
      expect(other.body.type).toMatch(/#fingerprint-mismatch$/)
    })

    it('a lease taken before a deployment that changed the options: the same request is in progress, another body a mismatch', async () => {
      const before = await started(idempotency, { storage }, true)
      const after = await started(idempotency, { storage, fingerprint: ADDED })
      const key = newKey('deploy-lease')
      const first = post(before, key, { amount: 5 })
      await before.holding
      expect((await post(after, key, { amount: 5 })).body.type).toMatch(/#request-in-progress$/)
      expect((await post(after, key, { amount: 6 })).body.type).toMatch(/#fingerprint-mismatch$/)
      before.release()
      expect((await first).status).toBe(201)
      expect(after.runs()).toBe(0)
    })

    it('an entry whose fingerprint is of a version this release does not know is refused with 409, and kept', async () => {
      const app = await started(idempotency, { storage })
      const key = newKey('future')
      const fingerprint = `3.{"future":true}.${'A'.repeat(43)}`
      const begun = await storage.begin(key, fingerprint, 60_000)
      if (begun.state !== 'acquired') throw new Error('the key was not free')
      const response = { statusCode: 201, contentType: 'application/json', headers: {}, body: Buffer.from('{"run":"from a later version"}') }
      expect(await storage.complete(key, begun.token, response, 60_000)).toBe(true)

      for (let attempt = 0; attempt < 2; attempt++) {
        const answer = await post(app, key, { amount: 5 })
        expect(answer.status).toBe(409)
        expect(answer.body.type).toMatch(/#stored-response-unreadable$/)
        expect(answer.retry).toBe('false')
      }
      expect(app.runs()).toBe(0)
      const kept = await storage.begin(key, fingerprint, 60_000)
      expect(kept).toMatchObject({ state: 'completed', fingerprint, response: { statusCode: 201 } })
      expect(kept.state === 'completed' && kept.response.body.toString()).toBe('{"run":"from a later version"}')
    })

    it.skipIf(store.name === 'memory')('a stored value in a layout this release cannot read (a later one, or damaged) is refused with 409 even with failOpen, the handler not run, and left as it is', async () => {
      const served = await started(idempotency, { storage, failOpen: true })
      for (const variant of [0, 1]) {
        const key = newKey('layout')
        await putUnreadableValue(store, storage, key, served, variant)
        const dump = async () => (await store.dump!()).split('\n').sort()
        const before = await dump()
        const runs = served.runs()
        const answer = await post(served, key, { amount: 5 })
        expect(answer.status, `variant ${variant}`).toBe(409)
        expect(answer.body.type).toMatch(/#stored-response-unreadable$/)
        expect(answer.retry).toBe('false')
        expect(served.runs()).toBe(runs)
        expect(await dump()).toEqual(before)
      }
    })
  })
}

/**
 * Puts under `key` a value this release's layout cannot read: on Redis, a value whose first byte
 * names a later layout (variant 0) or an entry whose head does not parse (1); in a table, a row
 * whose headers do not parse (0) or are not an object (1).
 */
async function putUnreadableValue (store: StoreCase, storage: IdempotencyStorage, key: string, served: Served, variant: number): Promise<void> {
  if (store.name === 'redis') {
    const client = new Redis({ host: REDIS.host, port: REDIS.port })
    await client.set((storage as RedisStorage).redisKey(key), ['D7|2.{}.a later layout', 'C3|abc9|[201,"a"'][variant]!, 'PX', 60_000)
    await client.quit()
    return
  }
  expect((await post(served, key, { amount: 5 })).status).toBe(201)
  await store.knex!()((storage as KnexStorage).tableName).where('idempotency_key', Buffer.from(key)).update({ headers: ['<not json>', '[1]'][variant] })
}
