/**
 * Transaction mode when COMMIT itself fails, on real servers: a foreign key checked at commit
 * (`DEFERRABLE INITIALLY DEFERRED`, as Django creates them: PostgreSQL and SQLite; MariaDB has no
 * deferred constraints) and the transaction's connection killed just before COMMIT (PostgreSQL,
 * directly and through PgBouncer, and MariaDB; SQLite has no connection to kill). knex's
 * `trx.commit()` resolves even when COMMIT fails: the client must get 503 problem+json, the writes
 * must be absent, the key free, and a retry must run once and be stored.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import knexFactory, { type Knex } from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, type StorageTransaction, type TransactionOptions } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../lib/knex.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { startProxy, type Proxy } from './helpers/proxy.js'

const stamp = `${process.pid}_${Date.now().toString(36)}`
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-commit-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))
const bouncer = await pgbouncer()

/** How to end a transaction's connection from another one; absent where there is none (SQLite). */
interface Killer {
  id: (trx: Knex.Transaction) => Promise<unknown>
  kill: (admin: Knex, id: unknown) => Promise<void>
}
const postgresKiller: Killer = {
  id: async (trx) => (await trx.raw('SELECT pg_backend_pid() AS id')).rows[0].id,
  kill: async (admin, id) => { await admin.raw('SELECT pg_terminate_backend(?)', [Number(id)]) }
}
const mariadbKiller: Killer = {
  id: async (trx) => (await trx.raw('SELECT CONNECTION_ID() AS id'))[0][0].id,
  kill: async (admin, id) => { await admin.raw(`KILL ${Number(id)}`) }
}

interface Database {
  name: string
  availability: Availability
  config: Knex.Config
  /** The admin's connection, which kills (directly on the server, past any pooler). */
  admin?: Knex.Config
  deferred: boolean
  killer?: Killer
}

const sqliteForeignKeys = {
  afterCreate: (db: { pragma: (sql: string) => unknown }, done: (error: Error | null, db: unknown) => void) => { db.pragma('foreign_keys = ON'); done(null, db) }
}

const databases: Database[] = [
  { name: 'PostgreSQL', availability: await service(POSTGRES), config: { client: 'pg', connection: pgConnection }, deferred: true, killer: postgresKiller },
  { name: 'PostgreSQL through PgBouncer (transaction pooling)', availability: bouncer.availability, config: { client: 'pg', connection: bouncer.transaction }, admin: { client: 'pg', connection: pgConnection }, deferred: true, killer: postgresKiller },
  { name: 'MariaDB', availability: await service(MARIADB), config: { client: 'mysql2', connection: mysqlConnection }, deferred: false, killer: mariadbKiller },
  { name: 'SQLite', availability: { available: true, reason: '' }, config: { client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'commit.db') }, useNullAsDefault: true, pool: sqliteForeignKeys }, deferred: true }
]

