/**
 * What a consumer does when `run` throws: `retryDecision` classifies every error `run` can throw,
 * each produced here by a real `run` on each store's real server: retry after the holder's lease
 * ends (so a consumer waiting out a dead holder comes back once), release, done, give up, or the
 * attempt's own failure (the work's errors, whatever their class). Beside it, what jobs need of
 * `run` itself: a lease that lives as long as the function runs, a result not kept that throws,
 * keys apart from requests' unless shared, and unknown options refused by name.
 */
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify from 'fastify'
import idempotency, * as plugin from '../lib/index.js'
import * as standalone from '../lib/standalone.js'
import { createIdempotency, retryDecision, runScope, type RetryDecision, type StandaloneIdempotency, type StandaloneOptions } from '../lib/standalone.js'
import { storageKey } from '../lib/engine/storage-key.js'
import { inputFingerprint } from '../lib/run/input-fingerprint.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import { KnexStorage } from '../lib/knex.js'
import { newKey, withMethods } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { postWithKey } from './helpers/http-client.js'
import { storeCases } from './helpers/stores.js'
import { pgConnection } from './helpers/services.js'

const cases = await storeCases()
const silent = { debug: () => {}, info: () => {}, warn: () => {}, error: () => {} }
/** The lease of these tests: a holder that stops renewing lets the key go after it. */
const LOCK_TIMEOUT = 600

/** What `retryDecision` says of what `call` throws (a failure when it does not throw). */
async function decisionOf (call: Promise<unknown>): Promise<RetryDecision> {
  try {
    await call
  } catch (error) {
    return retryDecision(error)
  }
  throw new Error('run did not throw')
}

