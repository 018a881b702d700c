/**
 * Leases granted by answers that come late, on every store, over real HTTP: the answer of `begin`
 * is held back after the store granted the lease (a slow network, a paused process, a store that
 * measured the lease before a wait), so the plugin sees it only after the lease has lapsed, or
 * after it gave up on the call (storeTimeout). No handler may run under a lapsed lease, and no
 * lease granted to a call given up on may stay behind.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type BeginResult, type IdempotencyStorage } from '../lib/index.js'
import { storeCases } from './helpers/stores.js'
import { newKey, withMethods } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'

const LEASE = 400
const STORE_TIMEOUT = 300
const STEP_PREFIX = '\u0000step:'

interface HeldAnswer {
  /** The store's answer, as soon as it has it. */
  granted: Promise<BeginResult>
  /** Let the answer reach the plugin. */
  deliver: () => void
}

for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`a lease granted by a late answer on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    const apps: FastifyInstance[] = []
    const runs = new Map<string, number>()
    /** The next `begin` whose key starts with a prefix here has its answer held back. */
    const holds = new Map<string, (result: BeginResult) => Promise<void>>()
    const stepReleases: boolean[] = []
    /** Store calls and handler runs, in order. */
    const calls: string[] = []

    beforeAll(async () => {
      const inner = await store.create()
      storage = withMethods(inner, {
        begin: async (key: string, fingerprint: string, lockTimeout: number) => {
          const result = await inner.begin(key, fingerprint, lockTimeout)
          const prefix = [...holds.keys()].find((held) => key.startsWith(held))
          if (prefix !== undefined) {
            const hold = holds.get(prefix)!
            holds.delete(prefix)
            await hold(result)
          }
          return result
        },
        release: async (key: string, token: string) => {
          const released = await inner.release(key, token)
          if (key.startsWith(STEP_PREFIX)) stepReleases.push(released)
          return released
        },
        renew: async (key: string, token: string, lockTimeout: number) => {
          const renewed = await inner.renew(key, token, lockTimeout)
          calls.push(`renew ${key} ${String(renewed)}`)
          return renewed
        }
      })
    })
    afterAll(async () => {
      for (const app of apps) await app.close()
      await store.cleanup()
    })

    function holdAnswer (prefix: string): HeldAnswer {
      let deliver!: () => void
      const delivered = new Promise<void>((resolve) => { deliver = resolve })
      const granted = new Promise<BeginResult>((resolve) => {
        holds.set(prefix, async (result) => { resolve(result); await delivered })
      })
      return { granted, deliver }
    }

    async function start (options: { storeTimeout?: number, lockTimeout?: number } = {}): Promise<(key: string) => Promise<{ status: number, headers: Headers, body: string }>> {
      const app = Fastify()
      await app.register(idempotency, { storage, lockTimeout: LEASE, ...options })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/charges', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.idempotency!.key
        const charge = await request.idempotency!.step('charge', () => {
          calls.push(`run ${key}`)
          runs.set(key, (runs.get(key) ?? 0) + 1)
          return { charged: runs.get(key) }
        })
        reply.code(201)
        return charge
      })
      apps.push(app)
      const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/charges`
      return async (key) => await postWithKey(url, key, '{"amount":1}')
    }

    it('runs no handler under a lease that lapsed before its answer came: that request gets 503, the duplicate that took the key runs alone', async () => {
      const post = await start()
      const key = newKey('late')
      const answer = holdAnswer(key)
      const first = post(key)
      expect((await answer.granted).state).toBe('acquired')
      // While the answer is held back the lease lapses, and a duplicate takes the key and runs.
      await vi.waitFor(async () => { expect((await post(key)).status).toBe(201) }, { timeout: 5000, interval: 50 })
      answer.deliver()
      const late = await first
      expect(late.status).toBe(503)
      expect(late.headers.get('content-type')).toMatch(/^application\/problem\+json/)
      expect(runs.get(key)).toBe(1)
      const retry = await post(key)
      expect(retry.status).toBe(201)
      expect(retry.headers.get('idempotent-replayed')).toBe('true')
      expect(runs.get(key)).toBe(1)
    })

    it('renews a lease whose answer came late but in time before the handler runs under it', async () => {
      const post = await start()
      const key = newKey('slow')
      const answer = holdAnswer(key)
      const first = post(key)
      await answer.granted
      // Longer than lockTimeout / 8, shorter than the lease: a slow store, not a lost lease.
      await sleep(LEASE / 4)
      answer.deliver()
      expect((await first).status).toBe(201)
      const mine = calls.filter((call) => call === `run ${key}` || call.startsWith(`renew ${key} `))
      // Renewed before it ran (the route's renewal may renew it again later).
      expect(mine[0]).toBe(`renew ${key} true`)
      expect(mine.filter((call) => call.startsWith('run'))).toEqual([`run ${key}`])
    })

    // MemoryStorage answers from memory and is never given up on.
    it.skipIf(store.name === 'memory')('gives back the lease of a recovery point granted after storeTimeout: the retry runs the step at once', async () => {
      // A lease far longer than the test: kept, it would hold the step until the test times out.
      const post = await start({ storeTimeout: STORE_TIMEOUT, lockTimeout: 60_000 })
      const key = newKey('step')
      const answer = holdAnswer(STEP_PREFIX)
      const first = await post(key)
      expect(first.status).toBe(503)
      expect((await answer.granted).state).toBe('acquired')
      stepReleases.length = 0
      answer.deliver()
      await vi.waitFor(() => { expect(stepReleases).toEqual([true]) }, { timeout: 5000, interval: 10 })
      const retry = await post(key)
      expect(retry.status).toBe(201)
      expect(runs.get(key)).toBe(1)
    })
  })
}

