/**
 * The SQL scenarios: the plugin's KnexStorage on PostgreSQL, MariaDB and SQLite, and beside each
 * its floor, the least work any SQL-backed idempotency layer must do through the same knex client
 * and pool:
 *
 *   replay (a key starting with `r-` that is stored)   one primary-key SELECT of the stored row
 *   first request (any other key)                      an INSERT that takes the key, the handler,
 *                                                      then an UPDATE that stores the response
 *
 * In transaction mode the floor does the INSERT on its own, then the handler's INSERT of an order
 * row and the UPDATE in one transaction; the plugin's transaction-mode scenario writes the same
 * order row through `request.idempotency.transaction`.
 *
 * SQLite runs in WAL with synchronous=NORMAL and a busy timeout (docs/stores/knex.md#sqlite),
 * floor and store alike.
 */
import { rm } from 'node:fs/promises'
import { join } from 'node:path'
import type { FastifyReply, FastifyRequest } from 'fastify'
import knexFactory, { type Knex } from 'knex'
import { benchEnv, ExecutionCounter, KEY_HEADER, placeOrder, ROUTE, type BenchServer, type OrderBody } from './common.js'
import { listen, newApp, orderHandler } from './fastify.js'
import { loadCore, loadKnexStorage } from './source.js'

type Database = 'pg' | 'mariadb' | 'sqlite'

function tableName (what: string): string {
  return `bench_${what}_${benchEnv().tag}`.replace(/[^a-zA-Z0-9_]/g, '_')
}

/** One knex instance per scenario server, with knex's default pool (SQLite: its one connection). */
function connect (database: Database): { knex: Knex, cleanup: () => Promise<void> } {
  const env = benchEnv()
  if (database === 'pg') return { knex: knexFactory({ client: 'pg', connection: env.pg }), cleanup: async () => {} }
  if (database === 'mariadb') return { knex: knexFactory({ client: 'mysql2', connection: env.mysql }), cleanup: async () => {} }
  const filename = join(env.tmpDir, `bench-${env.tag}-${process.pid}.sqlite`)
  const knex = knexFactory({
    client: 'better-sqlite3',
    connection: { filename },
    useNullAsDefault: true,
    pool: {
      afterCreate: (db: { pragma: (sql: string) => unknown }, done: (error: Error | null, db: unknown) => void) => {
        // BENCH_SQLITE_JOURNAL=rollback measures SQLite's default setup instead (docs/stores/knex.md).
        if (process.env.BENCH_SQLITE_JOURNAL === 'rollback') { done(null, db); return }
        db.pragma('journal_mode = WAL')
        db.pragma('synchronous = NORMAL')
        db.pragma('busy_timeout = 5000')
        done(null, db)
      }
    }
  })
  return {
    knex,
    cleanup: async () => {
      for (const suffix of ['', '-wal', '-shm', '-journal']) await rm(filename + suffix, { force: true })
    }
  }
}

/** The order rows a transaction-mode handler writes. */
async function createOrders (knex: Knex, table: string): Promise<void> {
  await knex.schema.dropTableIfExists(table)
  await knex.schema.createTable(table, (t) => { t.increments('id'); t.string('idem_key', 100).notNullable(); t.integer('amount').notNullable() })
}

async function knexScenario (database: Database, transaction: boolean): Promise<BenchServer> {
  const { idempotency, idempotencyErrorHandler } = await loadCore()
  const { KnexStorage, dropIdempotencyTable } = await loadKnexStorage()
  const { knex, cleanup } = connect(database)
  const table = tableName('idem')
  const orders = tableName('orders')
  const storage = new KnexStorage({ knex, tableName: table, createTable: true })
  if (transaction) await createOrders(knex, orders)
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage, transaction })
  app.setErrorHandler(idempotencyErrorHandler())
  const handler = transaction
    ? async (request: FastifyRequest, reply: FastifyReply) => {
      const result = await placeOrder(counter, request.headers[KEY_HEADER], request.body as OrderBody)
      await (request.idempotency!.transaction as Knex.Transaction)(orders).insert({ idem_key: String(request.headers[KEY_HEADER]), amount: result.amount })
      reply.code(201)
      return result
    }
    : orderHandler(counter)
  app.post(ROUTE, { config: { idempotency: true } }, handler)
  return await listen(app, counter, async () => {
    await dropIdempotencyTable(knex, table)
    await knex.schema.dropTableIfExists(orders)
    await knex.destroy()
    await cleanup()
  })
}

/** See the file's comment: one SELECT per replay; INSERT, handler, UPDATE per first request. */
async function sqlFloor (database: Database, transaction: boolean): Promise<BenchServer> {
  const { knex, cleanup } = connect(database)
  // The PostgreSQL floor and its transaction-mode floor start at once on one database: a table each.
  const table = tableName(transaction ? 'floor_trx' : 'floor')
  const orders = tableName('floor_orders')
  await knex.schema.dropTableIfExists(table)
  await knex.schema.createTable(table, (t) => {
    t.binary('idempotency_key', 1024).primary()
    t.string('state', 16).notNullable()
    t.binary('body')
  })
  if (transaction) await createOrders(knex, orders)
  const app = newApp()
  const counter = new ExecutionCounter()
  app.post(ROUTE, async (request, reply) => {
    const key = request.headers[KEY_HEADER]
    if (typeof key !== 'string') throw new Error('the floor needs a key')
    const id = Buffer.from(key)
    reply.code(201).type('application/json; charset=utf-8')
    if (key.startsWith('r-')) {
      const row = await knex(table).first('body').where('idempotency_key', id) as { body: Buffer | null } | undefined
      if (row?.body != null) return row.body
      if (row !== undefined) return '{}'
    }
    await knex(table).insert({ idempotency_key: id, state: 'in_flight' })
    const result = await placeOrder(counter, key, request.body as OrderBody)
    const body = Buffer.from(JSON.stringify(result))
    if (!transaction) {
      await knex(table).where('idempotency_key', id).update({ state: 'completed', body })
      return body
    }
    await knex.transaction(async (trx) => {
      await trx(orders).insert({ idem_key: key, amount: result.amount })
      await trx(table).where('idempotency_key', id).update({ state: 'completed', body })
    })
    return body
  })
  return await listen(app, counter, async () => {
    await knex.schema.dropTableIfExists(table)
    await knex.schema.dropTableIfExists(orders)
    await knex.destroy()
    await cleanup()
  })
}

export const knexPostgres = async (): Promise<BenchServer> => await knexScenario('pg', false)
export const knexPostgresTransaction = async (): Promise<BenchServer> => await knexScenario('pg', true)
export const knexMariadb = async (): Promise<BenchServer> => await knexScenario('mariadb', false)
export const knexSqlite = async (): Promise<BenchServer> => await knexScenario('sqlite', false)
export const pgFloor = async (): Promise<BenchServer> => await sqlFloor('pg', false)
export const pgTransactionFloor = async (): Promise<BenchServer> => await sqlFloor('pg', true)
export const mariadbFloor = async (): Promise<BenchServer> => await sqlFloor('mariadb', false)
export const sqliteFloor = async (): Promise<BenchServer> => await sqlFloor('sqlite', false)
