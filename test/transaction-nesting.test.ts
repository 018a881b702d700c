/**
 * Transaction mode where the store has one connection (SQLite through knex, or a knex pool of one):
 * the request's transaction holds it while the function or handler runs. A job longer than
 * lockTimeout must keep its lease (renewed through that transaction) and commit once; before, every
 * attempt was rolled back as "lease-lost" and ran again. A `run()` inside it, whose first store call
 * would wait for that same connection until storeTimeout, must be refused at once, saying why.
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../lib/knex.js'
import { createIdempotency } from '../lib/standalone.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { scaled } from './helpers/pace.js'

const LOCK_TIMEOUT = scaled(600)
/** Far above a refusal: a call that waits for it waited for the connection. */
const STORE_TIMEOUT = scaled(6000)
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-trx-nesting-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

const stores: Array<{ name: string, availability: Availability, connect: () => Knex }> = [
  { name: 'SQLite', availability: { available: true, reason: '' }, connect: () => knexFactory({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'jobs.db') }, useNullAsDefault: true }) },
  { name: 'PostgreSQL, a pool of one', availability: await service(POSTGRES), connect: () => knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } }) },
  { name: 'MariaDB, a pool of one', availability: await service(MARIADB), connect: () => knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 } }) }
]

for (const [index, store] of stores.entries()) {
  describe.skipIf(!store.availability.available)(`transaction mode on ${store.name}${store.availability.reason}`, () => {
    const table = `trx_nest_${process.pid}_${Date.now().toString(36)}_${index}`
    const effects = `${table}_effects`
    const knex = store.connect()
    const storage = new KnexStorage({ knex, tableName: table, createTable: true })
    const jobs = createIdempotency({ storage, transaction: true, lockTimeout: LOCK_TIMEOUT, storeTimeout: STORE_TIMEOUT })
    const ready = (async () => { await knex.schema.createTable(effects, (t) => { t.increments('id'); t.string('job', 200) }) })()
    afterAll(async () => {
      await jobs.close()
      await knex.schema.dropTableIfExists(effects)
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
    })
    const effectsOf = async (job: string): Promise<number> => Number((await knex(effects).where({ job }).count({ n: '*' }))[0]!.n)

    it('run(): a job longer than lockTimeout keeps its lease, runs once and commits', async () => {
      await ready
      let runs = 0
      const result = await jobs.run('long-job', {}, async ({ transaction }) => {
        runs++
        await (transaction as Knex.Transaction)(effects).insert({ job: 'long-job' })
        // The job takes this long: the scenario, not a race.
        await sleep(Math.round(LOCK_TIMEOUT * 1.8))
        return { done: true }
      })
      expect(result).toEqual({ done: true })
      expect(runs).toBe(1)
      expect(await effectsOf('long-job')).toBe(1)
      expect(await jobs.run('long-job', {}, () => ({ done: false }))).toEqual({ done: true })
    })

    it('run() inside a transaction-mode run on the same store is refused at once with a TypeError that says why', async () => {
      await ready
      const startedAt = Date.now()
      let inner = 0
      const outer = jobs.run('outer-job', {}, async ({ transaction }) => {
        await (transaction as Knex.Transaction)(effects).insert({ job: 'outer-job' })
        return await jobs.run('inner-job', {}, () => ++inner)
      })
      await expect(outer).rejects.toThrow(TypeError)
      await expect(outer).rejects.toThrow(/only connection/)
      expect(Date.now() - startedAt).toBeLessThan(STORE_TIMEOUT / 3)
      expect(inner).toBe(0)
      expect(await effectsOf('outer-job')).toBe(0)
      // Nothing is left behind: the outer key is free, and runs once its function no longer nests.
      expect(await jobs.run('outer-job', {}, () => 'alone')).toBe('alone')
    })

    it('a transaction-mode route whose handler calls run() on the same store is answered at once, without waiting for storeTimeout', async () => {
      await ready
      const app = Fastify()
      await app.register(idempotency, { storage, transaction: true, storeTimeout: STORE_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      let inner = 0
      app.post('/nested', { config: { idempotency: true } }, async (request) => {
        await transactionOf(request)(effects).insert({ job: 'nested-route' })
        return await app.idempotency.run('inner-of-route', {}, () => ++inner)
      })
      const startedAt = Date.now()
      const res = await app.inject({ method: 'POST', url: '/nested', headers: { 'idempotency-key': 'nested-1' }, payload: {} })
      expect(res.statusCode).toBe(500)
      expect(Date.now() - startedAt).toBeLessThan(STORE_TIMEOUT / 3)
      expect(inner).toBe(0)
      expect(await effectsOf('nested-route')).toBe(0)
      await app.close()
    })
  })
}
