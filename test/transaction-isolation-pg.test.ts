/**
 * Transaction mode on PostgreSQL where the level does not come from the plugin's option, or the
 * connection is not a direct one: a role whose default is SERIALIZABLE (`ALTER ROLE ... SET
 * default_transaction_isolation`, on a role of this file's own, with a schema of its own), and
 * PgBouncer in transaction pooling at the levels that record what they read. The same workloads
 * as test/transaction-isolation.test.ts; and, on that role, the store's own statements in plain
 * and in transaction mode, which run as READ COMMITTED: at the role's SERIALIZABLE they recorded
 * their reads, and failed one another (and the requests' transactions) as serialization failures.
 */
import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import knexFactory from 'knex'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage } from '../lib/knex.js'
import { transactionOf } from '../lib/knex.js'
import { newKey } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'
import { POSTGRES, pgConnection, service } from './helpers/services.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { reportMatrix, transactionMatrix } from './helpers/transaction-matrix.js'
import { pgRoleWith } from './helpers/pg-role.js'

const postgres = await service(POSTGRES)
const bouncer = await pgbouncer()
const role = pgRoleWith('idem_serializable', "default_transaction_isolation = 'serializable'", postgres)

transactionMatrix({
  label: 'PostgreSQL, serializable as the role\'s default (no isolationLevel)',
  availability: postgres,
  connect: () => knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } }),
  transaction: true,
  steps: true
})
for (const isolationLevel of ['repeatable read', 'serializable'] as const) {
  transactionMatrix({
    label: `PostgreSQL through PgBouncer (transaction pooling), ${isolationLevel}`,
    availability: bouncer.availability,
    connect: () => knexFactory({ client: 'pg', connection: bouncer.transaction }),
    transaction: { isolationLevel },
    steps: true
  })
}
reportMatrix()

