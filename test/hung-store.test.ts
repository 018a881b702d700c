/**
 * A store that accepts connections and never answers, on each real store through a proxy that
 * hangs, and Redis down under ioredis's default options (which queue commands and reconnect for
 * over a minute): the client gets 503 problem+json within storeTimeout, and the server keeps
 * answering other requests meanwhile.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import type { RedisOptions } from 'ioredis'
import knexFactory, { type Knex } from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, type IdempotencyStorage } from '../lib/index.js'
import { KnexStorage } from '../lib/knex.js'
import { dropIdempotencyTable } from '../lib/knex.js'
import { MARIADB, POSTGRES, REDIS, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { startProxy, type Proxy } from './helpers/proxy.js'
import { proxiedKnex, proxiedRedis } from './helpers/proxied-stores.js'
import { newKey } from './helpers/app.js'
import { resendWhile } from './helpers/resend.js'
import { scaled } from './helpers/pace.js'

/** 300 ms on a quiet machine (helpers/pace.ts): the start-up check and the first request through the proxy must fit in it. */
const STORE_TIMEOUT = scaled(300)
/** storeTimeout, the deadline check's granularity (an eighth of it), and time to answer. */
const IN_TIME = STORE_TIMEOUT * 9 / 8 + 400
const stamp = `${process.pid}_${Date.now()}`

interface Target {
  name: string
  availability: Availability
  server: { host: string, port: number }
  connect: (port: number) => { storage: IdempotencyStorage, dispose: () => Promise<void> }
}

function redisTarget (name: string, availability: Availability, options: RedisOptions): Target {
  return { name, availability, server: REDIS, connect: (port) => proxiedRedis(port, `hung:${stamp}:${name}:`, options) }
}

function sqlTarget (name: string, availability: Availability, client: 'pg' | 'mysql2', base: Record<string, unknown>, config: typeof POSTGRES): Target {
  return { name, availability, server: config, connect: (port) => proxiedKnex(port, client, base, `hung_${name}_${stamp}`) }
}

const [redis, postgres, mariadb] = await Promise.all([service(REDIS), service(POSTGRES), service(MARIADB)])
const targets: Target[] = [
  // ioredis's defaults: an offline queue and 20 reconnection attempts per command.
  redisTarget('redis, default client options', redis, {}),
  redisTarget('redis, fail-fast options', redis, { enableAutoPipelining: true, maxRetriesPerRequest: 1, commandTimeout: 2000 }),
  sqlTarget('postgres', postgres, 'pg', pgConnection, POSTGRES),
  sqlTarget('mariadb', mariadb, 'mysql2', mysqlConnection, MARIADB)
]

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`a hung ${target.name}${target.availability.reason}`, () => {
    let proxy: Proxy
    let storage: IdempotencyStorage
    let dispose: () => Promise<void>
    let app: FastifyInstance
    let runs = 0

    beforeAll(async () => {
      proxy = await startProxy(target.server.host, target.server.port)
      ;({ storage, dispose } = target.connect(proxy.port))
      app = Fastify()
      await app.register(idempotency, { storage, storeTimeout: STORE_TIMEOUT })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; reply.code(201); return { run: runs } })
      app.get('/health', async () => ({ ok: true }))
      await app.ready()
      // The store works before it hangs (and SQL stores create their table).
      expect((await post(newKey())).statusCode).toBe(201)
    })
    afterAll(async () => {
      await app.close()
      proxy.restore()
      await dispose()
      await proxy.close()
    })

    const post = (key: string) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } })

    for (const mode of ['hang', 'cut'] as const) {
      it(`answers 503 problem+json within storeTimeout when the server ${mode === 'hang' ? 'accepts connections and never answers' : 'refuses connections'}, and serves other requests meanwhile`, async () => {
        const before = runs
        proxy[mode]()
        try {
          const started = Date.now()
          const guarded = Array.from({ length: 5 }, () => post(newKey()).then((res) => ({ res, ms: Date.now() - started })))
          const health = await app.inject('/health')
          const healthMs = Date.now() - started
          expect(health.statusCode).toBe(200)
          expect(healthMs).toBeLessThan(STORE_TIMEOUT)
          for (const { res, ms } of await Promise.all(guarded)) {
            expect(res.statusCode).toBe(503)
            expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
            expect(ms).toBeLessThan(IN_TIME)
          }
          expect(runs).toBe(before)
        } finally {
          proxy.restore()
        }
        // And it recovers without a restart once the server answers again.
        const res = await resendWhile([503], () => post(newKey()), { attempts: 40, pause: 100 })
        expect(res.statusCode).toBe(201)
      })
    }
  })
}

const sqlServers = [
  { name: 'postgres', availability: postgres, client: 'pg' as const, connection: pgConnection },
  { name: 'mariadb', availability: mariadb, client: 'mysql2' as const, connection: mysqlConnection }
]

for (const server of sqlServers) {
  describe.skipIf(!server.availability.available)(`rows locked by another session on ${server.name}${server.availability.reason}`, () => {
    const table = `locked_${server.name}_${stamp}`
    let knex: Knex
    let other: Knex
    let app: FastifyInstance
    beforeAll(async () => {
      // knex's default pool (10 connections): ten locked rows used to take every one of them.
      knex = knexFactory({ client: server.client, connection: server.connection })
      other = knexFactory({ client: server.client, connection: server.connection, pool: { min: 0, max: 1 } })
      const storage = new KnexStorage({ knex, tableName: table, createTable: true, statementTimeout: 300 })
      app = Fastify()
      await app.register(idempotency, { storage, storeTimeout: 1000 })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { reply.code(201); return { ok: true } })
      await app.ready()
    })
    afterAll(async () => {
      await app.close()
      await dropIdempotencyTable(knex, table).catch(() => {})
      await knex.destroy()
      await other.destroy()
    })

    const post = (key: string) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } })

    it('answers the locked keys 503 in time, and keeps serving other keys: a lock never holds a pooled connection', async () => {
      const locked = Array.from({ length: 10 }, (_, i) => `locked-${i}-${stamp}`)
      // Rows whose entries have expired, so taking the key means writing the row (on PostgreSQL a
      // live row is read without waiting for its lock; MariaDB's upsert always waits).
      for (const key of locked) expect((await post(key)).statusCode).toBe(201)
      await other(table).whereIn('idempotency_key', locked.map((key) => Buffer.from(key))).update({ expires_at: 1 })
      const trx = await other.transaction()
      try {
        // Row by row, as a long transaction that touched these rows would hold them. (One
        // `IN (...) FOR UPDATE` makes MariaDB lock the gaps between them too, which blocks every
        // insert: a table lock in effect.)
        for (const key of locked) await trx(table).where('idempotency_key', Buffer.from(key)).forUpdate().select('idempotency_key')
        const started = Date.now()
        const blocked = locked.map((key) => post(key).then((res) => ({ status: res.statusCode, ms: Date.now() - started })))
        const others = Array.from({ length: 5 }, (_, i) => post(`free-${i}-${stamp}`).then((res) => ({ status: res.statusCode, ms: Date.now() - started })))
        for (const { status, ms } of await Promise.all(blocked)) {
          expect(status).toBe(503)
          expect(ms).toBeLessThan(2000)
        }
        for (const { status, ms } of await Promise.all(others)) {
          expect(status).toBe(201)
          expect(ms).toBeLessThan(2000)
        }
      } finally {
        await trx.rollback()
      }
      // Unlocked, the keys are free again.
      expect((await post(locked[0]!)).statusCode).toBe(201)
    })
  })
}