for (const [index, database] of databases.entries()) {
  describe.skipIf(!database.availability.available)(`transaction mode on ${database.name}, when COMMIT fails${database.availability.reason}`, () => {
    const knex = knexFactory(database.config)
    const admin = knexFactory(database.admin ?? database.config)
    const table = `trx_commit_${stamp}_${index}`
    const customers = `${table}_customers`
    const orders = `${table}_orders`
    /** Keys whose transaction's connection is killed just before COMMIT. */
    const killAtCommit = new Set<string>()

    /** KnexStorage, but a transaction whose request asked for it loses its connection before COMMIT. */
    class Killing extends KnexStorage {
      override async transaction (options?: TransactionOptions): Promise<StorageTransaction> {
        const inner = await super.transaction(options)
        const trx = inner.handle as Knex.Transaction & { killKey?: string }
        return {
          ...inner,
          commit: async () => {
            if (trx.killKey !== undefined && database.killer !== undefined) {
              await database.killer.kill(admin, await database.killer.id(trx))
            }
            await inner.commit()
          }
        }
      }
    }

    let app: FastifyInstance
    const runs = new Map<string, number>()
    const ready = (async () => {
      await knex.raw(`CREATE TABLE ${customers} (id INTEGER PRIMARY KEY)`)
      const deferrable = database.deferred ? ' DEFERRABLE INITIALLY DEFERRED' : ''
      await knex.raw(`CREATE TABLE ${orders} (id INTEGER PRIMARY KEY, idem_key VARCHAR(100), customer_id INTEGER REFERENCES ${customers} (id)${deferrable})`)
      app = Fastify()
      await app.register(idempotency, { storage: new Killing({ knex, tableName: table, createTable: true }), transaction: true })
      app.setErrorHandler(idempotencyErrorHandler())
      let nextId = 1
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.headers['idempotency-key'] as string
        runs.set(key, (runs.get(key) ?? 0) + 1)
        const trx = transactionOf(request)
        await trx(orders).insert({ id: nextId++, idem_key: key, customer_id: (request.body as { customer: number }).customer })
        if (killAtCommit.has(key)) (trx as { killKey?: string }).killKey = key
        reply.code(201)
        return { ordered: key }
      })
      await app.ready()
    })()
    afterAll(async () => {
      await app?.close()
      await knex.schema.dropTableIfExists(orders)
      await knex.schema.dropTableIfExists(customers)
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
      await admin.destroy()
    })

    const post = async (key: string, customer: number) => await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { customer } })
    const written = async (key: string): Promise<number> => Number((await knex(orders).where({ idem_key: key }).count({ n: '*' }))[0]!.n)

    /** The first attempt's COMMIT failed: 503, nothing kept, the key free; the retry runs once and is stored. */
    async function expectRefusedThenRetried (key: string, customer: number, fix: () => Promise<void>): Promise<void> {
      const failed = await post(key, customer)
      expect(failed.statusCode).toBe(503)
      expect(failed.headers['content-type']).toMatch(/^application\/problem\+json/)
      expect(failed.json()).toMatchObject({ status: 503 })
      expect(await written(key)).toBe(0)
      await fix()
      const retried = await post(key, customer)
      expect(retried.statusCode).toBe(201)
      expect(retried.headers['idempotent-replayed']).toBeUndefined()
      expect(runs.get(key)).toBe(2)
      expect(await written(key)).toBe(1)
      const replayed = await post(key, customer)
      expect(replayed.headers['idempotent-replayed']).toBe('true')
      expect(runs.get(key)).toBe(2)
    }

    if (database.deferred) {
      it('a foreign key checked at COMMIT: 503, no order, the key free, and the retry runs once once the customer exists', async () => {
        await ready
        await expectRefusedThenRetried('deferred', 7, async () => { await knex(customers).insert({ id: 7 }) })
      })
    }

    if (database.killer !== undefined && database.admin === undefined) {
      it('COMMIT went through but its answer was lost with the connection: 503, never the success; the retry gets the stored answer, the handler not run again', async () => {
        await ready
        const connection = database.config.connection as { host: string, port: number }
        const proxy = await startProxy(connection.host, connection.port)
        const proxied = knexFactory({ ...database.config, connection: { ...connection, host: '127.0.0.1', port: proxy.port } })
        try {
          await knex(customers).insert({ id: 9 })
          const lost = await answerLost(proxied, proxy)
          const first = await lost.post('lost', 9)
          expect(first.statusCode).toBe(503)
          expect(first.headers['content-type']).toMatch(/^application\/problem\+json/)
          expect(await written('lost')).toBe(1)
          const retried = await post('lost', 9)
          expect(retried.statusCode).toBe(201)
          expect(retried.headers['idempotent-replayed']).toBe('true')
          expect(lost.runs()).toBe(1)
          await lost.close()
        } finally {
          await proxied.destroy()
          await proxy.close()
        }
      })
    }

    /**
     * A second app on the same table through `proxy`, whose COMMIT reaches the server while its
     * answer is held back; once the commit is visible on the server, every connection is cut.
     */
    async function answerLost (proxied: Knex, proxy: Proxy): Promise<{ post: typeof post, runs: () => number, close: () => Promise<void> }> {
      class Losing extends KnexStorage {
        override async transaction (options?: TransactionOptions): Promise<StorageTransaction> {
          const inner = await super.transaction(options)
          return {
            ...inner,
            commit: async () => {
              proxy.mute()
              const committing = inner.commit()
              committing.catch(() => {})
              for (let i = 0; i < 500 && await written('lost') === 0; i++) await new Promise((resolve) => setTimeout(resolve, 10))
              proxy.cut()
              try {
                await committing
              } finally {
                proxy.restore()
              }
            }
          }
        }
      }
      const other = Fastify()
      let ran = 0
      await other.register(idempotency, { storage: new Losing({ knex: proxied, tableName: table, createTable: true }), transaction: true })
      other.setErrorHandler(idempotencyErrorHandler())
      other.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        ran++
        const key = request.headers['idempotency-key'] as string
        await transactionOf(request)(orders).insert({ id: 1000, idem_key: key, customer_id: (request.body as { customer: number }).customer })
        reply.code(201)
        return { ordered: key }
      })
      await other.ready()
      return {
        post: async (key, customer) => await other.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { customer } }),
        runs: () => ran,
        close: async () => { await other.close() }
      }
    }

    if (database.killer !== undefined) {
      it('the transaction\'s connection killed before COMMIT: 503, no order, the key free, and the retry runs once', async () => {
        await ready
        await knex(customers).insert({ id: 8 })
        killAtCommit.add('killed')
        await expectRefusedThenRetried('killed', 8, async () => { killAtCommit.delete('killed') })
      })
    }
  })
}
