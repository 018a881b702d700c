/**
 * A `begin` that ran on the server but whose answer never came, on each store with a server,
 * through a proxy that lets the command through and holds the answer back: then the connection is
 * reset, or the client stops waiting (ioredis's `commandTimeout`). The lease it took must not block
 * the key until it lapses. Over real HTTP, with a lease far longer than the test.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest'
import type { RedisOptions } from 'ioredis'
import knexFactory from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, type IdempotencyStorage } from '../lib/index.js'
import { outcomeUnknown } from '../lib/storage/knex/rows.js'
import { MARIADB, POSTGRES, REDIS, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { startProxy, type Proxy } from './helpers/proxy.js'
import { proxiedKnex, proxiedRedis } from './helpers/proxied-stores.js'
import { newKey } from './helpers/app.js'

const stamp = `${process.pid}_${Date.now()}`

interface Target {
  name: string
  availability: Availability
  server: { host: string, port: number }
  /** A storage through the proxy on `port`, and a look at the server that bypasses it. */
  connect: (port: number) => { storage: IdempotencyStorage, holds: (key: string) => Promise<boolean>, dispose: () => Promise<void> }
  /** What the client it answers then gets. */
  expected: number
  /** How the answer is lost: the connection reset (default), or nothing more (the client gives up). */
  lose?: (proxy: Proxy) => void
}

const reset = (proxy: Proxy): void => {
  proxy.cut()
  proxy.restore()
}

function redisTarget (name: string, availability: Availability, options: RedisOptions, expected: number, lose = reset): Target {
  return {
    name,
    availability,
    server: REDIS,
    expected,
    lose,
    connect: (port) => {
      const { storage, direct, dispose } = proxiedRedis(port, `lost:${stamp}:${name}:`, options)
      return { storage, holds: async (key) => await direct.exists(storage.redisKey(key)) === 1, dispose }
    }
  }
}

function sqlTarget (name: string, availability: Availability, client: 'pg' | 'mysql2', base: Record<string, unknown>, config: typeof POSTGRES): Target {
  const table = `lost_${name}_${stamp}`
  return {
    name,
    availability,
    server: config,
    expected: 503,
    connect: (port) => {
      // knex warns of the connection the reset broke: expected here.
      const { storage, direct, dispose } = proxiedKnex(port, client, base, table, { log: { warn: () => {} } })
      return { storage, holds: async (key) => await direct(table).where('idempotency_key', Buffer.from(key)).first('state') !== undefined, dispose }
    }
  }
}

const [redis, postgres, mariadb] = await Promise.all([service(REDIS), service(POSTGRES), service(MARIADB)])
const targets: Target[] = [
  // ioredis sends again what a lost connection left unanswered: the SET finds its own lease.
  redisTarget('redis, default client options', redis, {}, 201),
  // A command timeout fails the call while the connection stays up: the lease it took is given back.
  redisTarget('redis, commandTimeout', redis, { commandTimeout: 300 }, 503, () => {}),
  sqlTarget('postgres', postgres, 'pg', pgConnection, POSTGRES),
  sqlTarget('mariadb', mariadb, 'mysql2', mysqlConnection, MARIADB)
]

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`the answer of begin lost with its connection on ${target.name}${target.availability.reason}`, () => {
    let proxy: Proxy
    let app: FastifyInstance
    let url: string
    let holds: (key: string) => Promise<boolean>
    let dispose: () => Promise<void>
    let runs = 0

    beforeAll(async () => {
      proxy = await startProxy(target.server.host, target.server.port)
      let storage: IdempotencyStorage
      ;({ storage, holds, dispose } = target.connect(proxy.port))
      app = Fastify()
      await app.register(idempotency, { storage, lockTimeout: '5m' })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; reply.code(201); return { run: runs } })
      url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
      // Connected, and the SQL stores' table made.
      expect((await post(newKey())).status).toBe(201)
    })
    afterEach(() => { proxy.restore() })
    afterAll(async () => {
      await app.close()
      await dispose()
      await proxy.close()
    })

    async function post (key: string): Promise<{ status: number, replayed: string | null }> {
      const res = await fetch(url, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{"a":1}' })
      await res.text()
      return { status: res.status, replayed: res.headers.get('idempotent-replayed') }
    }

    it('leaves no lease behind: the request is answered, and its retry runs the handler or replays it', async () => {
      const key = newKey('lost')
      const before = runs
      proxy.mute()
      const first = post(key)
      // The lease is taken on the server; its answer is held back, then lost with the connection.
      await vi.waitFor(async () => { expect(await holds(key)).toBe(true) }, { timeout: 5000, interval: 10 })
      ;(target.lose ?? reset)(proxy)
      expect((await first).status).toBe(target.expected)
      proxy.restore()
      if (target.expected !== 201) {
        await vi.waitFor(async () => { expect(await holds(key)).toBe(false) }, { timeout: 5000, interval: 20 })
      }
      const retry = await post(key)
      expect(retry.status).toBe(201)
      expect(retry.replayed).toBe(target.expected === 201 ? 'true' : null)
      expect(runs - before).toBe(1)
    })
  })
}

describe('which failed statements may still have run, as each driver reports them', () => {
  const failure = async (statement: Promise<unknown>): Promise<unknown> => await statement.then(() => { throw new Error('the statement did not fail') }, (error: unknown) => error)

  it.skipIf(!postgres.available)(`on postgres: the server's refusals and cancels did not run; a client-side timeout may have${postgres.reason}`, async () => {
    // knex warns of the connection it could not acquire: expected here.
    const knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 }, acquireConnectionTimeout: 200, log: { warn: () => {} } })
    try {
      expect(outcomeUnknown(await failure(knex.raw('SELECT 1 / 0')))).toBe(false)
      expect(outcomeUnknown(await failure(knex.raw('SELECT pg_sleep(1)').timeout(50, { cancel: true })))).toBe(true)
      const trx = await knex.transaction()
      // The one connection is taken: this statement never gets one.
      expect(outcomeUnknown(await failure(knex.raw('SELECT 1')))).toBe(false)
      await trx.rollback()
    } finally {
      await knex.destroy()
    }
  })

  it.skipIf(!mariadb.available)(`on mariadb: the server's refusals and cancels did not run; a client-side timeout may have${mariadb.reason}`, async () => {
    const knex = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 } })
    try {
      expect(outcomeUnknown(await failure(knex.raw('SELECT * FROM no_such_table_here')))).toBe(false)
      expect(outcomeUnknown(await failure(knex.raw('SET STATEMENT max_statement_time = 0.05 FOR SELECT SLEEP(1) FROM DUAL WHERE SLEEP(1) = 1')))).toBe(false)
      expect(outcomeUnknown(await failure(knex.raw('SELECT SLEEP(1)').timeout(50)))).toBe(true)
    } finally {
      await knex.destroy()
    }
  })
})