for (const store of cases) {
  describe.skipIf(!store.available)(`retryDecision of what run() throws on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    const opened: StandaloneIdempotency[] = []
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => {
      for (const idem of opened) await idem.close()
      await store.cleanup()
    })
    const open = (options: StandaloneOptions = {}): StandaloneIdempotency => {
      const idem = createIdempotency({ storage, logger: silent, lockTimeout: LOCK_TIMEOUT, ...options })
      opened.push(idem)
      return idem
    }

    it('a key whose holder died: retry once its lease has ended, and the next attempt runs the work', async () => {
      const idem = open()
      const key = newKey('dead')
      const input = { orderId: 1 }
      // What a consumer killed mid-job leaves: a lease nobody renews.
      // Read before begin: the lease ends LOCK_TIMEOUT after a moment between this and begin's answer.
      const takenAt = Date.now()
      const taken = await storage.begin(storageKey(key, runScope(null)), inputFingerprint(key, input), LOCK_TIMEOUT)
      expect(taken.state).toBe('acquired')
      let runs = 0
      const work = async () => ++runs
      const decision = await decisionOf(idem.run(key, input, work))
      expect(decision).toMatchObject({ kind: 'retry', reason: 'in-progress' })
      const { delayMs, error } = decision as Extract<RetryDecision, { kind: 'retry' }>
      const leaseEndsInMs = (error as plugin.IdempotencyRequestInProgressError).leaseEndsInMs
      // The rest of the dead holder's lease, not the 1 s a request's client is told to come back after.
      expect(leaseEndsInMs).toBeLessThanOrEqual(LOCK_TIMEOUT)
      expect(leaseEndsInMs).toBeGreaterThan(LOCK_TIMEOUT - (Date.now() - takenAt) - 200)
      expect(delayMs).toBeGreaterThan(leaseEndsInMs)
      // Coming back after it: the work runs (a store whose clock lags this one's may still hold the
      // lease for a moment, and cost one more return, never more).
      let returns = 1
      for (;;) {
        await sleep(delayMs)
        try {
          expect(await idem.run(key, input, work)).toBe(1)
          break
        } catch (error) {
          expect(retryDecision(error)).toMatchObject({ kind: 'retry', reason: 'in-progress' })
          expect(++returns).toBeLessThanOrEqual(2)
        }
      }
      expect(runs).toBe(1)
    })

    it('a key whose holder lives: retry when its lease would end, and by then a duplicate gets its result', async () => {
      const idem = open()
      const key = newKey('live')
      const gate = new Gate()
      const first = idem.run(key, {}, async () => { await gate.hold(); return 'kept' })
      await gate.entered
      const decision = await decisionOf(idem.run(key, {}, async () => 'again'))
      expect(decision).toMatchObject({ kind: 'retry', reason: 'in-progress' })
      expect((decision as { delayMs: number }).delayMs).toBeGreaterThan(LOCK_TIMEOUT / 2)
      gate.open()
      expect(await first).toBe('kept')
      expect(await idem.run(key, {}, async () => 'again')).toBe('kept')
    })

    it('another input under the key, an unusable key, an input with no canonical form (a WeakMap) or nested too deeply: give up', async () => {
      const idem = open()
      const key = newKey('poison')
      await idem.run(key, { amount: 1 }, async () => 'one')
      expect(await decisionOf(idem.run(key, { amount: 2 }, async () => 'two'))).toMatchObject({ kind: 'give-up', reason: 'fingerprint-mismatch' })
      expect(await decisionOf(idem.run('bad\nkey', {}, async () => 0))).toMatchObject({ kind: 'give-up', reason: 'key-invalid' })
      expect(await decisionOf(idem.run(newKey('weakmap'), { cache: new WeakMap() }, async () => 0))).toMatchObject({ kind: 'give-up', reason: 'input-unusable' })
      let deep: unknown = 1
      for (let i = 0; i < 1100; i++) deep = [deep]
      const nested = await decisionOf(idem.run(newKey('deep'), deep, async () => 0))
      expect(nested).toMatchObject({ kind: 'give-up', reason: 'input-unusable' })
      expect((nested as { error: unknown }).error).toBeInstanceOf(standalone.IdempotencyFingerprintError)
    })

    it('the work\'s own errors are the attempt\'s failure, whatever their class: a SyntaxError, an IdempotencyError of a nested run', async () => {
      const idem = open()
      const parsed = await decisionOf(idem.run(newKey('html'), {}, async () => JSON.parse('<html>502 Bad Gateway</html>') as unknown))
      expect(parsed).toMatchObject({ kind: 'failed' })
      expect((parsed as { error: unknown }).error).toBeInstanceOf(SyntaxError)
      const inner = newKey('inner')
      await idem.run(inner, { a: 1 }, async () => 1)
      const nested = await decisionOf(idem.run(newKey('outer'), {}, async () => await idem.run(inner, { a: 2 }, async () => 2)))
      expect(nested).toMatchObject({ kind: 'failed' })
      expect((nested as { error: unknown }).error).toBeInstanceOf(standalone.IdempotencyFingerprintMismatchError)
      // The key is free again: the next attempt runs the work.
      const key = newKey('again')
      expect((await decisionOf(idem.run(key, {}, async () => { throw new Error('down') }))).kind).toBe('failed')
      expect(await idem.run(key, {}, async () => 'ran')).toBe('ran')
    })

    it('a result that could not be kept, met again: done', async () => {
      const idem = open()
      const key = newKey('lost')
      class Receipt { constructor (readonly id: string) {} }
      await idem.run(key, {}, async () => new Receipt('r_1'))
      expect(await decisionOf(idem.run(key, {}, async () => new Receipt('r_2')))).toMatchObject({ kind: 'done', reason: 'result-not-recorded' })
    })

    it('a job that holds its key past an explicit maxLockHold: run throws (done) instead of returning as if its result were kept', async () => {
      const idem = open({ maxLockHold: LOCK_TIMEOUT })
      const key = newKey('long')
      const gate = new Gate()
      let runs = 0
      const first = idem.run(key, {}, async () => { ++runs; await gate.hold(); return 'first' })
      await gate.entered
      // Renewal stops at maxLockHold; the lease lapses a lockTimeout later, and a redelivery runs it.
      let second: unknown
      for (;;) {
        try {
          second = await idem.run(key, {}, async () => { ++runs; return 'second' })
          break
        } catch (error) {
          const decision = retryDecision(error)
          expect(decision.kind).toBe('retry')
          await sleep((decision as { delayMs: number }).delayMs)
        }
      }
      expect(second).toBe('second')
      gate.open()
      const decision = await decisionOf(first)
      expect(decision).toMatchObject({ kind: 'done', reason: 'lease-lost' })
      expect((decision as { error: plugin.IdempotencyLeaseLostError }).error.reason).toBe('lease-lost')
      expect(runs).toBe(2)
    })

    it('a store that fails to keep the result, then takes it: run waits for it, and returns once it is kept', async () => {
      let failures = 1
      const flaky = withMethods(storage, {
        complete: async (...args: Parameters<IdempotencyStorage['complete']>) => {
          if (failures-- > 0) throw new Error('connection reset')
          return await storage.complete(...args)
        }
      })
      const idem = open({ storage: flaky })
      const key = newKey('flaky')
      expect(await idem.run(key, {}, async () => 'kept')).toBe('kept')
      expect((await idem.inspect(key, { scope: runScope(null) })).state).toBe('stored')
    })

    it('a store that keeps failing until maxLockHold: run throws (done) rather than return a result nothing kept', async () => {
      const down = withMethods(storage, { complete: async () => { throw new Error('connection reset') } })
      const idem = open({ storage: down, maxLockHold: LOCK_TIMEOUT })
      const decision = await decisionOf(idem.run(newKey('down'), {}, async () => 'lost'))
      expect(decision).toMatchObject({ kind: 'done', reason: 'lease-lost' })
      expect((decision as { error: plugin.IdempotencyLeaseLostError }).error.reason).toBe('store-error')
    })

    it.skipIf(store.name !== 'postgres')('in transaction mode, writes rolled back with the result at COMMIT (a deferred foreign key): the attempt\'s failure, not a store to wait for', async () => {
      const knex = store.knex!()
      const table = `run_deferred_${process.pid}_${Date.now()}`
      await knex.raw(`CREATE TABLE ${table}_parent (id int PRIMARY KEY)`)
      await knex.raw(`CREATE TABLE ${table} (parent int REFERENCES ${table}_parent (id) DEFERRABLE INITIALLY DEFERRED)`)
      try {
        const idem = open({ transaction: true })
        const decision = await decisionOf(idem.run(newKey('deferred'), {}, async (context) => {
          await (context.transaction as typeof knex)(table).insert({ parent: 404 })
          return 'written'
        }))
        expect(decision).toMatchObject({ kind: 'failed' })
        expect((decision as { error: unknown }).error).toBeInstanceOf(standalone.IdempotencyStoreUnavailableError)
        expect(await knex(table).count({ n: '*' })).toEqual([{ n: '0' }])
      } finally {
        await knex.raw(`DROP TABLE ${table}, ${table}_parent`)
      }
    })

    it('closing: release, for another consumer; the work does not run', async () => {
      const idem = createIdempotency({ storage, logger: silent })
      await idem.close()
      let runs = 0
      expect(await decisionOf(idem.run(newKey('closing'), {}, async () => ++runs))).toMatchObject({ kind: 'release', reason: 'closing' })
      expect(runs).toBe(0)
    })

    it('unknown options are refused with their name, before anything runs', async () => {
      const idem = open()
      let runs = 0
      // @ts-expect-error: a misspelt option
      await expect(idem.run(newKey('typo'), {}, async () => ++runs, { scoop: 'billing' })).rejects.toThrow('unknown option "scoop"')
      // @ts-expect-error: two of them
      await expect(idem.run(newKey('typo'), {}, async () => ++runs, { scoop: 'billing', lockTimout: 10 })).rejects.toThrow('unknown options "scoop", "lockTimout"')
      // @ts-expect-error: not an object
      await expect(idem.run(newKey('typo'), {}, async () => ++runs, 'billing')).rejects.toThrow('options must be an object')
      // @ts-expect-error: not a boolean
      await expect(idem.run(newKey('typo'), {}, async () => ++runs, { sharedWithRequests: 'yes' })).rejects.toThrow('sharedWithRequests must be true or false')
      expect(runs).toBe(0)
    })
  })
}

describe('retryDecision of what run() throws, beyond one store', () => {
  it('a store that cannot be reached: retry after a pause, and the work does not run', async () => {
    // A PostgreSQL port nothing listens on.
    const knexFactory = (await import('knex')).default
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, port: 1 }, pool: { min: 0, max: 1 }, acquireConnectionTimeout: 2000 })
    const idem = createIdempotency({ storage: new KnexStorage({ knex, tableName: 'nowhere' }), logger: silent })
    let runs = 0
    try {
      expect(await decisionOf(idem.run(newKey('down'), {}, async () => ++runs))).toMatchObject({ kind: 'retry', reason: 'store-unavailable', delayMs: 1000 })
      expect(runs).toBe(0)
    } finally {
      await idem.close()
      await knex.destroy()
    }
  })

  it('with failOpen, the work run without protection: what it throws is still its own failure', async () => {
    const knexFactory = (await import('knex')).default
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, port: 1 }, pool: { min: 0, max: 1 }, acquireConnectionTimeout: 2000 })
    const idem = createIdempotency({ storage: new KnexStorage({ knex, tableName: 'nowhere' }), logger: silent, failOpen: true })
    try {
      const decision = await decisionOf(idem.run(newKey('open'), {}, async () => { throw new standalone.IdempotencyKeyInvalidError('the work\'s own') }))
      expect(decision.kind).toBe('failed')
    } finally {
      await idem.close()
      await knex.destroy()
    }
  })

  it('the holder\'s lease end, read on a clock that disagrees with the store\'s: never more than lockTimeout, and an eighth of it when it looks past', async () => {
    const leaseEnd = async (skewMs: number): Promise<number> => {
      const storage = new MemoryStorage({ now: () => Date.now() + skewMs })
      const idem = createIdempotency({ storage, logger: silent, lockTimeout: 8000 })
      const gate = new Gate()
      const first = idem.run('skewed', {}, async () => { await gate.hold(); return 1 })
      await gate.entered
      const decision = await decisionOf(idem.run('skewed', {}, async () => 2))
      gate.open()
      await first
      await idem.close()
      return ((decision as { error: plugin.IdempotencyRequestInProgressError }).error).leaseEndsInMs
    }
    // The store's clock 30 s ahead: its lease end looks 38 s away.
    expect(await leaseEnd(30_000)).toBe(8000)
    // 30 s behind: it looks past already, while the store still holds it.
    expect(await leaseEnd(-30_000)).toBe(1000)
  })

  it('what is stored under the key cannot be read (sealed with a key no longer configured): give up', async () => {
    const storage = new MemoryStorage()
    const sealed = (key: string) => createIdempotency({ storage, logger: silent, encryption: { keys: [key], keyHashSecret: Buffer.alloc(32, 9).toString('base64') } })
    const [before, after] = [sealed(Buffer.alloc(32, 1).toString('base64')), sealed(Buffer.alloc(32, 2).toString('base64'))]
    const key = newKey('sealed')
    await before.run(key, {}, async () => 'kept')
    expect(await decisionOf(after.run(key, {}, async () => 'again'))).toMatchObject({ kind: 'give-up', reason: 'entry-unreadable' })
    await Promise.all([before.close(), after.close(), storage.close()])
  })

  it('errors of requests alone, and values that are not errors: the caller\'s own failure', () => {
    expect(retryDecision(new plugin.IdempotencyKeyMissingError('Idempotency-Key'))).toMatchObject({ kind: 'failed' })
    expect(retryDecision('a string')).toEqual({ kind: 'failed', error: 'a string' })
  })

  it('every error run can throw, and retryDecision, come from both entry points', () => {
    for (const name of ['IdempotencyError', 'IdempotencyFingerprintError', 'IdempotencyFingerprintMismatchError', 'IdempotencyFingerprintUnsupportedError', 'IdempotencyKeyInvalidError', 'IdempotencyLeaseLostError',
      'IdempotencyRequestInProgressError', 'IdempotencyResultNotRecordedError', 'IdempotencyServerClosingError', 'IdempotencyStoreUnavailableError', 'IdempotencyStoredResponseUnreadableError', 'retryDecision', 'runScope'] as const) {
      expect(standalone[name], name).toBeTypeOf('function')
      expect(plugin[name], name).toBe(standalone[name])
    }
  })
})

describe('a job\'s lease, on the default maxLockHold', () => {
  it('lives as long as the function runs: a job of 11 minutes keeps its key, where a request\'s lease would have lapsed at 10', async () => {
    vi.useFakeTimers({ toFake: ['Date', 'setInterval', 'clearInterval', 'setTimeout', 'clearTimeout'] })
    const storage = new MemoryStorage()
    const idem = createIdempotency({ storage, logger: silent })
    try {
      const gate = new Gate()
      let runs = 0
      const first = idem.run('nightly', {}, async () => { ++runs; await gate.hold(); return 'report' })
      await gate.entered
      await vi.advanceTimersByTimeAsync(11 * 60_000)
      expect(retryDecision(await idem.run('nightly', {}, async () => ++runs).catch((error: unknown) => error))).toMatchObject({ kind: 'retry', reason: 'in-progress' })
      gate.open()
      expect(await first).toBe('report')
      expect(runs).toBe(1)
    } finally {
      await idem.close()
      vi.useRealTimers()
    }
  })
})

// Cases of their own: a store case's cleanup removes what it made (SQLite's directory).
for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`a job that shares its key with requests (sharedWithRequests) on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    it('meets the request\'s lease (retry, in progress) and then its answer, and never runs the operation again', async () => {
      const app = Fastify()
      await app.register(idempotency, { storage, lockTimeout: LOCK_TIMEOUT })
      const gate = new Gate()
      let routeRuns = 0
      let jobRuns = 0
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        ++routeRuns
        await gate.hold()
        return await reply.code(201).send({ order: 7 })
      })
      app.post('/declined', { config: { idempotency: { addCacheableStatusCodes: [402] } } }, async (request, reply) => { ++routeRuns; return await reply.code(402).send({ declined: true }) })
      const url = await app.listen({ port: 0, host: '127.0.0.1' })
      const job = async (): Promise<unknown> => ({ job: ++jobRuns })
      try {
        const key = newKey('shared')
        const body = { orderId: 7, amount: 4200 }
        const request = postWithKey(`${url}/orders`, key, body)
        await gate.entered
        // The request holds the key: the job comes back once its lease can have ended.
        expect(retryDecision(await app.idempotency.run(key, body, job, { sharedWithRequests: true }).catch((error: unknown) => error))).toMatchObject({ kind: 'retry', reason: 'in-progress' })
        gate.open()
        expect((await request).status).toBe(201)
        // The request's answer is the job's result: its JSON body, parsed.
        expect(await app.idempotency.run(key, body, job, { sharedWithRequests: true })).toEqual({ order: 7 })
        // Another input under the key is another operation: refused, as a request's would be.
        expect(retryDecision(await app.idempotency.run(key, { orderId: 8 }, job, { sharedWithRequests: true }).catch((error: unknown) => error))).toMatchObject({ kind: 'give-up', reason: 'fingerprint-mismatch' })
        // A request answered with a failure it keeps: the job does not run it again, and is not told it succeeded.
        const declined = newKey('declined')
        expect((await postWithKey(`${url}/declined`, declined, body)).status).toBe(402)
        expect(retryDecision(await app.idempotency.run(declined, body, job, { sharedWithRequests: true }).catch((error: unknown) => error))).toMatchObject({ kind: 'done', reason: 'result-not-recorded' })
        expect([routeRuns, jobRuns]).toEqual([2, 0])
      } finally {
        gate.open()
        await app.close()
      }
    })
  })
}