describe('a lease whose late answer cannot be confirmed', () => {
  /** MemoryStorage behind a store of its own (so storeTimeout applies), with a slow begin and a failing renew. */
  function slowStore (renew: () => Promise<boolean>) {
    const inner = new MemoryStorage()
    const released: string[] = []
    const storage: IdempotencyStorage = {
      begin: async (key, fingerprint, lockTimeout) => {
        const result = await inner.begin(key, fingerprint, lockTimeout)
        await sleep(LEASE / 4)
        return result
      },
      complete: (key, token, response, expiration) => inner.complete(key, token, response, expiration),
      release: async (key, token) => {
        released.push(token)
        return await inner.release(key, token)
      },
      renew
    }
    return { storage, released }
  }

  async function appWith (storage: IdempotencyStorage) {
    const app = Fastify()
    await app.register(idempotency, { storage, lockTimeout: LEASE, storeTimeout: STORE_TIMEOUT })
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs }))
    await app.ready()
    const post = () => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': newKey() }, payload: {} })
    return { app, post, runs: () => runs }
  }

  it('answers 503 and gives the lease back when the renewal fails', async () => {
    const { storage, released } = slowStore(async () => { throw new Error('connection reset') })
    const t = await appWith(storage)
    const res = await t.post()
    expect(res.statusCode).toBe(503)
    expect(t.runs()).toBe(0)
    await vi.waitFor(() => { expect(released).toHaveLength(1) })
    await t.app.close()
  })

  it('answers 503 and gives the lease back when the renewal outlasts storeTimeout', async () => {
    let answer!: (held: boolean) => void
    const { storage, released } = slowStore(() => new Promise((resolve) => { answer = resolve }))
    const t = await appWith(storage)
    const res = await t.post()
    expect(res.statusCode).toBe(503)
    expect(res.json().type).toMatch(/#store-unavailable$/)
    await vi.waitFor(() => { expect(released).toHaveLength(1) })
    answer(true)
    expect(t.runs()).toBe(0)
    await t.app.close()
  })
})
