/**
 * A KnexStorage that cannot work fails `app.ready()` with one line that says why (its table
 * missing without createTable, its database missing or unreachable), instead of starting an app
 * that answers 503 to every guarded request; `checkStore: false` starts it anyway. A store whose
 * check does not answer is given up on at `storeTimeout`.
 */
import { createServer } from 'node:net'
import { afterAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyOptions } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../lib/knex.js'
import { knexTargets, uniqueTable } from './helpers/knex-targets.js'
import { pgConnection } from './helpers/services.js'

async function start (options: IdempotencyOptions): Promise<{ ready: Promise<unknown>, close: () => Promise<void>, post: () => Promise<number> }> {
  const app = Fastify()
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { reply.code(201); return { ok: true } })
  const ready = new Promise((resolve, reject) => { app.ready().then(resolve, reject) })
  ready.catch(() => {})
  return {
    ready,
    close: async () => { await app.close() },
    post: async () => (await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'k' }, payload: {} })).statusCode
  }
}

/** A loopback port nothing listens on. */
async function closedPort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as { port: number }
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return port
}

for (const target of knexTargets().filter((candidate) => candidate.wrap === undefined)) {
  describe.skipIf(!target.availability.available)(`KnexStorage at start-up on ${target.name}${target.availability.reason}`, () => {
    const knex = knexFactory(target.config())
    const tables: string[] = []
    afterAll(async () => {
      for (const table of tables) await dropIdempotencyTable(knex, table)
      await knex.destroy()
    })

    it('a missing table without createTable fails app.ready() in one line that says how to make it', async () => {
      const table = uniqueTable()
      const app = await start({ storage: new KnexStorage({ knex, tableName: table }) })
      const error = await app.ready.then(() => null, (failure: Error) => failure)
      expect(error?.message).toBe(`fastify-idempotency: the store cannot work: KnexStorage: the table "${table}" does not exist: create it with createTable: true, or beforehand with createIdempotencyTable (in a migration) (checkStore: false starts the app anyway)`)
    })

    it('with checkStore: false the app starts, and answers 503 until the table exists', async () => {
      const table = uniqueTable()
      const app = await start({ storage: new KnexStorage({ knex, tableName: table }), checkStore: false })
      try {
        await app.ready
        expect(await app.post()).toBe(503)
      } finally {
        await app.close()
      }
    })

    it('with createTable the check makes the table, and the app serves', async () => {
      const table = uniqueTable()
      tables.push(table)
      const app = await start({ storage: new KnexStorage({ knex, tableName: table, createTable: true }) })
      try {
        await app.ready
        expect(await knex.schema.hasTable(table)).toBe(true)
        expect(await app.post()).toBe(201)
      } finally {
        await app.close()
      }
    })
  })
}

describe('KnexStorage at start-up, when the database cannot be used', () => {
  const instances: Knex[] = []
  afterAll(async () => { for (const knex of instances) await knex.destroy() })
  const connect = (config: Knex.Config): Knex => { const knex = knexFactory(config); instances.push(knex); return knex }

  it('an unreachable server fails app.ready() at once, with the driver\'s reason, not after knex\'s own 60 s', async () => {
    const port = await closedPort()
    for (const client of ['pg', 'mysql2']) {
      const started = Date.now()
      const app = await start({ storage: new KnexStorage({ knex: connect({ client, connection: { host: '127.0.0.1', port, user: 'x', database: 'x' } }) }) })
      const error = await app.ready.then(() => null, (failure: Error) => failure)
      expect(error?.message).toMatch(new RegExp(`^fastify-idempotency: the store cannot work: KnexStorage: the database cannot be used: connect ECONNREFUSED 127\\.0\\.0\\.1:${port} \\(ECONNREFUSED\\)`))
      expect(error?.message).not.toContain('\n')
      expect(Date.now() - started).toBeLessThan(4000)
    }
  })

  it.skipIf(knexTargets()[0]!.availability.available !== true)('a database that does not exist fails app.ready() with the server\'s words (PostgreSQL)', async () => {
    const app = await start({ storage: new KnexStorage({ knex: connect({ client: 'pg', connection: { ...pgConnection, database: `missing_${process.pid}` } }) }) })
    const error = await app.ready.then(() => null, (failure: Error) => failure)
    expect(error?.message).toBe(`fastify-idempotency: the store cannot work: KnexStorage: the database cannot be used: database "missing_${process.pid}" does not exist (3D000): check that the database runs, and the connection settings knex was given (host, port, user, password, database) (checkStore: false starts the app anyway)`)
  })

  it('a store whose check does not answer is given up on at storeTimeout; a store without a check starts as before', async () => {
    const hung = Object.assign(new MemoryStorage(), { ready: async () => await new Promise<void>(() => {}) })
    const app = await start({ storage: hung, storeTimeout: 100 })
    const error = await app.ready.then(() => null, (failure: Error) => failure)
    expect(error?.message).toMatch(/^fastify-idempotency: the store cannot work: .*100 ms/)
    const plain = await start({ storage: new MemoryStorage() })
    await plain.ready
    expect(await plain.post()).toBe(201)
    await plain.close()
  })
})
