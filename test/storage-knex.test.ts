import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import knexFactory, { type Knex } from 'knex'
import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { storageConformance } from '../lib/storage/conformance.js'
import { KnexStorage, MAX_KEY_BYTES } from '../lib/storage/knex.js'
import { createIdempotencyTable, dropIdempotencyTable, expiryIndexName, sqlDialect } from '../lib/storage/knex-schema.js'
import type { StoredResponse } from '../lib/storage/types.js'
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

/** A knex instance whose `begin` statement fails `failures` times with `error` before it runs. */
function failingBegins (knex: Knex, failures: number, error: Record<string, unknown>, attempts: { count: number }): Knex {
  return new Proxy(knex, {
    get (target, property, receiver) {
      if (property !== 'raw') return Reflect.get(target, property, receiver)
      return (sql: string, ...rest: unknown[]) => {
        if (/^(WITH live|INSERT INTO)/.test(sql)) {
          attempts.count++
          if (attempts.count <= failures) return Promise.reject(Object.assign(new Error('injected deadlock'), error))
        }
        return (target.raw as (...args: unknown[]) => unknown)(sql, ...rest)
      }
    }
  })
}

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
    replayStatements: 2,
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

    storageConformance(target.name, () => storage(), { describe, it, beforeEach, afterAll })

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

    it('stores keys as bytes, with an index on the expiry', async () => {
      const name = table()
      await createIdempotencyTable(db(), name)
      const columns = await db()(name).columnInfo()
      expect(Object.keys(columns).sort()).toEqual(['body', 'content_type', 'expires_at', 'fingerprint', 'headers',
        'idempotency_key', 'lease_end', 'state', 'status_code', 'token'])
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

    it(`spends ${target.replayStatements} statement(s) on a replay, one on a first begin and one on complete`, async () => {
      const store = storage()
      await store.purgeExpired() // prepare: create the table, probe the server
      const knex = storageKnex!
      const statements: string[] = []
      const listener = (query: { sql: string }) => { statements.push(query.sql) }
      knex.on('query', listener)
      try {
        const lease = await store.begin('k', 'fp', LEASE)
        expect(statements).toHaveLength(1)
        expect(await store.complete('k', (lease as { token: string }).token, response(), EXPIRY)).toBe(true)
        expect(statements).toHaveLength(2)
        expect((await store.begin('k', 'fp', LEASE)).state).toBe('completed')
        expect(statements).toHaveLength(2 + target.replayStatements)
      } finally {
        knex.off('query', listener)
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

  it('refuses an unknown client with a clear error', () => {
    expect(() => new KnexStorage({ knex: fake('mssql') })).toThrow(/knex client "mssql" is not supported/)
    expect(() => new KnexStorage({ knex: fake('oracledb') })).toThrow(/use pg, mysql2/)
    expect(() => new KnexStorage({ knex: fake('mariadb') })).toThrow(/for MariaDB use the mysql2 client/)
    expect(() => new KnexStorage({ knex: {} as Knex })).toThrow(/expected a knex instance/)
    expect(() => new KnexStorage({ knex: fake('pg'), tableName: '' })).toThrow(/tableName/)
  })

  it('keeps the expiry index name derived from the table', () => {
    expect(expiryIndexName('idempotency_keys')).toBe('idempotency_keys_expires_idx')
    expect(expiryIndexName('app.idempotency_keys')).toBe('idempotency_keys_expires_idx')
  })
})
