/**
 * PostgreSQL, directly and through PgBouncer (transaction and session pooling), over real HTTP:
 * another transaction holds rows of the table, and requests for those keys fill knex's pool with
 * statements waiting for the row locks. Requests for other keys must still be served, within the
 * store's `statementTimeout`, not refused with 503 until the other transaction ends.
 *
 * Through a pooler a cancel by process id reaches nothing (the id the client holds is the
 * pooler's own); the store bounds its statements on the server instead.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../lib/knex.js'
import { pgConnection } from './helpers/services.js'
import { postWithKey } from './helpers/http-client.js'
import { postgresConnections } from './helpers/knex-targets.js'

/** knex's pool, filled by the requests for locked keys. */
const POOL = 4
const STATEMENT_TIMEOUT = 1500
/** Far above the statement timeout: a request for another key that waits for it is a failure. */
const STORE_TIMEOUT = 8000
const stamp = `${process.pid}_${Date.now().toString(36)}`

for (const connection of await postgresConnections()) {
  describe.skipIf(!connection.availability.available)(`PostgreSQL ${connection.name}: rows locked by another transaction${connection.availability.reason}`, () => {
    const direct = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
    const instances: Knex[] = [direct]
    const tables: string[] = []
    afterAll(async () => {
      for (const table of tables) await dropIdempotencyTable(direct, table)
      for (const knex of instances) await knex.destroy()
    })

    it('serves requests for other keys while the locked keys\' statements wait, and refuses those with 503 at statementTimeout', async () => {
      const table = `locked_pg_${stamp}_${tables.length}`
      tables.push(table)
      const knex = knexFactory({ client: 'pg', connection: connection.settings, pool: { min: 0, max: POOL } })
      instances.push(knex)
      const storage = new KnexStorage({ knex, tableName: table, createTable: true, statementTimeout: STATEMENT_TIMEOUT })
      const app = Fastify()
      await app.register(idempotency, { storage, storeTimeout: STORE_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      const runs = new Map<string, number>()
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.headers['idempotency-key'] as string
        runs.set(key, (runs.get(key) ?? 0) + 1)
        reply.code(201)
        return { key }
      })
      const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
      const post = async (key: string): Promise<number> => (await postWithKey(url, key, '{}')).status
      try {
        expect(await post('warm')).toBe(201)
        // Rows of lapsed leases (free to take over), which a batch job's transaction holds.
        const locked = Array.from({ length: POOL }, (_, i) => `locked-${i}`)
        await direct(table).insert(locked.map((key) => ({ idempotency_key: Buffer.from(key), fingerprint: 'x', state: 'in_flight', token: 't', lease_end: 1, expires_at: 1 })))
        const holder = await direct.transaction()
        try {
          await holder(table).select('idempotency_key').whereIn('idempotency_key', locked.map((key) => Buffer.from(key))).forUpdate()
          const lockedAnswers = Promise.all(locked.map(post))
          // Every pooled connection now waits for a row lock.
          await until(async () => Number((await direct.raw("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE ?", [`%${table}%`])).rows[0].n) >= POOL)
          const others = Array.from({ length: 6 }, (_, i) => `other-${i}`)
          const started = Date.now()
          expect(await Promise.all(others.map(post))).toEqual(others.map(() => 201))
          expect(Date.now() - started).toBeLessThan(STORE_TIMEOUT)
          expect(await lockedAnswers).toEqual(locked.map(() => 503))
          for (const key of [...locked, ...others]) expect(runs.get(key) ?? 0, key).toBe(locked.includes(key) ? 0 : 1)
        } finally {
          await holder.rollback()
        }
        // Once the other transaction has ended, the locked keys run, once.
        expect(await Promise.all(locked.map(post))).toEqual(locked.map(() => 201))
        for (const key of locked) expect(runs.get(key), key).toBe(1)
      } finally {
        await app.close()
      }
    })
  })
}

/** Polls `condition` until it holds (a few seconds at most). */
async function until (condition: () => Promise<boolean>): Promise<void> {
  for (let round = 0; round < 500; round++) {
    if (await condition()) return
    await sleep(20)
  }
  throw new Error('the condition never held')
}
