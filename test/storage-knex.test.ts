import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import knexFactory, { type Knex } from 'knex'
import { knexSnakeCaseMappers } from 'objection'
import { afterAll, afterEach, beforeEach, describe, expect, it } from 'vitest'
import { storageConformance } from '../lib/storage/conformance.js'
import { KnexStorage, MAX_KEY_BYTES } from '../lib/knex.js'
import { createIdempotencyTable, createInFlightIndex, dropIdempotencyTable, expiryIndexName, notificationChannel, sqlDialect } from '../lib/storage/knex/schema.js'
import type { StoredResponse } from '../lib/storage/types.js'
import { buildApp, newKey } from './helpers/app.js'
import { type Availability, MARIADB, mysqlConnection, pgConnection, POSTGRES, service } from './helpers/services.js'

const postgres = await service(POSTGRES)
const mariadb = await service(MARIADB)
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-knex-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

const LEASE = 30_000
const EXPIRY = 60_000

interface Target {
  name: string
  availability: Availability
  config: () => Knex.Config
  /** Statements `begin` spends on a replay (after the storage is prepared). */
  replayStatements: number
  /** Statements of a first `begin` (SQLite reads before it writes). Default 1. */
  firstBeginStatements?: number
  /** Wraps every knex instance handed to a storage (the MySQL path is tested on MariaDB this way). */
  wrap?: (knex: Knex) => Knex
  /** How the server reports a deadlock victim, for the retry test; none for SQLite. */
  deadlock?: Record<string, unknown>
  /** The driver set to return BIGINTs another way (pg already returns strings by default). */
  bigintConfig?: () => Knex.Config
}

/**
 * A knex instance whose server claims to be MySQL 8: the storage then takes the MySQL path
 * (upsert, then a read) instead of MariaDB's INSERT ... RETURNING, and the same SQL runs on MariaDB.
 */
function asMySql (knex: Knex): Knex {
  return new Proxy(knex, {
    get (target, property, receiver) {
      if (property !== 'raw') return Reflect.get(target, property, receiver)
      return (sql: string, ...rest: unknown[]) => /VERSION\(\)/.test(sql)
        ? Promise.resolve([[{ version: '8.0.36' }], []])
        : (target.raw as (...args: unknown[]) => unknown)(sql, ...rest)
    }
  })
}

/**
 * Statements as they run: knex's query events; on SQLite, better-sqlite3's own runs, since the
 * store runs its hot statements on the connection itself (and knex's go through the same methods).
 */
function countStatements (knex: Knex): { count: () => number, stop: () => void } {
  let count = 0
  if (sqlDialect(knex) !== 'sqlite') {
    // Every statement reaches a pooled connection's query (knex's, and the store's own on
    // PostgreSQL) or execute (the store's prepared statements on MariaDB).
    const client = knex.client as { acquireConnection: () => Promise<Record<string, unknown>> }
    const acquire = client.acquireConnection
    client.acquireConnection = async function (this: unknown) {
      const connection = await acquire.call(this)
      for (const method of ['query', 'execute']) {
        const original = connection[method] as ((...args: unknown[]) => unknown) & { counted?: boolean } | undefined
        if (typeof original !== 'function' || original.counted === true) continue
        connection[method] = Object.assign(function (this: unknown, ...args: unknown[]) { if (countOn) count++; return original.apply(this, args) }, { counted: true })
      }
      return connection
    }
    let countOn = true
    return { count: () => count, stop: () => { countOn = false; client.acquireConnection = acquire } }
  }
  const Database = knex.client.driver as new (filename: string) => { prepare: (sql: string) => object, close: () => void }
  const probe = new Database(':memory:')
  const prototype = Object.getPrototypeOf(probe.prepare('SELECT 1')) as Record<string, (...args: unknown[]) => unknown>
  probe.close()
  const originals = Object.fromEntries(['all', 'run', 'get'].map((name) => [name, prototype[name]!]))
  for (const [name, original] of Object.entries(originals)) {
    prototype[name] = function (this: unknown, ...args: unknown[]) { count++; return original.apply(this, args) }
  }
  return { count: () => count, stop: () => { Object.assign(prototype, originals) } }
}

/**
 * A knex instance whose `begin` statement fails `failures` times with `error` before it runs. On
 * SQLite the store then goes through knex too (it runs statements on better-sqlite3 directly only
 * when the client is better-sqlite3's).
 */
function failingBegins (knex: Knex, failures: number, error: Record<string, unknown>, attempts: { count: number }): Knex {
  return new Proxy(knex, {
    get (target, property, receiver) {
      if (property === 'client') {
        return new Proxy(target.client, {
          get: (client, name) => {
            if (name === 'driverName') return 'proxied'
            if (name !== 'acquireConnection') return Reflect.get(client, name)
            // PostgreSQL and MariaDB send begin on a pooled connection directly: fail it there
            // (in place: the pool must get back the very object it lent).
            return async () => {
              const connection = await client.acquireConnection() as Record<string, unknown>
              for (const method of ['query', 'execute']) {
                const original = connection[method] as ((...args: unknown[]) => unknown) & { failing?: boolean } | undefined
                if (typeof original !== 'function' || original.failing === true) continue
                connection[method] = Object.assign((...args: unknown[]) => {
                  const first = args[0] as string | { text?: string, sql?: string }
                  const sql = typeof first === 'string' ? first : String(first.text ?? first.sql)
                  if (/^(WITH live|SET STATEMENT)/.test(sql)) {
                    attempts.count++
                    if (attempts.count <= failures) {
                      const failure = Object.assign(new Error('injected deadlock'), error)
                      const callback = args.find((arg) => typeof arg === 'function') as ((error: Error) => void) | undefined
                      if (callback !== undefined) { callback(failure); return undefined }
                      return Promise.reject(failure)
                    }
                  }
                  return original.apply(connection, args)
                }, { failing: true })
              }
              return connection
            }
          }
        })
      }
      if (property !== 'raw') return Reflect.get(target, property, receiver)
      return (sql: string, ...rest: unknown[]) => {
        if (/^(WITH live|INSERT INTO)/.test(sql)) {
          attempts.count++
          if (attempts.count <= failures) {
            // Shaped like a knex Raw as far as KnexStorage uses one: a thenable with .timeout()
            // and .options().
            const failed = Promise.reject(Object.assign(new Error('injected deadlock'), error))
            return Object.assign(failed, { timeout: () => failed, options: () => failed })
          }
        }
        return (target.raw as (...args: unknown[]) => unknown)(sql, ...rest)
      }
    }
  })
}

