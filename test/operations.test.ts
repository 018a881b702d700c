/**
 * `fastify.idempotency`: inspect, forget and inFlight, over real HTTP on every store, with and
 * without encryption. An operator types what the client sent (its key, its tenant) and sees what
 * the store holds; a forgotten key runs afresh, recovery points included; one tenant's forget
 * leaves another's entry; a key in flight is listed while held, and refused to forget unless
 * forced. Every call is audited on its diagnostics channel and in the app's log.
 */
import { randomBytes } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import { Writable } from 'node:stream'
import { setTimeout as sleep } from 'node:timers/promises'
import { describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, {
  IdempotencyKeyInvalidError,
  IdempotencyOperationNotSupportedError,
  idempotencyErrorHandler,
  MemoryStorage,
  type IdempotencyOperationEvent,
  type IdempotencyStorage
} from '../lib/index.js'
import { ResponseCipher } from '../lib/encryption.js'
import { storageKey } from '../lib/engine/storage-key.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'
import { postWithKey } from './helpers/http-client.js'

const ENCRYPTION = { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) }
const EXPIRATION = 3_600_000

/** A gate a held request waits at, and the signal that it got there. */
class Gates {
  readonly #entered = new Map<string, () => void>()
  readonly #arrived = new Map<string, Promise<void>>()
  readonly #open = new Map<string, () => void>()

