import knexFactory, { type Knex } from 'knex'
import { knexSnakeCaseMappers } from 'objection'
import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { setTimeout as sleep } from 'node:timers/promises'
import { storageConformance } from '../lib/storage/conformance.js'
import { KnexStorage, MAX_KEY_BYTES } from '../lib/knex.js'
import { dropIdempotencyTable } from '../lib/storage/knex/schema.js'
import { countStatements } from './helpers/knex-instrument.js'
import { EXPIRY, knexTargets, LEASE, response, targetDatabase, uniqueTable } from './helpers/knex-targets.js'

/*
 * KnexStorage on every database it supports: the conformance suite and what it does beyond it
 * (purges, clocks, keys, BIGINTs, large bodies, statements per request). Its table:
 * storage-knex-schema.test.ts; failing statements: storage-knex-failures.test.ts; waitFor:
 * storage-knex-wait.test.ts; construction: storage-knex-construction.test.ts.
 */

const targets = knexTargets()

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`KnexStorage on ${target.name}${target.availability.reason}`, () => {
    const { connect, db, table, storage, storageKnex, destroyLater, rowOf } = targetDatabase(target)

    storageConformance(target.name, () => storage(), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: target.config().client === 'pg' && target.pooled !== true })

    it('purges expired responses and lapsed leases, only those, in batches', async () => {
      const start = 1_700_000_000_000
      let clock = start
      const name = table()
      const store = storage({ tableName: name, now: () => clock })
      const completeWith = async (key: string, expiration: number) => {
        const lease = await store.begin(key, 'fp', LEASE)
        expect(await store.complete(key, (lease as { token: string }).token, response(), expiration)).toBe(true)
      }
      for (let i = 0; i < 6; i++) await completeWith(`expired-${i}`, 1000)
      await completeWith('expires-exactly-now', 5000)
      for (let i = 0; i < 3; i++) await completeWith(`live-${i}`, 1_000_000)
      for (let i = 0; i < 2; i++) await store.begin(`lapsed-${i}`, 'fp', 500)
      for (let i = 0; i < 2; i++) await store.begin(`held-${i}`, 'fp', 1_000_000)
      clock = start + 5000

      const deletes: string[] = []
      const knex = storageKnex()!
      const listener = (query: { sql: string }) => { if (/^delete/i.test(query.sql)) deletes.push(query.sql) }
      knex.on('query', listener)
      const progress: number[] = []
      try {
        expect(await store.purgeExpired({ batchSize: 3, onProgress: (purged) => progress.push(purged) })).toBe(9)
      } finally {
        knex.off('query', listener)
      }
      // 3 + 3 + 3, and on PostgreSQL and SQLite a fourth DELETE that finds nothing (MySQL reads first).
      expect(deletes.length).toBeGreaterThanOrEqual(3)
      expect(deletes.length).toBeLessThanOrEqual(4)
      // After each batch, the count so far (and after the last, short or empty, batch).
      expect(progress.slice(0, 3)).toEqual([3, 6, 9])
      expect(progress.slice(3)).toEqual(progress.length === 4 ? [9] : [])
      const left = (await db()(name).select('idempotency_key')).map((row) => Buffer.from(row.idempotency_key).toString('utf8')).sort()
      expect(left).toEqual(['held-0', 'held-1', 'live-0', 'live-1', 'live-2'])
      expect(await store.purgeExpired()).toBe(0)
      expect((await store.begin('live-1', 'fp', LEASE)).state).toBe('completed')
      expect((await store.begin('held-1', 'fp', LEASE)).state).toBe('in-flight')
      expect((await store.begin('lapsed-1', 'fp', LEASE)).state).toBe('acquired')
      await expect(store.purgeExpired({ batchSize: 0 })).rejects.toThrow(/batchSize/)
    })

    it('stops a purge between two batches once its signal is aborted, keeping what it deleted', async () => {
      const name = table()
      const store = storage({ tableName: name })
      await store.purgeExpired()
      await db()(name).insert(Array.from({ length: 20 }, (_, i) => ({ idempotency_key: Buffer.from(`old-${i}`), fingerprint: 'fp', state: 'completed', expires_at: 1 })))
      const stop = new AbortController()
      const reason = new Error('stopped by its caller')
      await expect(store.purgeExpired({ batchSize: 5, signal: stop.signal, onProgress: () => stop.abort(reason) })).rejects.toBe(reason)
      expect((await db()(name).count({ n: '*' }))[0]!.n).toBe(db().client.config.client === 'pg' ? '15' : 15)
      await expect(store.purgeExpired({ signal: stop.signal })).rejects.toBe(reason)
      expect(await store.purgeExpired()).toBe(15)
    })

    it('lets the event loop run between purge batches (better-sqlite3 answers synchronously)', async () => {
      const name = table()
      const store = storage({ tableName: name })
      await store.purgeExpired()
      await db()(name).insert(Array.from({ length: 20 }, (_, i) => ({ idempotency_key: Buffer.from(`old-${i}`), fingerprint: 'fp', state: 'completed', expires_at: 1 })))
      const order: string[] = []
      setImmediate(() => order.push('other work'))
      expect(await store.purgeExpired({ batchSize: 5 })).toBe(20)
      order.push('purge done')
      expect(order).toEqual(['other work', 'purge done'])
    })

    it('never replays an expired row: begin takes it over, and fences the old entry off', async () => {
      const start = 1_700_000_000_000
      let clock = start
      const name = table()
      const store = storage({ tableName: name, now: () => clock })
      const first = await store.begin('k', 'fp-old', LEASE)
      expect(await store.complete('k', (first as { token: string }).token, response({ body: Buffer.from('old') }), 1000)).toBe(true)
      clock = start + 999
      expect((await store.begin('k', 'fp-other', LEASE)).state).toBe('completed')
      clock = start + 1000
      const taken = await store.begin('k', 'fp-new', LEASE)
      expect(taken.state).toBe('acquired')
      const row = await rowOf(name, 'k')
      expect(row).toMatchObject({ state: 'in_flight', fingerprint: 'fp-new', status_code: null, headers: null, body: null })
      expect(await store.complete('k', (first as { token: string }).token, response(), EXPIRY)).toBe(false)
      const held = await store.begin('k', 'fp-x', LEASE)
      expect(held).toEqual({ state: 'in-flight', fingerprint: 'fp-new', lockExpiresAt: start + 1000 + LEASE })
    })

    it('keeps keys that differ only by case, trailing space or normalization apart', async () => {
      const store = storage()
      const keys = ['Key', 'key', 'KEY', 'key ', 'key  ', ' key', 'key\t', 'caf\u00e9', 'cafe\u0301', 'stra\u00dfe', 'strasse', 'key\u0000']
      for (const [i, key] of keys.entries()) {
        const lease = await store.begin(key, `fp-${i}`, LEASE)
        expect(lease.state, `key ${JSON.stringify(key)}`).toBe('acquired')
        expect(await store.complete(key, (lease as { token: string }).token, response({ statusCode: 200 + i }), EXPIRY)).toBe(true)
      }
      for (const [i, key] of keys.entries()) {
        const replay = await store.begin(key, 'fp', LEASE)
        expect(replay.state === 'completed' && replay.response.statusCode, `key ${JSON.stringify(key)}`).toBe(200 + i)
        expect(replay.state === 'completed' && replay.fingerprint).toBe(`fp-${i}`)
      }
    })

    it('keeps BIGINT epoch milliseconds exact, far beyond 32 bits', async () => {
      const far = 8_000_000_000_000_123 // year ~255 000, still a safe integer
      const name = table()
      const store = storage({ tableName: name, now: () => far })
      const lease = await store.begin('k', 'fp', LEASE)
      const held = await store.begin('k', 'fp', LEASE)
      expect(held).toEqual({ state: 'in-flight', fingerprint: 'fp', lockExpiresAt: far + LEASE })
      expect(typeof (held as { lockExpiresAt: unknown }).lockExpiresAt).toBe('number')
      expect(Number((await rowOf(name, 'k'))!.lease_end)).toBe(far + LEASE)
      expect(await store.complete('k', (lease as { token: string }).token, response(), 86_400_000)).toBe(true)
      expect(Number((await rowOf(name, 'k'))!.expires_at)).toBe(far + 86_400_000)
      expect((await store.begin('k', 'fp', LEASE)).state).toBe('completed')
      // Real clocks too: Date.now() is already past 2^32.
      const real = storage()
      const before = Date.now()
      await real.begin('now', 'fp', LEASE)
      const inFlight = await real.begin('now', 'fp', LEASE)
      expect(inFlight.state === 'in-flight' && inFlight.lockExpiresAt).toBeGreaterThanOrEqual(before + LEASE)
    })

    if (target.bigintConfig !== undefined) {
      const bigintConfig = target.bigintConfig
      it('reads BIGINTs whichever form the driver returns them in (strings, bigint)', async () => {
        const knex = knexFactory(bigintConfig())
        destroyLater(knex)
        const name = table()
        const store = new KnexStorage({ knex, tableName: name, createTable: true })
        const before = Date.now()
        const lease = await store.begin('k', 'fp', LEASE)
        const held = await store.begin('k', 'fp', LEASE)
        expect(held.state === 'in-flight' && typeof held.lockExpiresAt).toBe('number')
        expect(held.state === 'in-flight' && held.lockExpiresAt).toBeGreaterThanOrEqual(before + LEASE)
        expect(typeof (await knex(name).first('lease_end')).lease_end).not.toBe('number')
        expect(await store.complete('k', (lease as { token: string }).token, response(), EXPIRY)).toBe(true)
        const replay = await store.begin('k', 'fp', LEASE)
        expect(replay.state === 'completed' && replay.response.statusCode).toBe(201)
      })
    }

    it('stores a body of several MiB byte for byte', async () => {
      const store = storage()
      const body = Buffer.alloc(4 * 1024 * 1024)
      for (let i = 0; i < body.length; i++) body[i] = (i * 7 + (i >> 12)) % 256
      const lease = await store.begin('big', 'fp', LEASE)
      expect(await store.complete('big', (lease as { token: string }).token, response({ body, contentType: 'application/octet-stream' }), EXPIRY)).toBe(true)
      const replay = await store.begin('big', 'fp', LEASE)
      expect(replay.state).toBe('completed')
      expect(replay.state === 'completed' && replay.response.body.equals(body)).toBe(true)
    })

    it('refuses keys the table cannot hold exactly, before touching the store', async () => {
      const store = storage()
      const longest = '\u00e9'.repeat(MAX_KEY_BYTES / 2)
      expect((await store.begin(longest, 'fp', LEASE)).state).toBe('acquired')
      expect((await store.begin(longest, 'fp', LEASE)).state).toBe('in-flight')
      await expect(store.begin(`${longest}x`, 'fp', LEASE)).rejects.toThrow(/at most 1024/)
      await expect(store.begin('lone \ud800 surrogate', 'fp', LEASE)).rejects.toThrow(/surrogate/)
      await expect(store.begin('k', 'fp', 0)).rejects.toThrow(/lockTimeout/)
    })

    const first = target.firstBeginStatements ?? 1
    it(`spends ${target.replayStatements} statement(s) on a replay, ${first} on a first begin and one on complete`, async () => {
      const store = storage()
      await store.purgeExpired() // prepare: create the table, probe the server
      const statements = countStatements(storageKnex()!)
      try {
        const lease = await store.begin('k', 'fp', LEASE)
        expect(statements.count()).toBe(first)
        expect(await store.complete('k', (lease as { token: string }).token, response(), EXPIRY)).toBe(true)
        expect(statements.count()).toBe(first + 1)
        expect((await store.begin('k', 'fp', LEASE)).state).toBe('completed')
        expect(statements.count()).toBe(first + 1 + target.replayStatements)
      } finally {
        statements.stop()
      }
    })

    it('grants each key once while purges and take-overs race on the same rows', async () => {
      const name = table()
      const keys = Array.from({ length: 60 }, (_, i) => `race-${i}`)
      const setup = storage({ tableName: name })
      await Promise.all(keys.map((key) => setup.begin(key, 'fp', 40)))
      await sleep(120)
      // Separate pools, so statements really run side by side on the server.
      const stores = Array.from({ length: 3 }, () => new KnexStorage({ knex: connect(), tableName: name }))
      const purges = stores.map((store, i) => store.purgeExpired({ batchSize: 5 + i }))
      const begins = keys.flatMap((key) => stores.map((store, i) => store.begin(key, `fp-${i}`, LEASE).then((result) => ({ key, result }))))
      const [settled] = await Promise.all([Promise.all(begins), Promise.all(purges)])
      for (const key of keys) {
        const mine = settled.filter((entry) => entry.key === key)
        expect(mine.filter((entry) => entry.result.state === 'acquired'), key).toHaveLength(1)
        expect(mine.filter((entry) => entry.result.state === 'in-flight'), key).toHaveLength(2)
      }
    })

    it('has waitFor on PostgreSQL only; elsewhere the property is absent and the plugin polls', () => {
      const store = storage()
      const onPostgres = store.dialect === 'postgres'
      expect(typeof store.waitFor).toBe(onPostgres ? 'function' : 'undefined')
      expect('waitFor' in store).toBe(onPostgres)
    })

    it('leaves the knex instance it was given open on close', async () => {
      const knex = connect()
      const store = new KnexStorage({ knex, tableName: table(), createTable: true })
      await store.begin('k', 'fp', LEASE)
      await store.close()
      expect((await store.begin('k', 'fp', LEASE)).state).toBe('in-flight')
      await knex.raw('SELECT 1')
    })
  })
}