/** The pg driver as knex loaded it (it ships no types of its own). */
interface PgClient {
  connect: () => Promise<void>
  query: (sql: string) => Promise<unknown>
  end: () => Promise<void>
  on: (event: 'notification', listener: (message: { channel: string, payload?: string }) => void) => void
}
interface PgDriver {
  Client: new (config: object) => PgClient
  Pool: new (config: object) => { end: () => Promise<void> }
}
const pgDriver = (knex: Knex): PgDriver => knex.client.driver

let tables = 0
function uniqueTable (): string {
  // Short: PostgreSQL and MySQL cut identifiers at 63/64 characters, index names included.
  return `idem_${process.pid}_${Date.now().toString(36)}_${++tables}`
}

function response (overrides: Partial<StoredResponse> = {}): StoredResponse {
  return { statusCode: 201, contentType: 'application/json', headers: { location: '/x' }, body: Buffer.from('{"ok":true}'), ...overrides }
}

const targets: Target[] = [
  {
    name: 'PostgreSQL (pg)',
    availability: postgres,
    config: () => ({ client: 'pg', connection: pgConnection }),
    replayStatements: 1,
    deadlock: { code: '40P01' }
  },
  {
    name: 'MariaDB (mysql2, INSERT ... RETURNING)',
    availability: mariadb,
    config: () => ({ client: 'mysql2', connection: mysqlConnection }),
    replayStatements: 1,
    deadlock: { errno: 1213, code: 'ER_LOCK_DEADLOCK' },
    bigintConfig: () => ({ client: 'mysql2', connection: { ...mysqlConnection, supportBigNumbers: true, bigNumberStrings: true } })
  },
  {
    name: 'MariaDB (mysql2, the MySQL path: upsert then read)',
    availability: mariadb,
    config: () => ({ client: 'mysql2', connection: mysqlConnection }),
    replayStatements: 2,
    wrap: asMySql,
    deadlock: { errno: 1213, code: 'ER_LOCK_DEADLOCK' }
  },
  {
    name: 'SQLite (better-sqlite3, file)',
    availability: { available: true, reason: '' },
    config: () => ({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'store.sqlite') }, useNullAsDefault: true }),
    replayStatements: 1,
    firstBeginStatements: 2,
    bigintConfig: () => ({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'store.sqlite'), options: { safeIntegers: true } }, useNullAsDefault: true })
  }
]

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`KnexStorage on ${target.name}${target.availability.reason}`, () => {
    const instances: Knex[] = []
    const created: string[] = []
    let shared: Knex | undefined

    /** A new knex instance (own pool, own connections), as handed to storages. */
    const connect = (): Knex => {
      const knex = knexFactory(target.config())
      instances.push(knex)
      return target.wrap === undefined ? knex : target.wrap(knex)
    }
    /** The instance the tests inspect the database with. */
    const db = (): Knex => {
      if (shared === undefined) {
        shared = knexFactory(target.config())
        instances.push(shared)
      }
      return shared
    }
    const table = (): string => {
      const name = uniqueTable()
      created.push(name)
      return name
    }
    let storageKnex: Knex | undefined
    const storage = (options: { tableName?: string, now?: () => number, createTable?: boolean } = {}): KnexStorage => {
      storageKnex ??= connect()
      return new KnexStorage({ knex: storageKnex, tableName: options.tableName ?? table(), createTable: options.createTable ?? true, now: options.now })
    }
    const rowOf = async (tableName: string, key: string): Promise<Record<string, unknown> | undefined> =>
      db()(tableName).first('*').where('idempotency_key', Buffer.from(key, 'utf8'))

    afterAll(async () => {
      const knex = db()
      for (const name of created) await dropIdempotencyTable(knex, name)
      for (const instance of instances) await instance.destroy()
    })

    storageConformance(target.name, () => storage(), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: target.config().client === 'pg' })

    it('creates its table on first use, and only once', async () => {
      const name = table()
      const ddl: string[] = []
      const knex = connect()
      knex.on('query', (query: { sql: string }) => { if (/^create table/i.test(query.sql)) ddl.push(query.sql) })
      const store = new KnexStorage({ knex, tableName: name, createTable: true })
      expect(await db().schema.hasTable(name)).toBe(false)
      const results = await Promise.all(Array.from({ length: 10 }, (_, i) => store.begin(`k${i}`, 'fp', LEASE)))
      expect(results.every((r) => r.state === 'acquired')).toBe(true)
      await store.begin('one-more', 'fp', LEASE)
      expect(ddl).toHaveLength(1)
      expect(await db().schema.hasTable(name)).toBe(true)
    })

    it('lets storages on separate connections race to create the table, and all of them work', async () => {
      for (let round = 0; round < 3; round++) {
        const name = table()
        const stores = Array.from({ length: 4 }, () => new KnexStorage({ knex: connect(), tableName: name, createTable: true }))
        const results = await Promise.all(stores.map((store, i) => store.begin('same-key', `fp-${i}`, LEASE)))
        expect(results.filter((r) => r.state === 'acquired')).toHaveLength(1)
        expect(results.filter((r) => r.state === 'in-flight')).toHaveLength(3)
        const own = await Promise.all(stores.map((store, i) => store.begin(`own-${i}`, 'fp', LEASE)))
        expect(own.every((r) => r.state === 'acquired')).toBe(true)
      }
    })

    it('without createTable, fails on a missing table, and works once the table exists', async () => {
      const name = table()
      const store = storage({ tableName: name, createTable: false })
      await expect(store.begin('k', 'fp', LEASE)).rejects.toThrow()
      await createIdempotencyTable(db(), name)
      expect((await store.begin('k', 'fp', LEASE)).state).toBe('acquired')
    })

    it('the migration helper creates the same table as createTable, from a knex migration', async () => {
      const viaStorage = table()
      const viaMigration = table()
      await storage({ tableName: viaStorage }).purgeExpired()
      const migrations = `${viaMigration}_mig`
      const source: Knex.MigrationSource<string> = {
        getMigrations: async () => ['001_idempotency'],
        getMigrationName: (migration) => migration,
        getMigration: async () => ({
          up: (knex: Knex) => createIdempotencyTable(knex, viaMigration),
          down: (knex: Knex) => dropIdempotencyTable(knex, viaMigration)
        })
      }
      try {
        await db().migrate.latest({ migrationSource: source, tableName: migrations })
        expect(await describeTable(db(), viaMigration)).toEqual(await describeTable(db(), viaStorage))
        // Idempotent: a second run (or a storage with createTable: true) changes nothing.
        await createIdempotencyTable(db(), viaMigration)

        const store = storage({ tableName: viaMigration, createTable: false })
        const lease = await store.begin('k', 'fp', LEASE)
        expect(lease.state).toBe('acquired')
        expect(await store.complete('k', (lease as { token: string }).token, response(), EXPIRY)).toBe(true)
        expect((await store.begin('k', 'fp', LEASE)).state).toBe('completed')

        await db().migrate.rollback({ migrationSource: source, tableName: migrations }, true)
        expect(await db().schema.hasTable(viaMigration)).toBe(false)
      } finally {
        await db().schema.dropTableIfExists(migrations)
        await db().schema.dropTableIfExists(`${migrations}_lock`)
      }
    })

    it('gives a new table the in-flight index; leaves a table made before it without one, where listing still works, until createInFlightIndex adds it', async () => {
      const fresh = table()
      await createIdempotencyTable(db(), fresh)
      expect((await describeTable(db(), fresh)).indexes).toContain('T_in_flight_idx')
      const old = table()
      await createIdempotencyTable(db(), old)
      const index = `${old}_in_flight_idx`
      await (sqlDialect(db()) === 'mysql' ? db().raw('DROP INDEX ?? ON ??', [index, old]) : db().raw('DROP INDEX ??', [index]))
      await createIdempotencyTable(db(), old)
      expect((await describeTable(db(), old)).indexes).not.toContain('T_in_flight_idx')
      const store = storage({ tableName: old })
      expect((await store.begin('held', 'fp', LEASE)).state).toBe('acquired')
      expect((await store.listInFlight({ limit: 10 })).leases.map((lease) => lease.key)).toEqual(['held'])
      await createInFlightIndex(db(), old)
      await createInFlightIndex(db(), old)
      expect((await describeTable(db(), old)).indexes).toContain('T_in_flight_idx')
      expect((await store.listInFlight({ limit: 10 })).leases.map((lease) => lease.key)).toEqual(['held'])
    })

    it('says when a response was stored and since when a lease is held, and that it does not know for rows an earlier version wrote', async () => {
      const name = table()
      const store = storage({ tableName: name })
      const before = Date.now()
      const lease = await store.begin('done', 'fp', LEASE)
      expect(lease.state === 'acquired' && await store.complete('done', lease.token, response(), EXPIRY)).toBe(true)
      expect((await store.begin('held', 'fp', LEASE)).state).toBe('acquired')
      const stored = await store.inspect('done')
      expect(stored.state === 'completed' && stored.storedAt).toBeGreaterThanOrEqual(before - 1000)
      const held = await store.inspect('held')
      expect(held.state === 'in-flight' && held.since).toBeGreaterThanOrEqual(before - 1000)
      // Earlier versions left lease_end NULL once completed, and their tokens carry no time.
      await db()(name).where('idempotency_key', Buffer.from('done')).update({ lease_end: null })
      await db()(name).where('idempotency_key', Buffer.from('held')).update({ token: 'A'.repeat(36) })
      expect(await store.inspect('done')).toMatchObject({ state: 'completed', storedAt: null })
      expect(await store.inspect('held')).toMatchObject({ state: 'in-flight', since: null })
      expect((await store.listInFlight({ limit: 10 })).leases).toEqual([expect.objectContaining({ key: 'held', since: null })])
    })

    it('stores keys as bytes, with an index on the expiry', async () => {
      const name = table()
      await createIdempotencyTable(db(), name)
      const columns = await db()(name).columnInfo()
      // PostgreSQL alone has `waiting`, the mark of a waiter that wants a NOTIFY.
      const waiting = sqlDialect(db()) === 'postgres' ? ['waiting'] : []
      expect(Object.keys(columns).sort()).toEqual(['body', 'content_type', 'expires_at', 'fingerprint', 'headers',
        'idempotency_key', 'lease_end', 'state', 'status_code', 'token', ...waiting])
      expect(['bytea', 'varbinary', 'blob']).toContain(columns.idempotency_key!.type.toLowerCase())
      expect(['bytea', 'longblob', 'blob']).toContain(columns.body!.type.toLowerCase())
      expect(['bigint', 'integer']).toContain(columns.expires_at!.type.toLowerCase())
      expect((await describeTable(db(), name)).indexes).toContain('T_expires_idx')
    })

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
      const knex = storageKnex!
      const listener = (query: { sql: string }) => { if (/^delete/i.test(query.sql)) deletes.push(query.sql) }
      knex.on('query', listener)
      try {
        expect(await store.purgeExpired({ batchSize: 3 })).toBe(9)
      } finally {
        knex.off('query', listener)
      }
      // 3 + 3 + 3, and on PostgreSQL and SQLite a fourth DELETE that finds nothing (MySQL reads first).
      expect(deletes.length).toBeGreaterThanOrEqual(3)
      expect(deletes.length).toBeLessThanOrEqual(4)
      const left = (await db()(name).select('idempotency_key')).map((row) => Buffer.from(row.idempotency_key).toString('utf8')).sort()
      expect(left).toEqual(['held-0', 'held-1', 'live-0', 'live-1', 'live-2'])
      expect(await store.purgeExpired()).toBe(0)
      expect((await store.begin('live-1', 'fp', LEASE)).state).toBe('completed')
      expect((await store.begin('held-1', 'fp', LEASE)).state).toBe('in-flight')
      expect((await store.begin('lapsed-1', 'fp', LEASE)).state).toBe('acquired')
      await expect(store.purgeExpired({ batchSize: 0 })).rejects.toThrow(/batchSize/)
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
        instances.push(knex)
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
      const statements = countStatements(storageKnex!)
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

    if (target.deadlock !== undefined) {
      const deadlock = target.deadlock
      it('reruns a statement chosen as a deadlock victim, a bounded number of times', async () => {
        const name = table()
        await createIdempotencyTable(db(), name)
        const attempts = { count: 0 }
        const flaky = new KnexStorage({ knex: failingBegins(connect(), 3, deadlock, attempts), tableName: name })
        expect((await flaky.begin('k', 'fp', LEASE)).state).toBe('acquired')
        expect(attempts.count).toBe(4)

        const stuck = { count: 0 }
        const hopeless = new KnexStorage({ knex: failingBegins(connect(), 100, deadlock, stuck), tableName: name })
        await expect(hopeless.begin('k2', 'fp', LEASE)).rejects.toThrow('injected deadlock')
        expect(stuck.count).toBe(6)
      })
    } else {
      it('does not rerun statements that failed for any other reason', async () => {
        const name = table()
        await createIdempotencyTable(db(), name)
        const attempts = { count: 0 }
        const broken = new KnexStorage({ knex: failingBegins(connect(), 100, { code: 'SQLITE_BUSY' }, attempts), tableName: name })
        await expect(broken.begin('k', 'fp', LEASE)).rejects.toThrow('injected deadlock')
        expect(attempts.count).toBe(1)
      })
    }

    it('keeps store errors short enough to log, with the server\'s reason, even with a large body', async () => {
      const name = table()
      const store = storage({ tableName: name })
      const lease = await store.begin('k', 'fp', LEASE)
      await dropIdempotencyTable(db(), name)
      const error = await store.complete('k', (lease as { token: string }).token, response({ body: Buffer.alloc(1024 * 1024, 0xab) }), EXPIRY)
        .then(() => undefined, (error: Error) => error)
      expect(error).toBeInstanceOf(Error)
      expect(error!.message.length).toBeLessThan(2200)
      expect(error!.message).toMatch(/does not exist|doesn't exist|no such table/)
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
 * Wait mode on PostgreSQL: LISTEN/NOTIFY between storages on separate knex instances (as between
 * processes), the listening connection's failures, close(), and the plugin waiting on it.
 */
describe.skipIf(!postgres.available)(`KnexStorage waitFor on PostgreSQL (LISTEN/NOTIFY)${postgres.reason}`, () => {
  const instances: Knex[] = []
  const created: string[] = []
  const listeners: PgClient[] = []
  const connect = (): Knex => {
    const knex = knexFactory({ client: 'pg', connection: pgConnection })
    instances.push(knex)
    return knex
  }
  const db = connect()
  const table = (): string => {
    const name = uniqueTable()
    created.push(name)
    return name
  }
  /** Two storages on one table, each on its own knex (own pool, own connections). */
  const pair = async (): Promise<{ name: string, waiting: KnexStorage, holding: KnexStorage }> => {
    const name = table()
    await createIdempotencyTable(db, name)
    return { name, waiting: new KnexStorage({ knex: connect(), tableName: name }), holding: new KnexStorage({ knex: connect(), tableName: name }) }
  }
  const token = async (store: KnexStorage, key: string, lease = LEASE): Promise<string> => {
    const result = await store.begin(key, 'fp', lease)
    if (result.state !== 'acquired') throw new Error(`expected the lease on ${key}, got ${result.state}`)
    return result.token
  }
  /** Until `keys` are all marked by a waiter: from then on their end must notify. */
  const marked = async (name: string, keys: string[]): Promise<void> => {
    const ids = keys.map((key) => Buffer.from(key, 'utf8'))
    for (let i = 0; i < 400; i++) {
      const rows = await db(name).select('idempotency_key').whereIn('idempotency_key', ids).andWhere('waiting', true)
      if (rows.length === keys.length) return
      await sleep(5)
    }
    throw new Error(`the waiters never marked ${keys.join(', ')}`)
  }
  /** A plain pg client listening on the table's channel, as a witness of what is sent. */
  const witness = async (name: string): Promise<string[]> => {
    const client = new (pgDriver(db).Client)(pgConnection)
    listeners.push(client)
    const payloads: string[] = []
    client.on('notification', (message) => { payloads.push(message.payload ?? '') })
    await client.connect()
    await client.query(`LISTEN "${notificationChannel(name)}"`)
    await client.query('SELECT 1') // so that `listening` does not count it
    return payloads
  }
  /** Backends listening on the table's channel (their last statement was the LISTEN). */
  const listening = async (name: string): Promise<number[]> => {
    const { rows } = await db.raw('SELECT pid FROM pg_stat_activity WHERE query = ? AND pid <> pg_backend_pid()', [`LISTEN "${notificationChannel(name)}"`])
    return rows.map((row: { pid: number }) => row.pid)
  }
  const base64 = (key: string): string => Buffer.from(key, 'utf8').toString('base64')

  afterAll(async () => {
    for (const client of listeners) await client.end()
    for (const name of created) await dropIdempotencyTable(db, name)
    for (const instance of instances) await instance.destroy()
  })

  it('wakes a waiter within 200 ms when another storage, on another connection, completes or releases the lease', async () => {
    const { name, waiting, holding } = await pair()
    for (const end of ['complete', 'release'] as const) {
      const key = `wake-${end}`
      const held = await token(holding, key)
      let woke = 0
      const waited = waiting.waitFor!(key, 20_000).then(() => { woke = performance.now() })
      await marked(name, [key])
      expect(woke).toBe(0)
      const ending = performance.now()
      if (end === 'complete') expect(await holding.complete(key, held, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(key, held)).toBe(true)
      await waited
      expect(woke - ending, `woken ${Math.round(woke - ending)} ms after ${end}`).toBeLessThan(200)
      expect((await waiting.begin(key, 'fp', LEASE)).state).toBe(end === 'complete' ? 'completed' : 'acquired')
    }
    await waiting.close()
  })

  it('sends a NOTIFY only when somebody waits, with the key\'s bytes in base64', async () => {
    const { name, waiting, holding } = await pair()
    const payloads = await witness(name)
    const key = 'tenant-\u0000-scope:caf\u00e9 \u{1F4B8}'
    for (const [i, end] of (['complete', 'release'] as const).entries()) {
      const alone = `${key}-alone-${end}`
      const held = await token(holding, alone)
      if (end === 'complete') expect(await holding.complete(alone, held, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(alone, held)).toBe(true)

      const awaited = `${key}-awaited-${end}`
      const again = await token(holding, awaited)
      const waited = waiting.waitFor!(awaited, 20_000)
      await marked(name, [awaited])
      if (end === 'complete') expect(await holding.complete(awaited, again, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(awaited, again)).toBe(true)
      await waited
      // Notifications arrive in commit order: the one sent shows that none was sent before it.
      for (let wait = 0; payloads.length < i + 1 && wait < 200; wait++) await sleep(5)
      expect(payloads).toEqual([...(end === 'release' ? [base64(`${key}-awaited-complete`)] : []), base64(awaited)])
    }
    // A refused complete or release (wrong token) sends nothing, even with a waiter: the real
    // release after them sends the only notification.
    const refused = 'refused'
    const held = await token(holding, refused)
    const waited = waiting.waitFor!(refused, 20_000)
    await marked(name, [refused])
    expect(await holding.release(refused, 'not-the-token')).toBe(false)
    expect(await holding.complete(refused, 'not-the-token', response(), EXPIRY)).toBe(false)
    expect(await holding.release(refused, held)).toBe(true)
    await waited
    for (let wait = 0; payloads.length < 3 && wait < 200; wait++) await sleep(5)
    expect(payloads.slice(2)).toEqual([base64(refused)])
    await waiting.close()
  })

  it('wakes 50 waiters on 10 keys, over one listening connection', async () => {
    const { name, waiting, holding } = await pair()
    const keys = Array.from({ length: 10 }, (_, i) => `herd-${i}`)
    const tokens = await Promise.all(keys.map((key) => token(holding, key)))
    const woken: number[] = []
    const waits = Array.from({ length: 50 }, (_, i) => waiting.waitFor!(keys[i % 10]!, 20_000).then(() => { woken.push(performance.now()) }))
    await marked(name, keys)
    expect(woken).toHaveLength(0)
    expect(await listening(name)).toHaveLength(1)
    const ending = performance.now()
    const ended = await Promise.all(keys.map((key, i) => i % 2 === 0
      ? holding.complete(key, tokens[i]!, response(), EXPIRY)
      : holding.release(key, tokens[i]!)))
    expect(ended.every(Boolean)).toBe(true)
    await Promise.all(waits)
    expect(woken).toHaveLength(50)
    expect(Math.max(...woken) - ending).toBeLessThan(1000)
    await waiting.close()
  })

  it('wakes a waiter at the lease end when the lease lapses, without a notification', async () => {
    const { waiting, holding } = await pair()
    await token(holding, 'lapses', 300)
    const started = performance.now()
    await waiting.waitFor!('lapses', 20_000)
    const waited = performance.now() - started
    expect(waited).toBeGreaterThanOrEqual(250)
    expect(waited).toBeLessThan(2000)
    await waiting.close()
  })

  it('rejects pending waits when the listening connection is killed, and listens again on the next waitFor', async () => {
    const { name, waiting, holding } = await pair()
    const held = await token(holding, 'victim')
    const waits = [waiting.waitFor!('victim', 20_000), waiting.waitFor!('victim', 20_000)]
    const outcomes = Promise.allSettled(waits)
    await marked(name, ['victim'])
    const pids = await listening(name)
    expect(pids).toHaveLength(1)
    const pid = pids[0]!
    const killed = performance.now()
    await db.raw('SELECT pg_terminate_backend(?)', [pid])
    for (const outcome of await outcomes) {
      expect(outcome.status).toBe('rejected')
      expect((outcome as PromiseRejectedResult).reason.message).toMatch(/listening connection failed/)
    }
    expect(performance.now() - killed).toBeLessThan(2000)

    // Unmarked, so that the next mark shows the new waiter is listening.
    await db(name).update({ waiting: false })
    const again = waiting.waitFor!('victim', 20_000)
    await marked(name, ['victim'])
    // The killed connection's second waiter may still have had its mark on the way (seen on a
    // loaded machine): the new listener is there when pg_stat_activity shows it.
    let now = await listening(name)
    for (let i = 0; i < 400 && now.length === 0; i++) {
      await sleep(5)
      now = await listening(name)
    }
    expect(now).toHaveLength(1)
    expect(now[0]).not.toBe(pid)
    const ending = performance.now()
    expect(await holding.complete('victim', held, response(), EXPIRY)).toBe(true)
    await again
    expect(performance.now() - ending).toBeLessThan(200)
    await waiting.close()
  })

  it('rejects (and does not hang or crash) when the listening connection cannot be opened', async () => {
    const name = table()
    await createIdempotencyTable(db, name)
    // A port nobody listens on: every connection is refused.
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, port: 1 } })
    instances.push(knex)
    const store = new KnexStorage({ knex, tableName: name })
    await expect(store.waitFor!('k', 5000)).rejects.toThrow()
    await expect(store.waitFor!('k', 5000)).rejects.toThrow()
    await store.close()
  })

  it('close() ends the listening connection and resolves pending waits, leaves no handle, and leaves the knex usable', async () => {
    const name = table()
    await createIdempotencyTable(db, name)
    const knex = connect()
    const store = new KnexStorage({ knex, tableName: name })
    const holder = new KnexStorage({ knex: connect(), tableName: name })
    const handles = (): Record<string, number> => {
      const counts: Record<string, number> = {}
      for (const resource of process.getActiveResourcesInfo()) counts[resource] = (counts[resource] ?? 0) + 1
      return counts
    }
    // A first round warms the pools, so that they hold the same connections before and after.
    await token(holder, 'held')
    await store.waitFor!('free', 1000)
    await store.close()
    const before = handles()

    const pending = store.waitFor!('held', 20_000)
    await marked(name, ['held'])
    const during = handles()
    expect(await listening(name)).toHaveLength(1)
    await store.close()
    await pending
    // Nothing of the storage's is left: no socket, no timer (the pools' own timers come and go,
    // so the counts may only have dropped).
    const after = handles()
    for (const [type, count] of Object.entries(after)) expect(count, type).toBeLessThanOrEqual(before[type] ?? 0)
    expect(after.Timeout ?? 0).toBeLessThan(during.Timeout ?? 0)
    for (let i = 0; i < 100 && (await listening(name)).length > 0; i++) await sleep(10)
    expect(await listening(name)).toHaveLength(0)

    // The knex instance is the caller's: it still works, and so does the storage.
    await knex.raw('SELECT 1')
    expect((await store.begin('held', 'fp', LEASE)).state).toBe('in-flight')
    await db(name).update({ waiting: false })
    const again = store.waitFor!('held', 20_000)
    await marked(name, ['held'])
    await store.close()
    await again
    for (const [type, count] of Object.entries(handles())) expect(count, type).toBeLessThanOrEqual(before[type] ?? 0)
  })

  it('createIdempotencyTable adds `waiting` to a table made before it existed, and then leaves the table alone', async () => {
    // Schema-qualified and mixed case: the catalog lookup must quote the name as knex does.
    const name = `public.${uniqueTable()}_Old`
    created.push(name)
    await db.raw(`CREATE TABLE ?? (idempotency_key bytea NOT NULL PRIMARY KEY, fingerprint text NOT NULL,
      state varchar(16) NOT NULL, token varchar(64), lease_end bigint, status_code integer, content_type text,
      headers text, body bytea, expires_at bigint NOT NULL)`, [name])
    await db(name).insert({ idempotency_key: Buffer.from('old'), fingerprint: 'fp', state: 'in_flight', token: 't', lease_end: 1, expires_at: 1 })
    const knex = connect()
    const ddl: string[] = []
    knex.on('query', (query: { sql: string }) => { if (/^(alter|create) table/i.test(query.sql)) ddl.push(query.sql) })
    await createIdempotencyTable(knex, name)
    expect(ddl.filter((sql) => /^alter/i.test(sql))).toHaveLength(1)
    expect((await db(name).first('waiting')).waiting).toBe(false)
    await createIdempotencyTable(knex, name)
    expect(ddl.filter((sql) => /^alter/i.test(sql))).toHaveLength(1)

    const waiting = new KnexStorage({ knex, tableName: name })
    const holding = new KnexStorage({ knex: connect(), tableName: name })
    const held = await token(holding, 'k')
    const waited = waiting.waitFor!('k', 20_000)
    await marked(name, ['k'])
    const ending = performance.now()
    expect(await holding.complete('k', held, response(), EXPIRY)).toBe(true)
    await waited
    expect(performance.now() - ending).toBeLessThan(200)
    await waiting.close()
  })

  it('is what the plugin waits on in wait mode: one waitFor, woken by the NOTIFY, no polling', async () => {
    const name = table()
    const store = new KnexStorage({ knex: connect(), tableName: name, createTable: true })
    const payloads = await witness(name)
    const waitFor = store.waitFor!
    const waits: Array<{ timeout: number, resolvedAt: number }> = []
    Object.assign(store, {
      waitFor: async (key: string, timeout: number) => {
        const wait = { timeout, resolvedAt: 0 }
        waits.push(wait)
        await waitFor(key, timeout)
        wait.resolvedAt = performance.now()
      }
    })
    const begin = store.begin.bind(store)
    let begins = 0
    store.begin = (...args) => { begins++; return begin(...args) }

    let open!: () => void
    const gate = new Promise<void>((resolve) => { open = resolve })
    let started!: () => void
    const running = new Promise<void>((resolve) => { started = resolve })
    const { app, runs } = await buildApp({ storage: store, wait: true, waitTimeout: '20s' }, {
      '/slow': async (_request, reply) => { started(); await gate; reply.code(201); return { done: true } }
    })
    try {
      const key = newKey('plugin')
      const post = () => app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: { a: 1 } })
      const first = post()
      await running
      const duplicate = post()
      // The duplicate is parked in waitFor, its mark on the row, before the first one finishes.
      const storageKey = `${(await db(name).first('idempotency_key')).idempotency_key.toString('utf8')}`
      await marked(name, [storageKey])
      expect(waits).toHaveLength(1)
      expect(waits[0]!.timeout).toBeGreaterThan(10_000)
      const opened = performance.now()
      open()
      const [original, replayed] = await Promise.all([first, duplicate])
      expect(original.statusCode).toBe(201)
      expect(replayed.statusCode).toBe(201)
      expect(replayed.headers['idempotent-replayed']).toBe('true')
      expect(replayed.body).toBe(original.body)
      expect(runs.get('/slow')).toBe(1)
      // One wait, ended by the notification well before its 20 s timeout; the duplicate asked
      // `begin` twice (before and after the wait), where polling would have asked again and again.
      expect(waits).toHaveLength(1)
      expect(waits[0]!.resolvedAt - opened).toBeLessThan(200)
      expect(begins).toBe(3)
      for (let i = 0; i < 100 && payloads.length === 0; i++) await sleep(10)
      expect(payloads).toEqual([base64(storageKey)])
    } finally {
      await app.close()
      await store.close() // the plugin closes only a storage it created
    }
    for (let i = 0; i < 100 && (await listening(name)).length > 0; i++) await sleep(10)
    expect(await listening(name)).toHaveLength(0)
  })
})

/** Columns and indexes of a table, with the table's own name replaced by `T` in index names. */
async function describeTable (knex: Knex, name: string): Promise<{ columns: unknown, indexes: string[] }> {
  const columns = await knex(name).columnInfo()
  let indexes: string[]
  const dialect = sqlDialect(knex)
  if (dialect === 'postgres') {
    const { rows } = await knex.raw('SELECT indexname FROM pg_indexes WHERE tablename = ?', [name])
    indexes = rows.map((row: { indexname: string }) => row.indexname)
  } else if (dialect === 'mysql') {
    const [rows] = await knex.raw('SHOW INDEX FROM ??', [name])
    indexes = [...new Set<string>(rows.map((row: { Key_name: string }) => row.Key_name))]
  } else {
    const rows = await knex.raw('PRAGMA index_list(??)', [name])
    indexes = rows.map((row: { name: string }) => row.name)
  }
  return { columns, indexes: indexes.map((index) => index.split(name).join('T')).sort() }
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

    storageConformance(`${target.name} with renamed columns`, () => storage(), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: target.config().client === 'pg' })

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

describe('KnexStorage construction', () => {
  const fake = (client: unknown, driverName?: string) => ({ client: { config: { client }, driverName } }) as unknown as Knex

  it('knows the supported clients and their aliases', async () => {
    for (const [client, dialect] of [['pg', 'postgres'], ['postgres', 'postgres'], ['postgresql', 'postgres'], ['mysql', 'mysql'],
      ['mysql2', 'mysql'], ['better-sqlite3', 'sqlite'], ['sqlite3', 'sqlite']] as const) {
      expect(new KnexStorage({ knex: fake(client) }).dialect).toBe(dialect)
    }
    // A Client class instead of a name: the driver tells.
    expect(new KnexStorage({ knex: fake(class {}, 'pg') }).dialect).toBe('postgres')
    const real = knexFactory({ client: 'pg' })
    expect(new KnexStorage({ knex: real }).tableName).toBe('idempotency_keys')
    await real.destroy()
  })

  it('gives waitFor only to PostgreSQL storages whose knex opens its own connections', async () => {
    const pgKnex = knexFactory({ client: 'pg', connection: pgConnection })
    const sqlite = knexFactory({ client: 'better-sqlite3', connection: { filename: ':memory:' }, useNullAsDefault: true })
    // With an external pool knex has no settings to open a listening connection with.
    const pool = new (pgDriver(pgKnex).Pool)(pgConnection)
    const pooled = knexFactory({ client: 'pg', connectionPool: pool } as Knex.Config)
    try {
      expect(new KnexStorage({ knex: pgKnex }).waitFor).toBeTypeOf('function')
      expect('waitFor' in new KnexStorage({ knex: sqlite })).toBe(false)
      expect('waitFor' in new KnexStorage({ knex: pooled })).toBe(false)
      expect('waitFor' in new KnexStorage({ knex: fake('pg') })).toBe(false)
    } finally {
      await Promise.all([pgKnex.destroy(), sqlite.destroy(), pooled.destroy(), pool.end()])
    }
  })

  it('refuses an unknown client with a clear error', () => {
    expect(() => new KnexStorage({ knex: fake('mssql') })).toThrow(/knex client "mssql" is not supported/)
    expect(() => new KnexStorage({ knex: fake('oracledb') })).toThrow(/use pg, mysql2/)
    expect(() => new KnexStorage({ knex: fake('mariadb') })).toThrow(/for MariaDB use the mysql2 client/)
    expect(() => new KnexStorage({ knex: {} as Knex })).toThrow(/expected a knex instance/)
    expect(() => new KnexStorage({ knex: fake('pg'), tableName: '' })).toThrow(/tableName/)
  })

  it('refuses a preparedStatements that is not a boolean', () => {
    expect(() => new KnexStorage({ knex: fake('pg'), preparedStatements: 'yes' as never })).toThrow(/preparedStatements must be a boolean/)
  })

  it.skipIf(!postgres.available)('works without prepared statements, and with them sends each statement by name', async () => {
    const knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 1, max: 1 } })
    const names: Array<string | undefined> = []
    // The store's hot statements reach the pooled connection's query directly.
    const client = knex.client as { acquireConnection: () => Promise<{ query: ((config: unknown, ...rest: unknown[]) => unknown) & { watched?: boolean } }> }
    const acquire = client.acquireConnection.bind(client)
    client.acquireConnection = async () => {
      const connection = await acquire()
      const query = connection.query
      if (query.watched !== true) {
        connection.query = Object.assign((config: unknown, ...rest: unknown[]) => {
          if (typeof config === 'object' && config !== null && 'text' in config) names.push((config as { name?: string }).name)
          return query.call(connection, config, ...rest)
        }, { watched: true })
      }
      return connection
    }
    const name = `prep_${process.pid}_${Date.now()}`
    try {
      for (const preparedStatements of [false, true]) {
        names.length = 0
        const storage = new KnexStorage({ knex, tableName: name, createTable: true, preparedStatements })
        const begun = await storage.begin(`k-${String(preparedStatements)}`, 'fp', LEASE)
        expect(begun.state).toBe('acquired')
        if (begun.state !== 'acquired') return
        expect(await storage.complete(`k-${String(preparedStatements)}`, begun.token, { statusCode: 201, contentType: null, headers: {}, body: Buffer.from('x') }, EXPIRY)).toBe(true)
        const replay = await storage.begin(`k-${String(preparedStatements)}`, 'fp', LEASE)
        expect(replay.state).toBe('completed')
        const named = names.filter((item) => item !== undefined)
        if (preparedStatements) expect(named.length).toBeGreaterThanOrEqual(3)
        else expect(named).toEqual([])
      }
    } finally {
      await dropIdempotencyTable(knex, name)
      await knex.destroy()
    }
  })

  describe.skipIf(!postgres.available)('on PostgreSQL, when the server does not hold the prepared statements (as behind PgBouncer in transaction mode)', () => {
    const response: StoredResponse = { statusCode: 201, contentType: null, headers: {}, body: Buffer.from('x') }
    const warnings: Error[] = []
    const onWarning = (warning: Error): void => { if ((warning as { code?: string }).code === 'FASTIFY_IDEMPOTENCY_UNPREPARED') warnings.push(warning) }
    beforeEach(() => { warnings.length = 0; process.on('warning', onWarning) })
    afterEach(() => { process.off('warning', onWarning) })
    const oneConnection = (): Knex => knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 1, max: 1 } })
    const preparedNames = async (knex: Knex): Promise<string[]> =>
      ((await knex.raw("SELECT name FROM pg_prepared_statements WHERE name LIKE 'idempotency_%'")).rows as Array<{ name: string }>).map((row) => row.name)

    it('a statement the server lost (26000) is sent again unprepared, and so is every later one, with one warning', async () => {
      const knex = oneConnection()
      const table = `lost_${process.pid}_${Date.now()}`
      try {
        const storage = new KnexStorage({ knex, tableName: table, createTable: true })
        expect((await storage.begin('k1', 'fp', LEASE)).state).toBe('acquired')
        expect(await preparedNames(knex)).toHaveLength(1)
        // What a pooler does when it hands the next statement to another server connection.
        await knex.raw('DEALLOCATE ALL')
        const begun = await storage.begin('k2', 'fp', LEASE)
        expect(begun.state).toBe('acquired')
        if (begun.state !== 'acquired') return
        expect(await storage.complete('k2', begun.token, response, EXPIRY)).toBe(true)
        expect((await storage.begin('k2', 'fp', LEASE)).state).toBe('completed')
        expect(await preparedNames(knex)).toEqual([])
        expect(warnings).toHaveLength(1)
        expect(warnings[0]!.message).toMatch(/26000.*preparedStatements: false/)
      } finally {
        await dropIdempotencyTable(knex, table)
        await knex.destroy()
      }
    })

    it('a statement name the server already holds (42P05) is sent unprepared; inside a transaction the store call fails, the next request works', async () => {
      const first = oneConnection()
      const second = oneConnection()
      const table = `taken_${process.pid}_${Date.now()}`
      try {
        const storage = new KnexStorage({ knex: first, tableName: table, createTable: true })
        const begun = await storage.begin('k1', 'fp', LEASE)
        if (begun.state !== 'acquired') throw new Error('expected a lease')
        const trx = await storage.transaction()
        expect(await trx.complete('k1', begun.token, response, EXPIRY)).toBe(true)
        await trx.commit()
        const names = await preparedNames(first)
        expect(names).toHaveLength(2)
        // Another client's statements left on this server connection, under the same names.
        for (const name of names) await second.raw(`PREPARE "${name}" AS SELECT 1`)
        const other = new KnexStorage({ knex: second, tableName: table })
        const taken = await other.begin('k2', 'fp', LEASE)
        expect(taken.state).toBe('acquired')
        expect(warnings).toHaveLength(1)
        expect(warnings[0]!.message).toMatch(/42P05/)
        if (taken.state !== 'acquired') return
        expect(await other.complete('k2', taken.token, response, EXPIRY)).toBe(true)
        expect((await other.begin('k2', 'fp', LEASE)).state).toBe('completed')
        // In a transaction the failed statement has aborted it: the call fails, nothing is retried
        // in it, and the next transaction sends it unprepared. (The lease is taken by a store that
        // sends nothing by name, so that `complete` is this store's first named statement.)
        const lease = await new KnexStorage({ knex: second, tableName: table, preparedStatements: false }).begin('k3', 'fp', LEASE)
        if (lease.state !== 'acquired') throw new Error('expected a lease')
        const third = new KnexStorage({ knex: second, tableName: table })
        const inTransaction = await third.transaction()
        try {
          await expect(inTransaction.complete('k3', lease.token, response, EXPIRY)).rejects.toMatchObject({ code: '42P05' })
        } finally {
          await inTransaction.rollback()
        }
        const after = await third.transaction()
        expect(await after.complete('k3', lease.token, response, EXPIRY)).toBe(true)
        await after.commit()
        expect((await third.begin('k3', 'fp', LEASE)).state).toBe('completed')
        expect(warnings).toHaveLength(2)
      } finally {
        await dropIdempotencyTable(first, table)
        await Promise.all([first.destroy(), second.destroy()])
      }
    })
  })

  it('keeps the expiry index name derived from the table', () => {
    expect(expiryIndexName('idempotency_keys')).toBe('idempotency_keys_expires_idx')
    expect(expiryIndexName('app.idempotency_keys')).toBe('idempotency_keys_expires_idx')
  })
})
