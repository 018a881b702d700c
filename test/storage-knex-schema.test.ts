import type { Knex } from 'knex'
import { describe, expect, it } from 'vitest'
import { KnexStorage } from '../lib/knex.js'
import { createIdempotencyTable, createInFlightIndex, dropIdempotencyTable, expiryIndexName, sqlDialect } from '../lib/storage/knex/schema.js'
import { describeTable, EXPIRY, knexTargets, LEASE, response, targetDatabase } from './helpers/knex-targets.js'

/** KnexStorage's table on every database: made on first use or by a migration, its columns and indexes, older tables. */
for (const target of knexTargets()) {
  describe.skipIf(!target.availability.available)(`KnexStorage on ${target.name}, its table${target.availability.reason}`, () => {
    const { connect, db, table, storage } = targetDatabase(target)

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
  })
}

it('keeps the expiry index name derived from the table', () => {
  expect(expiryIndexName('idempotency_keys')).toBe('idempotency_keys_expires_idx')
  expect(expiryIndexName('app.idempotency_keys')).toBe('idempotency_keys_expires_idx')
})