  arrived (key: string): Promise<void> {
    let promise = this.#arrived.get(key)
    if (promise === undefined) {
      promise = new Promise((resolve) => this.#entered.set(key, resolve))
      this.#arrived.set(key, promise)
    }
    return promise
  }

  async wait (key: string): Promise<void> {
    void this.arrived(key)
    const opened = new Promise<void>((resolve) => this.#open.set(key, resolve))
    this.#entered.get(key)!()
    await opened
  }

  open (key: string): void {
    this.#open.get(key)!()
  }
}

for (const encrypted of [false, true]) {
  const cases = await storeCases()
  for (const store of cases) {
    describe.skipIf(!store.available)(`operations on ${store.name}${encrypted ? ' with encryption' : ''}${store.reason}`, () => {
      let app: FastifyInstance
      let storage: IdempotencyStorage
      const gates = new Gates()
      const runs = new Map<string, number>()
      const charges = new Map<string, number>()
      const log: string[] = []
      let ordersDown = true
      let unique = 0
      const fresh = (label: string) => `${label}-${process.pid}-${++unique}`
      const cipher = encrypted ? new ResponseCipher(ENCRYPTION) : null
      /** What a request's key and scope become in the store: with encryption, the only way to find them in a listing. */
      const storageKeyFor = (key: string, scope: string | null = null) => storageKey(key, scope, cipher)

      const served = servedOn(store, async (created) => {
        storage = created
        const stream = new Writable({ write (chunk: Buffer, _encoding, done) { log.push(chunk.toString()); done() } })
        app = Fastify({ logger: { level: 'info', stream } })
        await app.register(idempotency, { storage, expiration: EXPIRATION, fingerprint: { method: true, path: true }, ...(encrypted ? { encryption: ENCRYPTION } : {}) })
        app.setErrorHandler(idempotencyErrorHandler())
        const handler = async (request: { headers: Record<string, unknown>, body: unknown }, key: string) => {
          runs.set(key, (runs.get(key) ?? 0) + 1)
          if (request.headers['x-hold'] === '1') await gates.wait(key)
          return { key, run: runs.get(key), tenant: request.headers['x-tenant'] ?? null }
        }
        app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
          reply.code(201)
          return await handler(request, request.idempotency!.key)
        })
        app.post('/tenants/orders', { config: { idempotency: { scope: (request) => String(request.headers['x-tenant']) } } }, async (request, reply) => {
          reply.code(201)
          return await handler(request, `${String(request.headers['x-tenant'])}/${request.idempotency!.key}`)
        })
        app.post('/checkout', { config: { idempotency: true } }, async (request) => {
          const key = request.idempotency!.key
          const charge = await request.idempotency!.step('charge', () => {
            charges.set(key, (charges.get(key) ?? 0) + 1)
            return { id: `ch_${charges.get(key)}` }
          })
          if (ordersDown) throw new Error('the orders database is down')
          return { charge: charge.id }
        })
        return { app }
      })

      const post = (path: string, key: string, headers: Record<string, string> = {}) => postWithKey(`${served.url}${path}`, key, '{"sku":"A1"}', headers)

      it('tells a key absent, in flight and stored apart, and shows the body only when asked', async () => {
        const key = fresh('order')
        expect(await app.idempotency.inspect(key)).toEqual({ key, scope: null, state: 'absent' })
        const before = Date.now()
        const pending = post('/orders', key, { 'x-hold': '1' })
        await gates.arrived(key)
        const held = await app.idempotency.inspect(key)
        // Opened whatever the checks say: a handler left waiting would hold the app's close, and
        // the file would hang instead of failing.
        try {
          expect(held).toMatchObject({ key, scope: null, state: 'in-flight', fingerprintOptions: { method: true, path: true } })
          if (held.state !== 'in-flight') throw new Error('expected in flight')
          expect(held.since).toBeGreaterThanOrEqual(before - 1000)
          expect(held.since).toBeLessThanOrEqual(Date.now() + 1000)
          expect(held.lockExpiresAt).toBeGreaterThan(Date.now())
          expect(held.fingerprint).toMatch(/^3\.[\w-]{8}\.\{.*\}\.[\w-]{43}$/)
        } finally {
          gates.open(key)
        }
        const first = await pending
        expect(first.status).toBe(201)
        const stored = await app.idempotency.inspect(`"${key}"`)
        expect(stored).toMatchObject({
          key,
          state: 'stored',
          statusCode: 201,
          contentType: 'application/json; charset=utf-8',
          bodyBytes: Buffer.byteLength(first.body),
          bodyOmitted: false,
          fingerprint: held.fingerprint
        })
        if (stored.state !== 'stored') throw new Error('expected stored')
        expect(stored).not.toHaveProperty('body')
        expect(stored.storedAt).toBeGreaterThanOrEqual(before - 1000)
        expect(stored.expiresAt - stored.storedAt!).toBeGreaterThan(EXPIRATION - 2000)
        expect(stored.expiresAt - stored.storedAt!).toBeLessThan(EXPIRATION + 2000)
        const withBody = await app.idempotency.inspect(key, { body: true })
        expect(withBody.state === 'stored' && withBody.body?.toString()).toBe(first.body)
      })

      it('forgets a stored key, so that the retry runs afresh', async () => {
        const key = fresh('redo')
        expect((await post('/orders', key)).status).toBe(201)
        expect((await post('/orders', key)).replayed).toBe(true)
        expect(runs.get(key)).toBe(1)
        expect(await app.idempotency.forget(key, { actor: 'alice' })).toEqual({ key, scope: null, outcome: 'forgotten', previous: 'stored', recoveryPoints: 0 })
        const retry = await post('/orders', key)
        expect(retry.replayed).toBe(false)
        expect(JSON.parse(retry.body).run).toBe(2)
        expect(await app.idempotency.forget(fresh('never'))).toMatchObject({ outcome: 'forgotten', previous: 'absent', recoveryPoints: 0 })
      })

      it('forgets the records of recovery points with the key, so that its steps run again', async () => {
        const key = fresh('checkout')
        ordersDown = true
        expect((await post('/checkout', key)).status).toBe(500)
        expect((await post('/checkout', key)).status).toBe(500)
        // The retry found the charge recorded: it did not charge again.
        expect(charges.get(key)).toBe(1)
        expect(await app.idempotency.inspect(key)).toMatchObject({ state: 'absent' })
        expect(await app.idempotency.forget(key)).toMatchObject({ outcome: 'forgotten', previous: 'absent', recoveryPoints: 1 })
        ordersDown = false
        const redo = await post('/checkout', key)
        expect(redo.status).toBe(200)
        expect(JSON.parse(redo.body)).toEqual({ charge: 'ch_2' })
        expect(charges.get(key)).toBe(2)
      })

      it('forgets one scope\'s entry and leaves another\'s, composing the scope as requests do', async () => {
        const key = fresh('shared')
        for (const tenant of ['acme', 'globex']) expect((await post('/tenants/orders', key, { 'x-tenant': tenant })).status).toBe(201)
        expect(await app.idempotency.inspect(key)).toMatchObject({ state: 'absent' })
        expect(await app.idempotency.forget(key)).toMatchObject({ previous: 'absent' })
        expect(await app.idempotency.inspect(key, { scope: 'globex' })).toMatchObject({ state: 'stored', scope: 'globex' })
        expect(await app.idempotency.forget(key, { scope: 'acme' })).toMatchObject({ scope: 'acme', previous: 'stored' })
        const acme = await post('/tenants/orders', key, { 'x-tenant': 'acme' })
        const globex = await post('/tenants/orders', key, { 'x-tenant': 'globex' })
        expect([acme.replayed, JSON.parse(acme.body).run]).toEqual([false, 2])
        expect([globex.replayed, JSON.parse(globex.body).run]).toEqual([true, 1])
      })

      it('lists a held key in flight, oldest first, and drops it once its response is stored', async () => {
        const older = fresh('held-older')
        const key = fresh('held')
        const pendingOlder = post('/tenants/orders', older, { 'x-hold': '1', 'x-tenant': 'acme' })
        await gates.arrived(`acme/${older}`)
        // Leases are dated to the millisecond: two taken within one are equally old, in either order.
        await sleep(5)
        const pending = post('/orders', key, { 'x-hold': '1' })
        await gates.arrived(key)
        const listing = await app.idempotency.inFlight()
        expect(listing.complete).toBe(true)
        const mine = [storageKeyFor(older, 'acme'), storageKeyFor(key)]
        const ours = listing.leases.filter((lease) => mine.includes(lease.storageKey))
        expect(ours).toHaveLength(2)
        const [first, second] = ours
        if (encrypted) {
          expect(first).toMatchObject({ key: null, scope: null })
          expect(first!.storageKey.startsWith('\u0000hmac:')).toBe(true)
        } else {
          expect(first).toMatchObject({ key: older, scope: 'acme' })
          expect(second).toMatchObject({ key, scope: null })
        }
        expect(first!.since!).toBeLessThanOrEqual(second!.since!)
        expect(second!.heldMs).toBeGreaterThanOrEqual(0)
        expect((await app.idempotency.inFlight({ olderThan: '1h' })).leases).toHaveLength(0)
        for (const all of [0, '0s']) expect((await app.idempotency.inFlight({ olderThan: all })).leases.filter((lease) => mine.includes(lease.storageKey)), String(all)).toHaveLength(2)
        expect((await app.idempotency.inFlight({ limit: 1 })).leases).toHaveLength(1)
        gates.open(key)
        gates.open(`acme/${older}`)
        await Promise.all([pending, pendingOlder])
        const after = await app.idempotency.inFlight()
        expect(after.leases.filter((lease) => ours.some((held) => held.storageKey === lease.storageKey))).toHaveLength(0)
      })

      it('refuses to forget a key in flight unless forced; forced, the running request stores nothing and the retry runs', async () => {
        const key = fresh('running')
        const pending = post('/orders', key, { 'x-hold': '1' })
        await gates.arrived(key)
        const refused = await app.idempotency.forget(key)
        expect(refused).toMatchObject({ outcome: 'refused', key })
        expect(await app.idempotency.inspect(key)).toMatchObject({ state: 'in-flight' })
        expect(await app.idempotency.forget(key, { force: true })).toMatchObject({ outcome: 'forgotten', previous: 'in-flight' })
        gates.open(key)
        expect((await pending).status).toBe(201)
        expect(await app.idempotency.inspect(key)).toMatchObject({ state: 'absent' })
        const retry = await post('/orders', key)
        expect([retry.replayed, JSON.parse(retry.body).run]).toEqual([false, 2])
      })

      it('audits every call, on its channel and in the log, failures included', async () => {
        const events: IdempotencyOperationEvent[] = []
        const listener = (message: unknown) => { events.push(message as IdempotencyOperationEvent) }
        diagnostics.subscribe('fastify-idempotency:operation:forget', listener)
        diagnostics.subscribe('fastify-idempotency:operation:inspect', listener)
        try {
          const key = fresh('audited')
          await post('/orders', key)
          await app.idempotency.forget(key, { scope: null, actor: 'support:alice' })
          await expect(app.idempotency.inspect('not a key', { actor: 'support:bob' })).rejects.toThrow(IdempotencyKeyInvalidError)
          expect(events).toHaveLength(2)
          expect(events[0]).toMatchObject({ operation: 'forget', via: 'app', actor: 'support:alice', idempotencyKey: key, scope: null, outcome: 'forgotten', previous: 'stored', force: false, store: storage.constructor.name })
          expect(events[1]).toMatchObject({ operation: 'inspect', actor: 'support:bob', idempotencyKey: 'not a key' })
          expect(events[1]!.error).toBeInstanceOf(IdempotencyKeyInvalidError)
          const lines = log.map((line) => JSON.parse(line) as { level: number, msg: string, idempotencyOperation?: { actor: string } })
          expect(lines.find((line) => line.msg.startsWith(`idempotency forget of key "${key}" by support:alice: forgotten`))).toMatchObject({ level: 30 })
          expect(lines.find((line) => line.idempotencyOperation?.actor === 'support:bob')).toMatchObject({ level: 50 })
        } finally {
          diagnostics.unsubscribe('fastify-idempotency:operation:forget', listener)
          diagnostics.unsubscribe('fastify-idempotency:operation:inspect', listener)
        }
      })

      it('refuses a key no client could send, and touches nothing', async () => {
        const before = await store.dump?.()
        for (const bad of ['', 'two words', 'x'.repeat(256), 'caf\u00e9', '"unterminated']) {
          await expect(app.idempotency.inspect(bad)).rejects.toThrow(IdempotencyKeyInvalidError)
          await expect(app.idempotency.forget(bad, { force: true })).rejects.toThrow(IdempotencyKeyInvalidError)
        }
        await expect(app.idempotency.inFlight({ olderThan: 'soon' })).rejects.toThrow(/olderThan/)
        await expect(app.idempotency.inFlight({ olderThan: -1 })).rejects.toThrow(/olderThan must be a non-negative number/)
        await expect(app.idempotency.inFlight({ limit: 0 })).rejects.toThrow(/limit/)
        expect(await store.dump?.()).toEqual(before)
      })
    })
  }
}

