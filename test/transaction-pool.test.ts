/**
 * Transaction mode with recovery points needs two pooled connections per request at once: its own
 * transaction, held while the handler runs, and one for each step (its record, its transaction).
 * When as many requests as knex's pool has connections each held a transaction, every step waited
 * for a connection that only those requests could free: with knex's default pool of ten, ten
 * concurrent requests waited for storeTimeout and most got 503. The requests that fit must be
 * served at once; the rest wait for them, not for a timeout.
 */
import { afterAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../lib/knex.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { postWithKey } from './helpers/http-client.js'
import { pgbouncer } from './helpers/pgbouncer.js'

/** knex's default pool. */
const POOL = 10
/** Far above what serving them takes: a request that waits for it is a failure. */
const STORE_TIMEOUT = 8000
const stamp = `${process.pid}_${Date.now().toString(36)}`
const bouncer = await pgbouncer()

const databases: Array<{ name: string, availability: Availability, config: Knex.Config }> = [
  { name: 'PostgreSQL', availability: await service(POSTGRES), config: { client: 'pg', connection: pgConnection } },
  { name: 'PostgreSQL through PgBouncer (transaction pooling)', availability: bouncer.availability, config: { client: 'pg', connection: bouncer.transaction } },
  { name: 'MariaDB', availability: await service(MARIADB), config: { client: 'mysql2', connection: mysqlConnection } }
]

/** A knex of the database's config, an app, the names of the idempotency and orders tables, the runs per key; all dropped after the file's describe. */
function fixture (config: Knex.Config, table: string): { knex: Knex, table: string, orders: string, runs: Map<string, number>, app: FastifyInstance } {
  const knex = knexFactory(config)
  const orders = `${table}_orders`
  const app = Fastify()
  afterAll(async () => {
    await app.close()
    await knex.schema.dropTableIfExists(orders)
    await dropIdempotencyTable(knex, table)
    await knex.destroy()
  })
  return { knex, table, orders, runs: new Map(), app }
}

for (const [index, database] of databases.entries()) {
  describe.skipIf(!database.availability.available)(`transaction mode with steps on ${database.name}, knex's default pool${database.availability.reason}`, () => {
    const { knex, table, orders, runs, app } = fixture(database.config, `trx_pool_${stamp}_${index}`)

    const ready = (async () => {
      expect((knex.client as { pool: { max: number } }).pool.max).toBe(POOL)
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 100) })
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), transaction: true, storeTimeout: STORE_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.headers['idempotency-key'] as string
        runs.set(key, (runs.get(key) ?? 0) + 1)
        // The request's transaction is in use while the step needs its own.
        await transactionOf(request)(orders).insert({ idem_key: key })
        const charge = await request.idempotency!.step('charge', async ({ transaction }) => {
          await (transaction as Knex.Transaction)(orders).insert({ idem_key: `${key}:charge` })
          return { id: `ch_${key}` }
        })
        reply.code(201)
        return { charge }
      })
      return `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
    })()

    for (const times of [1, 2]) {
      it(`serves ${times * POOL} concurrent requests (${times}x the pool), each once, without waiting for a timeout`, async () => {
        const url = await ready
        const keys = Array.from({ length: times * POOL }, (_, i) => `k${times}-${i}`)
        const started = Date.now()
        const statuses = await Promise.all(keys.map(async (key) => (await postWithKey(url, key, '{}')).status))
        expect(statuses).toEqual(keys.map(() => 201))
        expect(Date.now() - started).toBeLessThan(STORE_TIMEOUT / 2)
        for (const key of keys) expect(runs.get(key), key).toBe(1)
        const written = await knex(orders).whereIn('idem_key', keys.flatMap((key) => [key, `${key}:charge`])).count({ n: '*' })
        expect(Number(written[0]!.n)).toBe(2 * keys.length)
      })
    }
  })
}

// More request transactions at once than the pool lets open: the requests beyond wait for one,
// each holding the lease `begin` took. The plugin renews a lease once the request's transaction is
// open, so the store renews it meanwhile. Before, it lapsed while its request waited (here the
// last ones wait about 3 s, lockTimeout is 2 s): a duplicate sent then took the key over and ran
// the handler, the first request ran it too once its turn came, and was rolled back (503).
for (const [index, database] of databases.entries()) {
  describe.skipIf(!database.availability.available)(`transaction mode on ${database.name}, more requests than transactions at once${database.availability.reason}`, () => {
    const { knex, table, orders, runs, app } = fixture(database.config, `trx_pool_wait_${stamp}_${index}`)

    it('keeps the lease of a request waiting for a transaction: 40 at once, a duplicate of each of the last 5 sent while it waits gets 409, each handler runs once', async () => {
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 100) })
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), transaction: true, lockTimeout: 2000 })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.headers['idempotency-key'] as string
        runs.set(key, (runs.get(key) ?? 0) + 1)
        await transactionOf(request)(orders).insert({ idem_key: key })
        await new Promise((resolve) => setTimeout(resolve, 700))
        return await reply.code(201).send({ ok: true })
      })
      const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
      const keys = Array.from({ length: 40 }, (_, i) => `wait-${i}`)
      const first = keys.map(async (key) => await postWithKey(url, key, '{}'))
      // The last ones wait for 35 requests ahead of them, 9 at a time, 0.7 s each.
      await new Promise((resolve) => setTimeout(resolve, 2500))
      const duplicates = await Promise.all(keys.slice(-5).map(async (key) => await postWithKey(url, key, '{}')))
      const answers = await Promise.all(first)
      const written = await knex(orders).whereIn('idem_key', keys).select('idem_key') as Array<{ idem_key: string }>
      expect({
        duplicates: duplicates.map((answer) => answer.replayed ? 'replayed' : answer.status),
        runs: keys.filter((key) => runs.get(key) !== 1),
        rows: keys.filter((key) => written.filter((row) => row.idem_key === key).length !== 1),
        answers: answers.map((answer) => answer.status)
      }).toEqual({ duplicates: [409, 409, 409, 409, 409], runs: [], rows: [], answers: keys.map(() => 201) })
    }, 30_000)
  })
}

describe.skipIf(!databases[0]!.availability.available)(`a request transaction that waits for its slot, on PostgreSQL${databases[0]!.availability.reason}`, () => {
  // A pool of two: one request transaction at a time.
  const knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
  const table = `trx_pool_slot_${stamp}`
  const storage = new KnexStorage({ knex, tableName: table, createTable: true })
  afterAll(async () => {
    await dropIdempotencyTable(knex, table)
    await knex.destroy()
  })

  it('renews its lease while it waits, fails when the lease is gone when its turn comes, and opens without a lease to keep', async () => {
    const ahead = await storage.begin('slot-ahead', 'fp', 60_000) as { token: string }
    const holding = await storage.transaction({ request: true, lease: { key: 'slot-ahead', token: ahead.token, lockTimeout: 60_000 } })
    const kept = await storage.begin('slot-kept', 'fp', 400) as { token: string }
    const lost = await storage.begin('slot-lost', 'fp', 400) as { token: string }
    const waitingKept = storage.transaction({ request: true, lease: { key: 'slot-kept', token: kept.token, lockTimeout: 400 } })
    const waitingLost = storage.transaction({ request: true, lease: { key: 'slot-lost', token: lost.token, lockTimeout: 400 } })
    const waitingBare = storage.transaction({ request: true })
    waitingLost.catch(() => {})
    expect(await storage.release('slot-lost', lost.token)).toBe(true)
    // Three lease lengths: the waiting lease lapses unless it is renewed.
    await new Promise((resolve) => setTimeout(resolve, 1200))
    expect((await storage.inspect('slot-kept')).state).toBe('in-flight')
    await holding.rollback()
    const opened = await waitingKept
    await opened.rollback()
    await expect(waitingLost).rejects.toThrow(/lease was lost while its request waited/)
    await (await waitingBare).rollback()
  })

  it('does not take a renewal that fails for a lost lease while it waits: the transaction opens', async () => {
    const ahead = await storage.begin('slot-ahead-2', 'fp', 60_000) as { token: string }
    const holding = await storage.transaction({ request: true, lease: { key: 'slot-ahead-2', token: ahead.token, lockTimeout: 60_000 } })
    const waiting = await storage.begin('slot-failing', 'fp', 60_000) as { token: string }
    let failed = 0
    const renew = storage.renew
    storage.renew = async () => { failed++; throw new Error('connection reset') }
    try {
      const opening = storage.transaction({ request: true, lease: { key: 'slot-failing', token: waiting.token, lockTimeout: 80 } })
      await new Promise((resolve) => setTimeout(resolve, 200))
      await holding.rollback()
      await (await opening).rollback()
      expect(failed).toBeGreaterThan(0)
    } finally {
      storage.renew = renew
    }
  })
})
