/**
 * A lease is measured from when it is written. With a pool of one connection and the key's row
 * locked by another session for longer than `lockTimeout`, the first request's `begin` waits for
 * the lock; the lease it then writes must still run its full length, so a duplicate sent while the
 * first handler runs gets 409 (or the replay), never a second run. Over real HTTP, on each SQL
 * server where a row lock can make a statement wait.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../lib/knex.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service } from './helpers/services.js'
import { postWithKey } from './helpers/http-client.js'

const LEASE = 600
/** Longer than the lease: under the old client-side clock the lease was written already lapsed. */
const LOCK_HELD = 1500
const HANDLER = 1200
const stamp = `${process.pid}_${Date.now()}`

const servers = [
  { name: 'postgres', availability: await service(POSTGRES), client: 'pg' as const, connection: pgConnection },
  { name: 'mariadb', availability: await service(MARIADB), client: 'mysql2' as const, connection: mysqlConnection }
]

for (const server of servers) {
  describe.skipIf(!server.availability.available)(`a lease written after a long row-lock wait on ${server.name}${server.availability.reason}`, () => {
    const table = `lease_clock_${server.name}_${stamp}`
    let knex: Knex
    let other: Knex
    let app: FastifyInstance
    let url: string
    let runs = 0
    let started = false

    beforeAll(async () => {
      knex = knexFactory({ client: server.client, connection: server.connection, pool: { min: 0, max: 1 } })
      other = knexFactory({ client: server.client, connection: server.connection, pool: { min: 0, max: 1 } })
      const storage = new KnexStorage({ knex, tableName: table, createTable: true })
      app = Fastify()
      await app.register(idempotency, { storage, lockTimeout: LEASE })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/charges', { config: { idempotency: true } }, async (_request, reply) => {
        runs++
        started = true
        await sleep(HANDLER)
        reply.code(201)
        return { run: runs }
      })
      url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/charges`
    })
    afterAll(async () => {
      await app.close()
      await dropIdempotencyTable(knex, table).catch(() => {})
      await knex.destroy()
      await other.destroy()
    })

    const post = async (key: string): Promise<{ status: number, body: string }> => {
      const { status, body } = await postWithKey(url, key, '{"amount":100}')
      return { status, body }
    }

    it('lets no duplicate run while the first handler runs', async () => {
      const key = `locked-${stamp}`
      // The key's row exists and has expired, so taking it means writing that row (which waits for
      // its lock on both servers).
      expect((await post(key)).status).toBe(201)
      await other(table).where('idempotency_key', Buffer.from(key)).update({ expires_at: 1 })
      runs = 0
      started = false
      const trx = await other.transaction()
      let first: Promise<{ status: number, body: string }>
      try {
        await trx(table).where('idempotency_key', Buffer.from(key)).forUpdate().select('idempotency_key')
        first = post(key)
        await sleep(LOCK_HELD)
      } finally {
        await trx.rollback()
      }
      await vi.waitFor(() => { expect(started).toBe(true) }, { timeout: 5000, interval: 10 })
      // Well inside the lease as written, well past the lease as measured before the wait.
      await sleep(LEASE / 4)
      const duplicate = await post(key)
      expect([409, 201]).toContain(duplicate.status)
      expect((await first).status).toBe(201)
      expect(runs).toBe(1)
      const retry = await post(key)
      expect(retry).toEqual({ status: 201, body: JSON.stringify({ run: 1 }) })
    })
  })
}
