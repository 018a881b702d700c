/**
 * Transaction mode on each real database: the handler's writes and the stored response commit
 * together or not at all, in one process and across processes killed at the worst moments.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify, { type FastifyInstance } from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, transactionOf } from '../lib/knex.js'
import { dropIdempotencyTable } from '../lib/knex.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { effectCount, postOrder, startServers, type ServerProcess } from './helpers/processes.js'
import { newKey } from './helpers/app.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { scaled } from './helpers/pace.js'

const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-trx-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

interface Dialect {
  name: string
  store: string
  availability: Availability
  connect: () => Knex
  env: Record<string, string>
  multiProcess: boolean
}

const bouncer = await pgbouncer()

const dialects: Dialect[] = [
  { name: 'PostgreSQL', store: 'postgres', availability: await service(POSTGRES), connect: () => knexFactory({ client: 'pg', connection: pgConnection }), env: {}, multiProcess: true },
  { name: 'PostgreSQL through PgBouncer (transaction pooling)', store: 'postgres', availability: bouncer.availability, connect: () => knexFactory({ client: 'pg', connection: bouncer.transaction }), env: {}, multiProcess: false },
  { name: 'MariaDB', store: 'mysql', availability: await service(MARIADB), connect: () => knexFactory({ client: 'mysql2', connection: mysqlConnection }), env: {}, multiProcess: true },
  {
    name: 'SQLite',
    store: 'sqlite',
    availability: { available: true, reason: '' },
    connect: () => knexFactory({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'trx.db') }, useNullAsDefault: true }),
    env: { SQLITE_FILE: join(sqliteDir, 'trx-mp.db') },
    multiProcess: false
  }
]

for (const dialect of dialects) {
  describe.skipIf(!dialect.availability.available)(`transaction mode on ${dialect.name}${dialect.availability.reason}`, () => {
    const table = `trx_${dialect.store}_${process.pid}_${Date.now()}`
    const orders = `${table}_orders`
    const ledger = `${table}_ledger`
    let knex: Knex
    /** Another connection, as another process would have. */
    let other: Knex
    let app: FastifyInstance

    beforeAll(async () => {
      knex = dialect.connect()
      other = dialect.connect()
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 200).notNullable(); t.integer('amount').notNullable() })
      await knex.schema.createTable(ledger, (t) => { t.increments('id'); t.integer('order_id').notNullable(); t.integer('amount').notNullable() })
      app = Fastify()
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), transaction: true })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const trx = transactionOf(request)
        const { amount, fail, steal } = request.body as { amount: number, fail?: string, steal?: boolean }
        if (steal === true) {
          // Another process took the lease over (as after a lapse): simulated by removing the row.
          await other(table).del()
        }
        const [inserted] = await trx(orders).insert({ idem_key: request.idempotency!.key, amount }, ['id'])
        const id = typeof inserted === 'object' ? (inserted as { id: number }).id : inserted as number
        await trx(ledger).insert({ order_id: id, amount })
        if (fail === 'throw') throw new Error('payment provider refused')
        if (fail === '422') { reply.code(422); return { error: 'refused' } }
        reply.code(201)
        return { id, amount }
      })
      await app.ready()
    })

    afterAll(async () => {
      await app?.close()
      await knex.schema.dropTableIfExists(orders)
      await knex.schema.dropTableIfExists(ledger)
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
      await other.destroy()
    })

    const send = (key: string, body: object) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: body })
    const rows = async (key: string) => Number((await knex(orders).where({ idem_key: key }).count({ n: '*' }))[0]!.n)
    const ledgerRows = async () => Number((await knex(ledger).count({ n: '*' }))[0]!.n)

    it('commits the order, its ledger row and the stored response together; a replay writes nothing', async () => {
      const key = newKey('trx')
      const ledgerBefore = await ledgerRows()
      const first = await send(key, { amount: 100 })
      expect(first.statusCode).toBe(201)
      expect(await rows(key)).toBe(1)
      expect(await ledgerRows()).toBe(ledgerBefore + 1)
      const replay = await send(key, { amount: 100 })
      expect(replay.headers['idempotent-replayed']).toBe('true')
      expect(replay.body).toBe(first.body)
      expect(await rows(key)).toBe(1)
    })

    for (const fail of ['throw', '422']) {
      it(`rolls back every write when the handler ${fail === 'throw' ? 'throws' : 'answers 422'}, and a retry succeeds once`, async () => {
        const key = newKey('trx-fail')
        const ledgerBefore = await ledgerRows()
        expect((await send(key, { amount: 5, fail })).statusCode).toBe(fail === 'throw' ? 500 : 422)
        expect(await rows(key)).toBe(0)
        expect(await ledgerRows()).toBe(ledgerBefore)
        expect((await send(key, { amount: 5 })).statusCode).toBe(201)
        expect(await rows(key)).toBe(1)
      })
    }

    it('answers 503 and keeps no write when the lease was lost before commit', async () => {
      const key = newKey('trx-steal')
      const res = await send(key, { amount: 7, steal: true })
      expect(res.statusCode).toBe(503)
      expect(res.json().type).toMatch(/#store-unavailable$/)
      expect(await rows(key)).toBe(0)
    })

    // Across processes on PostgreSQL and MariaDB; SQLite serves one process's transactions at a time.
    if (dialect.multiProcess) {
      describe('across processes', () => {
        const namespace = `trxmp_${dialect.store}_${process.pid}_${Date.now()}`
        let servers: ServerProcess[] = []
        const LOCK_TIMEOUT = 2500

        beforeAll(async () => {
          servers = await startServers(2, { STORE: dialect.store, NAMESPACE: namespace, LOCK_TIMEOUT: String(LOCK_TIMEOUT), TRANSACTION: '1', ...dialect.env })
        }, scaled(120_000))
        afterAll(async () => {
          await Promise.all(servers.map((server) => server.kill()))
          await knex.schema.dropTableIfExists(`${namespace}_effects`)
          await dropIdempotencyTable(knex, namespace)
        })

        it('writes one row for 50 simultaneous duplicates over two processes', async () => {
          const key = newKey('trx-mp')
          const answers = await Promise.all(Array.from({ length: 50 }, (_, i) => postOrder(servers[i % 2]!, key, { amount: 1 }, { 'x-delay': '200' })))
          expect(answers.filter((a) => a.status === 201 && !a.replayed)).toHaveLength(1)
          // A duplicate that waited on the first one's uncommitted row, or for one of the process's
          // ten connections, longer than storeTimeout is refused with 503 #store-unavailable (as
          // documented): on a loaded machine that happens; a second run never may.
          const refused = answers.filter((a) => a.status !== 201 && a.status !== 409)
          expect(refused.filter((a) => !(a.status === 503 && a.body.includes('#store-unavailable'))).map((a) => `${a.status} ${a.body}`)).toEqual([])
          expect(await effectCount(servers[0]!, key)).toBe(1)
        })

        it('keeps no write of a process killed after its writes but before commit; the retry writes exactly one', async () => {
          const key = newKey('trx-kill-before')
          const [victim] = servers as [ServerProcess, ServerProcess]
          const lost = postOrder(victim, key, { amount: 1 }, { 'x-hang': 'after-write' }).catch(() => null)
          await victim.hanging(key)
          const killedAt = Date.now()
          await victim.kill('SIGKILL')
          expect(await lost).toBeNull()
          servers[0] = (await startServers(1, { STORE: dialect.store, NAMESPACE: namespace, LOCK_TIMEOUT: String(LOCK_TIMEOUT), TRANSACTION: '1', ...dialect.env }))[0]!
          const survivor = servers[1]!
          expect(await effectCount(survivor, key)).toBe(0)
          await sleep(Math.max(0, LOCK_TIMEOUT - (Date.now() - killedAt)) + 300)
          const retry = await postOrder(survivor, key, { amount: 1 })
          expect(retry.status).toBe(201)
          expect(await effectCount(survivor, key)).toBe(1)
          expect((await postOrder(servers[0]!, key, { amount: 1 })).body).toBe(retry.body)
        })

        it('replays what a process killed after commit had committed; exactly one write', async () => {
          const key = newKey('trx-kill-after')
          const [victim, survivor] = servers as [ServerProcess, ServerProcess]
          const lost = postOrder(victim, key, { amount: 1 }, { 'x-hang': 'after-commit' }).catch(() => null)
          await victim.hanging(key)
          await victim.kill('SIGKILL')
          expect(await lost).toBeNull()
          const retry = await postOrder(survivor, key, { amount: 1 })
          expect(retry.status).toBe(201)
          expect(retry.replayed).toBe(true)
          expect(JSON.parse(retry.body)).toMatchObject({ key })
          expect(await effectCount(survivor, key)).toBe(1)
        })
      })
    }
  })
}
