import knexFactory, { type Knex } from 'knex'
import { afterEach, beforeEach, describe, expect, it } from 'vitest'
import { KnexStorage } from '../lib/knex.js'
import { createIdempotencyTable, dropIdempotencyTable } from '../lib/storage/knex/schema.js'
import type { StoredResponse } from '../lib/storage/types.js'
import { failingBegins } from './helpers/knex-instrument.js'
import { EXPIRY, knexTargets, LEASE, postgres, response, targetDatabase } from './helpers/knex-targets.js'
import { pgConnection } from './helpers/services.js'
import { pgbouncer } from './helpers/pgbouncer.js'

/**
 * KnexStorage when statements fail: deadlock victims rerun, other failures not, errors short
 * enough to log; on PostgreSQL, prepared statements the server does not hold (as behind PgBouncer).
 */
for (const target of knexTargets()) {
  describe.skipIf(!target.availability.available)(`KnexStorage on ${target.name}, when statements fail${target.availability.reason}`, () => {
    const { connect, db, table, storage } = targetDatabase(target)

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
  })
}

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

const bouncer = await pgbouncer()
describe.skipIf(!bouncer.availability.available)(`on PostgreSQL behind PgBouncer in transaction pooling${bouncer.availability.reason}`, () => {
  it('sends the hot statements unnamed by default, and by name only when preparedStatements: true asks for it', async () => {
    const knex = knexFactory({ client: 'pg', connection: bouncer.transaction, pool: { min: 0, max: 2 } })
    const table = `pooled_${process.pid}_${Date.now()}`
    const named: Array<string | undefined> = []
    // What the store sends on a pooled connection (knex itself passes a callback: passed on).
    const client = knex.client as { acquireConnection: () => Promise<{ query: (...args: unknown[]) => unknown, watched?: boolean }> }
    const acquire = client.acquireConnection.bind(client)
    client.acquireConnection = async () => {
      const connection = await acquire()
      if (connection.watched === true) return connection
      connection.watched = true
      const query = connection.query.bind(connection)
      connection.query = (...args: unknown[]) => {
        const [q] = args as [{ text?: string, name?: string }]
        // The hot statements: takeLease and storeResponse.
        if (typeof q === 'object' && q !== null && String(q.text).includes(table) && /^WITH live|status_code = \$1/.test(String(q.text).trimStart())) named.push(q.name)
        return query(...args)
      }
      return connection
    }
    const warnings: Error[] = []
    const onWarning = (warning: Error): void => { if ((warning as { code?: string }).code === 'FASTIFY_IDEMPOTENCY_UNPREPARED') warnings.push(warning) }
    process.on('warning', onWarning)
    try {
      const byDefault = new KnexStorage({ knex, tableName: table, createTable: true })
      const lease = await byDefault.begin('k', 'fp', LEASE)
      if (lease.state !== 'acquired') throw new Error('expected a lease')
      expect(await byDefault.complete('k', lease.token, response(), EXPIRY)).toBe(true)
      expect(named).toEqual([undefined, undefined])
      expect(warnings).toEqual([])
      named.length = 0
      const chosen = new KnexStorage({ knex, tableName: table, preparedStatements: true })
      expect((await chosen.begin('k', 'fp', LEASE)).state).toBe('completed')
      expect(named[0]).toMatch(/^idempotency_/)
    } finally {
      process.off('warning', onWarning)
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
    }
  })
})
