/**
 * Transaction mode with recovery points on a knex pool of one connection (`pool: { max: 1 }`,
 * what docs/frameworks/aws-lambda.md suggests for a function): the request's transaction holds the
 * only connection, and its step waits for a second one that never comes. Before, every such
 * request (even one alone) waited for storeTimeout and got 503, and `run` threw
 * IdempotencyStoreUnavailableError after it; SQLite, whose knex pool is one connection too, refuses
 * the step at once with a TypeError that says why. A pool of one on PostgreSQL or MariaDB must be
 * refused the same way, at once.
 */
import { afterAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../lib/knex.js'
import { createIdempotency } from '../lib/standalone.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { postWithKey } from './helpers/http-client.js'

/** Far above a refusal: a request that waits for it waited for a connection. */
const STORE_TIMEOUT = 8000
const stamp = `${process.pid}_${Date.now().toString(36)}`

const databases: Array<{ name: string, availability: Availability, config: Knex.Config }> = [
  { name: 'PostgreSQL', availability: await service(POSTGRES), config: { client: 'pg', connection: pgConnection } },
  { name: 'MariaDB', availability: await service(MARIADB), config: { client: 'mysql2', connection: mysqlConnection } }
]

for (const [index, database] of databases.entries()) {
  describe.skipIf(!database.availability.available)(`transaction mode with a step on ${database.name}, a pool of one connection${database.availability.reason}`, () => {
    const knex = knexFactory({ ...database.config, pool: { min: 0, max: 1 } })
    const table = `trial_pool1_${stamp}_${index}`
    const orders = `${table}_orders`
    const storage = new KnexStorage({ knex, tableName: table, createTable: true })
    const app = Fastify()
    let steps = 0
    afterAll(async () => {
      await app.close()
      await knex.schema.dropTableIfExists(orders)
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
    })

    const ready = (async () => {
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 100) })
      await app.register(idempotency, { storage, transaction: true, storeTimeout: STORE_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        await transactionOf(request)(orders).insert({ idem_key: request.headers['idempotency-key'] as string })
        await request.idempotency!.step('charge', () => ++steps)
        reply.code(201)
        return {}
      })
      return `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
    })()

    it('refuses the step at once, as on SQLite, instead of a 503 after storeTimeout', async () => {
      const url = await ready
      const started = Date.now()
      const { status } = await postWithKey(url, 'one-alone', '{}')
      expect(Date.now() - started).toBeLessThan(STORE_TIMEOUT / 4)
      expect(status).toBe(500)
      expect(steps).toBe(0)
      expect(await knex(orders).count({ n: '*' })).toEqual([{ n: database.name === 'PostgreSQL' ? '0' : 0 }])
    })

    it('run(): throws the TypeError naming why, at once', async () => {
      await ready
      const jobs = createIdempotency({ storage, transaction: true, storeTimeout: STORE_TIMEOUT })
      const started = Date.now()
      await expect(jobs.run('job-1', {}, async (context) => await context.step('charge', () => ++steps))).rejects.toThrow(TypeError)
      expect(Date.now() - started).toBeLessThan(STORE_TIMEOUT / 4)
      expect(steps).toBe(0)
      await jobs.close()
    })
  })
}