describe.skipIf(!postgres.available)(`the store's own statements, on a role whose default is SERIALIZABLE${postgres.reason}`, () => {
  it('roll back their own READ COMMITTED transaction when they fail, and leave the connection ready for the next', async () => {
    // One connection: the statement after the failure runs on it.
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role }, pool: { min: 0, max: 1 } })
    const other = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role }, pool: { min: 0, max: 1 } })
    const storage = new KnexStorage({ knex, tableName: `failing_${process.pid}`, createTable: true, statementTimeout: 200 })
    try {
      const key = newKey('locked')
      expect((await storage.begin(key, 'fp', 100)).state).toBe('acquired')
      // Another transaction holds the key's row while its lease lapses: the next begin waits for it
      // past statementTimeout, and fails.
      const holder = await other.transaction()
      await holder.raw(`SELECT 1 FROM ${role}.failing_${process.pid} FOR UPDATE`)
      await new Promise((resolve) => setTimeout(resolve, 150))
      await expect(storage.begin(key, 'fp', 60_000)).rejects.toThrow(/lock timeout/)
      await holder.commit()
      expect((await storage.begin(newKey('next'), 'fp', 60_000)).state).toBe('acquired')
      expect((await knex.raw("SELECT current_setting('transaction_isolation') AS level")).rows[0].level).toBe('serializable')
    } finally {
      await knex.destroy()
      await other.destroy()
    }
  })

  it('run every statement standing alone at READ COMMITTED: renewals, releases, reads, purges and what doctor\'s commands send', async () => {
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } })
    const storage = new KnexStorage({ knex, tableName: `alone_${process.pid}`, createTable: true })
    // Each statement on the table, with the level of the transaction it ran in: knex's query
    // events carry the transaction's id, and its BEGIN names the level.
    const levels = new Map<string, string>()
    const statements: Array<{ sql: string, level: string }> = []
    knex.on('query', (query: { sql: string, __knexTxId?: string }) => {
      const begin = /^BEGIN TRANSACTION ISOLATION LEVEL (.+?);?$/i.exec(query.sql)
      if (begin !== null && query.__knexTxId !== undefined) levels.set(query.__knexTxId, begin[1]!.toLowerCase())
      else if (query.sql.includes(`alone_${process.pid}`)) statements.push({ sql: query.sql.split(' ').slice(0, 2).join(' '), level: query.__knexTxId === undefined ? 'the session\'s' : levels.get(query.__knexTxId) ?? 'the session\'s' })
    })
    try {
      await storage.ready()
      const key = newKey('alone')
      const taken = await storage.begin(key, 'fp', 60_000)
      if (taken.state !== 'acquired') throw new Error('not acquired')
      statements.length = 0
      expect(await storage.renew(key, taken.token, 60_000)).toBe(true)
      expect((await storage.inspect(key)).state).toBe('in-flight')
      expect(await storage.release(key, taken.token)).toBe(true)
      await storage.purgeExpired()
      await storage.forget(key, { force: true, relatedPrefix: `${key}:` })
      expect(statements.length).toBeGreaterThanOrEqual(4)
      expect(statements.filter((statement) => statement.level !== 'read committed')).toEqual([])
    } finally {
      await storage.close()
      await knex.destroy()
    }
  })

  it('never fail one another: 200 first requests with distinct keys, 40 at a time, each stored at once, in plain and in transaction mode', async () => {
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } })
    const table = `plain_${process.pid}`
    try {
      for (const transaction of [false, true]) {
        const problems: string[] = []
        const app = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { problems.push(String(JSON.parse(line).msg)) } } } })
        await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: `${table}_${String(transaction)}`, createTable: true }), transaction })
        app.setErrorHandler(idempotencyErrorHandler())
        app.post('/o', { config: { idempotency: true } }, async () => ({ ok: true }))
        await app.ready()
        const codes: number[] = []
        for (let round = 0; round < 5; round++) {
          const answers = await Promise.all(Array.from({ length: 40 }, async () => await app.inject({ method: 'POST', url: '/o', headers: { 'idempotency-key': newKey('plain') }, payload: {} })))
          codes.push(...answers.map((answer) => answer.statusCode))
        }
        await app.close()
        expect({ transaction, refused: codes.filter((code) => code !== 200).length, problems }).toEqual({ transaction, refused: 0, problems: [] })
      }
    } finally {
      await knex.destroy()
    }
  })

  // Handlers longer than the lease's first renewal (3/16 of lockTimeout), so that the lease is
  // renewed beside the request (plain mode, and transaction mode at READ COMMITTED, which a route
  // may ask for on such a role); half of the plain ones fail, so their lease is given back. The
  // renewals and the give-backs ran at the role's SERIALIZABLE and failed one another (40001, past
  // their five retries): a stored request was answered 503 after its writes were kept and ran again
  // on its retry, and a failed request's key stayed locked (409 or 503 on its retry).
  it('renew and give back leases beside the requests without failing one another: 4 rounds of 60 requests in plain mode and 8 at read committed, over HTTP', async () => {
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } })
    const orders = `beside_orders_${process.pid}`
    await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('k') })
    const runs = new Map<string, number>()
    const ran = (key: string): void => { runs.set(key, (runs.get(key) ?? 0) + 1) }
    const app = Fastify()
    try {
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: `beside_${process.pid}`, createTable: true }), lockTimeout: 2000 })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/plain', { config: { idempotency: { required: true } } }, async (request, reply) => {
        ran(request.idempotency!.key)
        await knex(orders).insert({ k: request.idempotency!.key })
        await new Promise((resolve) => setTimeout(resolve, 700))
        return await reply.code((request.body as { fail: boolean }).fail ? 500 : 201).send({})
      })
      app.post('/trx', { config: { idempotency: { required: true, transaction: { isolationLevel: 'read committed' } } } }, async (request, reply) => {
        ran(request.idempotency!.key)
        await transactionOf(request)(orders).insert({ k: request.idempotency!.key })
        await new Promise((resolve) => setTimeout(resolve, 700))
        return await reply.code(201).send({})
      })
      const url = await app.listen({ host: '127.0.0.1', port: 0 })
      const outcomes: Record<string, number> = {}
      for (let round = 0; round < 4; round++) {
        for (const path of ['/plain', '/trx']) {
          // In transaction mode, fewer than the 9 transactions knex's default pool lets open at once:
          // requests waiting for one wait for their lease's renewals too, on the pool's last connection.
          const keys = Array.from({ length: path === '/plain' ? 60 : 8 }, () => newKey('beside'))
          const fails = (i: number): boolean => path === '/plain' && i % 2 === 1
          const first = await Promise.all(keys.map(async (key, i) => await postWithKey(url + path, key, { fail: fails(i) })))
          const again = await Promise.all(keys.map(async (key, i) => await postWithKey(url + path, key, { fail: fails(i) })))
          const rows = await knex(orders).whereIn('k', keys).select('k') as Array<{ k: string }>
          keys.forEach((key, i) => {
            const kept = rows.filter((row) => row.k === key).length
            const outcome = fails(i)
              ? `failed ${first[i]!.status}, retry ${again[i]!.status}, runs ${runs.get(key)}`
              : `stored ${first[i]!.status}, retry ${again[i]!.status}${again[i]!.replayed ? ' replayed' : ''}, runs ${runs.get(key)}, rows ${kept}`
            outcomes[`${path} ${outcome}`] = (outcomes[`${path} ${outcome}`] ?? 0) + 1
          })
        }
      }
      expect(outcomes).toEqual({
        '/plain failed 500, retry 500, runs 2': 120,
        '/plain stored 201, retry 201 replayed, runs 1, rows 1': 120,
        '/trx stored 201, retry 201 replayed, runs 1, rows 1': 32
      })
    } finally {
      await app.close()
      await knex.destroy()
    }
  }, 60_000)
})