/**
 * Apps that use Objection.js (or knex-stringcase) hand the store a knex whose identifiers and
 * result rows are renamed: camelCase in the app, snake_case in the database. In transaction mode
 * the handler writes through the store's knex, so the store must work with the app's own.
 */
for (const target of targets) {
  describe.skipIf(!target.availability.available)(`KnexStorage on ${target.name}, with Objection's knexSnakeCaseMappers${target.availability.reason}`, () => {
    const instances: Knex[] = []
    const created: string[] = []
    const connect = (): Knex => {
      const knex = knexFactory({ ...target.config(), ...knexSnakeCaseMappers() })
      instances.push(knex)
      return target.wrap === undefined ? knex : target.wrap(knex)
    }
    let knex: Knex | undefined
    const storage = (now?: () => number): KnexStorage => {
      knex ??= connect()
      const tableName = uniqueTable()
      created.push(tableName)
      return new KnexStorage({ knex, tableName, createTable: true, now })
    }
    afterAll(async () => {
      const plain = knexFactory(target.config())
      for (const name of created) await dropIdempotencyTable(plain, name)
      await plain.destroy()
      for (const instance of instances) await instance.destroy()
    })

    storageConformance(`${target.name} with renamed columns`, () => storage(), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: target.config().client === 'pg' && target.pooled !== true })

    it('purges expired rows', async () => {
      let now = Date.now()
      const store = storage(() => now)
      for (const key of ['a', 'b', 'c']) {
        const begun = await store.begin(key, 'fp', LEASE)
        if (begun.state !== 'acquired') throw new Error('expected a lease')
        expect(await store.complete(key, begun.token, response(), EXPIRY)).toBe(true)
      }
      now += EXPIRY + 1
      expect(await store.purgeExpired()).toBe(3)
      expect((await store.begin('a', 'fp', LEASE)).state).toBe('acquired')
    })
  })
}
