/**
 * A migration beside transaction mode: it locks the table the handlers write (as ALTER TABLE does)
 * for longer than lockTimeout, so each handler's statement waits for it. The leases must hold
 * however the store keeps them: renewed beside the transaction (read committed), or held by the
 * transaction, whose connection is busy with the waiting statement meanwhile (PostgreSQL's
 * repeatable read and serializable, MariaDB with innodb_snapshot_isolation). Every request runs once
 * and commits once the migration ends.
 */
import { setImmediate, setTimeout as sleep } from 'node:timers/promises'
import { afterAll, describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency, { idempotencyErrorHandler, type IsolationLevel } from '../lib/index.js'
import { KnexStorage, transactionOf } from '../lib/knex.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { newKey } from './helpers/app.js'
import { scaled } from './helpers/pace.js'
import { dropApp } from './helpers/transaction-matrix.js'

const LOCK_TIMEOUT = scaled(400)
const stamp = `${process.pid}_${Date.now().toString(36)}`
type Connection = { query: (sql: string, done: (error: Error | null) => void) => void }
const snapshotIsolation = { afterCreate: (connection: Connection, done: (error: Error | null, connection: unknown) => void) => { connection.query('SET SESSION innodb_snapshot_isolation = ON', (error) => { done(error, connection) }) } }

interface Server {
  name: string
  availability: Availability
  config: Knex.Config
  /** The levels the routes name; `default`: none, the session's. */
  levels: Array<IsolationLevel | 'default'>
  /** Lock `table` as a migration would, on `migration`'s one connection; resolves with how to end it. */
  lock: (migration: Knex, table: string) => Promise<() => Promise<void>>
  /** Whether a statement on `table` waits for that lock. */
  waiting: (observer: Knex, table: string) => Promise<boolean>
}

const servers: Server[] = [
  {
    name: 'PostgreSQL',
    availability: await service(POSTGRES),
    config: { client: 'pg', connection: pgConnection },
    levels: ['read committed', 'repeatable read', 'serializable'],
    lock: async (migration, table) => {
      const trx = await migration.transaction()
      await trx.raw('LOCK TABLE ?? IN ACCESS EXCLUSIVE MODE', [table])
      return async () => { await trx.commit() }
    },
    waiting: async (observer, table) => (await observer.raw("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE ?", [`insert into "${table}"%`])).rows.length > 0
  },
  {
    name: 'MariaDB',
    availability: await service(MARIADB),
    config: { client: 'mysql2', connection: mysqlConnection },
    levels: ['read committed', 'repeatable read', 'serializable'],
    lock: async (migration, table) => {
      await migration.raw('LOCK TABLES ?? WRITE', [table])
      return async () => { await migration.raw('UNLOCK TABLES') }
    },
    waiting: async (observer, table) => (await observer.raw("SELECT 1 FROM information_schema.processlist WHERE state LIKE 'Waiting for table%' AND info LIKE ?", [`insert into \`${table}\`%`]))[0].length > 0
  },
  {
    name: 'MariaDB with innodb_snapshot_isolation',
    availability: await service(MARIADB),
    config: { client: 'mysql2', connection: mysqlConnection, pool: snapshotIsolation },
    levels: ['repeatable read', 'default'],
    lock: async (migration, table) => {
      await migration.raw('LOCK TABLES ?? WRITE', [table])
      return async () => { await migration.raw('UNLOCK TABLES') }
    },
    waiting: async (observer, table) => (await observer.raw("SELECT 1 FROM information_schema.processlist WHERE state LIKE 'Waiting for table%' AND info LIKE ?", [`insert into \`${table}\`%`]))[0].length > 0
  }
]

for (const [index, server] of servers.entries()) {
  describe.skipIf(!server.availability.available)(`a migration locks the handlers' table for longer than lockTimeout, on ${server.name}${server.availability.reason}`, () => {
    const knex = knexFactory(server.config)
    const migration = knexFactory({ ...server.config, pool: { min: 1, max: 1 } })
    const observer = knexFactory({ ...server.config, pool: { min: 0, max: 1 } })
    const table = `trx_migration_${stamp}_${index}`
    const orders = `${table}_orders`
    const runs = new Map<string, number>()
    const ready = (async () => {
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 200) })
      const app = Fastify()
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), lockTimeout: LOCK_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      for (const level of server.levels) {
        app.post(`/${level.replace(' ', '-')}`, { config: { idempotency: { transaction: level === 'default' ? true : { isolationLevel: level } } } }, async (request, reply) => {
          const key = request.idempotency!.key
          runs.set(key, (runs.get(key) ?? 0) + 1)
          const trx = transactionOf(request)
          // A read first: the snapshot predates what the lease's renewals would write.
          await trx.raw('SELECT 1 AS one')
          await trx(orders).insert({ idem_key: key })
          return reply.code(201).send({ key })
        })
      }
      await app.ready()
      return app
    })()
    afterAll(async () => { await dropApp({ app: await ready, knex, tables: [orders], storeTable: table, others: [migration, observer] }) })

    for (const level of server.levels) {
      it(`${level === 'default' ? 'the session\'s level (repeatable read)' : level}: three requests wait for it, each runs once and commits`, async () => {
        const app = await ready
        const keys = [newKey('migrated'), newKey('migrated'), newKey('migrated')]
        const unlock = await server.lock(migration, orders)
        const answers = Promise.all(keys.map((key) => app.inject({ method: 'POST', url: `/${level.replace(' ', '-')}`, headers: { 'idempotency-key': key }, payload: {} })))
        while (!await server.waiting(observer, orders)) await setImmediate()
        // The migration runs this long: past the leases the requests took.
        await sleep(LOCK_TIMEOUT * 2)
        await unlock()
        expect((await answers).map((answer) => `${answer.statusCode} ${answer.body}`)).toEqual(keys.map((key) => `201 ${JSON.stringify({ key })}`))
        for (const key of keys) {
          expect(runs.get(key)).toBe(1)
          expect(await knex(orders).where({ idem_key: key }).count({ n: '*' })).toEqual([{ n: server.name === 'PostgreSQL' ? '1' : 1 }])
        }
      })
    }
  })
}
