/**
 * A handler's statement whose wait for another transaction's row lock is cut short by the
 * database's own limit, as teams set it for their roles: PostgreSQL's `lock_timeout` (here
 * `ALTER ROLE ... SET lock_timeout`, on a role of this file's own with a schema of its own; 55P03),
 * MariaDB's `innodb_lock_wait_timeout` (a session's, set in the pool's afterCreate; 1205). Either is
 * a conflict with another transaction: answered 503 with `Retry-After`, nothing kept, the key free,
 * and the retry, once the other transaction has ended, commits once. On PostgreSQL it was answered
 * 500 (the handler's error), without `Retry-After`, where MariaDB answered 503.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, transactionOf } from '../lib/knex.js'
import { newKey } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { dropApp } from './helpers/transaction-matrix.js'
import { pgRoleWith } from './helpers/pg-role.js'

const stamp = `${process.pid}_${Date.now().toString(36)}`
const postgres = await service(POSTGRES)
const mariadb = await service(MARIADB)
const role = pgRoleWith('idem_lock_timeout', "lock_timeout = '200ms'", postgres)

const servers: Array<{ name: string, availability: Availability, connect: () => Knex }> = [
  { name: 'PostgreSQL, a role\'s lock_timeout', availability: postgres, connect: () => knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } }) },
  {
    name: 'MariaDB, a session\'s innodb_lock_wait_timeout',
    availability: mariadb,
    connect: () => knexFactory({
      client: 'mysql2',
      connection: mysqlConnection,
      pool: { min: 0, max: 10, afterCreate: (connection: { query: (sql: string, done: (error: Error | null) => void) => void }, done: (error: Error | null, connection: unknown) => void) => { connection.query('SET SESSION innodb_lock_wait_timeout = 1', (error) => done(error, connection)) } }
    })
  }
]

for (const server of servers) {
  describe.skipIf(!server.availability.available)(`${server.name} that cuts a handler's lock wait short${server.availability.reason}`, () => {
    const accounts = `lock_waits_${stamp}_accounts`
    const table = `lock_waits_${stamp}`
    let knex: Knex
    let app: FastifyInstance | undefined
    let url = ''
    let runs = 0
    beforeAll(async () => {
      knex = server.connect()
      await knex.schema.createTable(accounts, (t) => { t.string('id').primary(); t.integer('balance').notNullable() })
      await knex(accounts).insert({ id: 'A', balance: 0 })
      app = Fastify()
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }) })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/deposits', { config: { idempotency: { required: true, transaction: true } } }, async (request, reply) => {
        runs++
        await transactionOf(request)(accounts).where({ id: 'A' }).increment('balance', 10)
        return await reply.code(201).send({ ok: true })
      })
      url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/deposits`
    })
    afterAll(async () => { await dropApp({ app, knex, tables: [accounts], storeTable: table }) })

    it('answers 503 with Retry-After, keeps nothing, frees the key, and the retry commits once', async () => {
      // Another transaction holds the row for longer than the limit.
      const holder = await knex.transaction()
      await holder(accounts).where({ id: 'A' }).update({ balance: 0 })
      const key = newKey('deposit')
      const first = await postWithKey(url, key)
      const during = await knex(accounts).where({ id: 'A' }).first() as { balance: number }
      await holder.rollback()
      const retry = await postWithKey(url, key)
      const replay = await postWithKey(url, key)
      const after = await knex(accounts).where({ id: 'A' }).first() as { balance: number }
      expect({ status: first.status, retryAfter: first.headers.get('retry-after'), during: during.balance, retry: retry.status, replayed: replay.replayed, balance: after.balance, runs })
        .toEqual({ status: 503, retryAfter: '1', during: 0, retry: 201, replayed: true, balance: 10, runs: 2 })
    })
  })
}