for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`a forced forget on ${store.name}${store.reason}`, () => {
    it('wakes the request that waits for the key (wait: true), which then runs at once', async () => {
      const inner = await store.create()
      let duplicateWaits: () => void = () => {}
      const waiting = new Promise<void>((resolve) => { duplicateWaits = resolve })
      // The store, telling when the duplicate waits: in waitFor where the store has it (it then
      // only wakes when told), or polling begin where it has none.
      const waitFor = inner.waitFor?.bind(inner)
      const storage: IdempotencyStorage = {
        begin: async (key, fingerprint, lockTimeout) => {
          const result = await inner.begin(key, fingerprint, lockTimeout)
          if (result.state === 'in-flight' && waitFor === undefined) duplicateWaits()
          return result
        },
        complete: inner.complete.bind(inner),
        release: inner.release.bind(inner),
        renew: inner.renew.bind(inner),
        ...(waitFor === undefined
          ? {}
          : {
              waitFor: async (key: string, timeout: number) => {
                const waited = waitFor(key, timeout)
                duplicateWaits()
                await waited
              }
            }),
        forget: inner.forget!.bind(inner),
        inspect: inner.inspect!.bind(inner)
      }
      const app = Fastify()
      await app.register(idempotency, { storage, wait: true, waitTimeout: 30_000 })
      const gates = new Gates()
      let runs = 0
      app.post('/orders', { config: { idempotency: true } }, async (request) => {
        const run = ++runs
        if (run === 1) await gates.wait('first')
        return { run }
      })
      try {
        const url = await app.listen({ host: '127.0.0.1', port: 0 })
        const post = async () => await fetch(`${url}/orders`, { method: 'POST', headers: { 'idempotency-key': 'stuck', 'content-type': 'application/json' }, body: '{}' })
        const first = post()
        await gates.arrived('first')
        const duplicate = post()
        await waiting
        // Redis and PostgreSQL mark the lease once the waiter listens; from then on its end must wake it.
        if (waitFor !== undefined && store.dump !== undefined) await expect.poll(async () => /waiting=true|= L.{36}W/.test(await store.dump!())).toBe(true)
        const forgotten = performance.now()
        expect(await app.idempotency.forget('stuck', { force: true })).toMatchObject({ outcome: 'forgotten', previous: 'in-flight' })
        const answer = await duplicate
        // Well before its lease (60 s), its wait (30 s), or a store call (storeTimeout, 5 s) would have ended.
        expect(performance.now() - forgotten).toBeLessThan(2000)
        expect(await answer.json()).toEqual({ run: 2 })
        gates.open('first')
        expect(await (await first).json()).toEqual({ run: 1 })
        expect((await app.idempotency.inspect('stuck', { body: true }))).toMatchObject({ state: 'stored', body: Buffer.from('{"run":2}') })
      } finally {
        await app.close()
        await store.cleanup()
      }
    })
  })
}

describe('operations on a store without them', () => {
  it('says the operation is not supported, and requests are served as before', async () => {
    const inner = new MemoryStorage()
    const bare: IdempotencyStorage = {
      begin: async (...args) => await inner.begin(...args),
      complete: async (...args) => await inner.complete(...args),
      release: async (...args) => await inner.release(...args),
      renew: async (...args) => await inner.renew(...args)
    }
    const app = Fastify()
    await app.register(idempotency, { storage: bare })
    app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
    const res = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'k' } })
    expect(res.statusCode).toBe(200)
    await expect(app.idempotency.inspect('k')).rejects.toThrow(IdempotencyOperationNotSupportedError)
    await expect(app.idempotency.forget('k')).rejects.toThrow(/does not support forget \(it has no forget method\)/)
    await expect(app.idempotency.inFlight()).rejects.toThrow(/listInFlight/)
    await expect(app.idempotency.purge()).rejects.toThrow(/purgeExpired/)
    await app.close()
  })
})