describe('the keys of run() and of requests', () => {
  it('are apart by default: a client\'s Idempotency-Key equal to a job\'s key runs the route, and never reads the job\'s result', async () => {
    const app = Fastify()
    await app.register(idempotency)
    app.setErrorHandler(plugin.idempotencyErrorHandler())
    let routeRuns = 0
    app.post('/jobs', { config: { idempotency: true } }, async () => ({ route: ++routeRuns }))
    const url = await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      expect(await app.idempotency.run('job-7', { amount: 1 }, async () => ({ secret: 'the job\'s result' }))).toEqual({ secret: 'the job\'s result' })
      const answer = await postWithKey(`${url}/jobs`, 'job-7', { amount: 1 })
      expect([answer.status, answer.replayed, JSON.parse(answer.body)]).toEqual([200, false, { route: 1 }])
      // And the job still gets its own kept result.
      expect(await app.idempotency.run('job-7', { amount: 1 }, async () => ({ secret: 'again' }))).toEqual({ secret: 'the job\'s result' })
    } finally {
      await app.close()
    }
  })

  it('are shared when a run says so (sharedWithRequests): the request meets the job\'s result', async () => {
    const app = Fastify()
    await app.register(idempotency)
    let routeRuns = 0
    app.post('/jobs', { config: { idempotency: true } }, async () => ({ route: ++routeRuns }))
    const url = await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      await app.idempotency.run('job-8', { amount: 1 }, async () => ({ job: 1 }), { sharedWithRequests: true })
      const answer = await postWithKey(`${url}/jobs`, 'job-8', { amount: 1 })
      expect([answer.status, answer.replayed, JSON.parse(answer.body)]).toEqual([200, true, { job: 1 }])
      expect(routeRuns).toBe(0)
    } finally {
      await app.close()
    }
  })

  it('cannot meet through a route\'s scope: a scope that returns one of run()\'s namespace is refused (500 #scope-unresolved)', async () => {
    const app = Fastify({ logger: false })
    await app.register(idempotency, { scope: (request) => request.headers['x-tenant'] as string | undefined })
    app.setErrorHandler(plugin.idempotencyErrorHandler())
    let routeRuns = 0
    app.post('/jobs', { config: { idempotency: true } }, async () => ({ route: ++routeRuns }))
    const url = await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      await app.idempotency.run('job-9', {}, async () => ({ job: 1 }), { scope: 'billing' })
      const answer = await postWithKey(`${url}/jobs`, 'job-9', {}, { 'x-tenant': runScope('billing') })
      expect(answer.status).toBe(500)
      expect(JSON.parse(answer.body).type).toMatch(/#scope-unresolved$/)
      expect(routeRuns).toBe(0)
    } finally {
      await app.close()
    }
  })
})
