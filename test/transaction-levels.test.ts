/**
 * How each database opens a request's transaction at the level a route names, and what its handler
 * then reads of a row another connection changes between two reads: PostgreSQL (BEGIN ISOLATION
 * LEVEL), MariaDB (SET TRANSACTION before BEGIN, which MariaDB refuses inside a transaction).
 * What the store does when the transaction must hold the lease and cannot; which errors it counts
 * as a transaction conflict. SQLite: BEGIN IMMEDIATE for serializable (the write lock taken at
 * once), DEFERRED otherwise (the write lock at the first write, which fails when another
 * connection holds it: answered 503 with Retry-After, as any transaction conflict).
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setImmediate } from 'node:timers/promises'
import { afterAll, describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency, { idempotencyErrorHandler, type IsolationLevel } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../lib/knex.js'
import { Gate } from './helpers/gate.js'
import { dropApp } from './helpers/transaction-matrix.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { newKey } from './helpers/app.js'
import { scaled } from './helpers/pace.js'

const stamp = `${process.pid}_${Date.now().toString(36)}`

/** Resolves once `check` holds: a state of the database another connection waits to reach, asked for again on each turn. */
async function until (check: () => Promise<boolean>): Promise<void> {
  while (!await check()) await setImmediate()
}
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-trx-levels-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

const servers: Array<{ name: string, availability: Availability, config: Knex.Config, begins: Record<IsolationLevel, string[]>, lockWait: string }> = [
  {
    name: 'PostgreSQL',
    availability: await service(POSTGRES),
    config: { client: 'pg', connection: pgConnection },
    begins: { 'read committed': ['BEGIN TRANSACTION ISOLATION LEVEL read committed;'], 'repeatable read': ['BEGIN TRANSACTION ISOLATION LEVEL repeatable read;'], serializable: ['BEGIN TRANSACTION ISOLATION LEVEL serializable;'] },
    lockWait: "SET lock_timeout = '500ms'"
  },
  {
    name: 'MariaDB',
    availability: await service(MARIADB),
    config: { client: 'mysql2', connection: mysqlConnection },
    begins: { 'read committed': ['SET TRANSACTION ISOLATION LEVEL read committed;', 'BEGIN;'], 'repeatable read': ['SET TRANSACTION ISOLATION LEVEL repeatable read;', 'BEGIN;'], serializable: ['SET TRANSACTION ISOLATION LEVEL serializable;', 'BEGIN;'] },
    lockWait: 'SET SESSION innodb_lock_wait_timeout = 1'
  }
]

/**
 * What a handler that reads one row twice sees when another connection changes the row in
 * between, at each level: the change (read committed), the first value again (repeatable read),
 * and, on MariaDB at serializable, no change at all (its read locked the row, and the other
 * connection's update waited for the lock until its timeout).
 */
const EXPECTED: Record<string, Record<IsolationLevel, { changed: boolean, secondSeesChange: boolean }>> = {
  PostgreSQL: { 'read committed': { changed: true, secondSeesChange: true }, 'repeatable read': { changed: true, secondSeesChange: false }, serializable: { changed: true, secondSeesChange: false } },
  MariaDB: { 'read committed': { changed: true, secondSeesChange: true }, 'repeatable read': { changed: true, secondSeesChange: false }, serializable: { changed: false, secondSeesChange: false } }
}

for (const [index, server] of servers.entries()) {
  describe.skipIf(!server.availability.available)(`isolation levels on ${server.name}${server.availability.reason}`, () => {
    const knex = knexFactory(server.config)
    /** Another connection, as another process would have, which waits for a row lock briefly. */
    const other = knexFactory({ ...server.config, pool: { min: 0, max: 1, afterCreate: (connection: { query: (sql: string, done: (error: Error | null) => void) => void }, done: (error: Error | null, connection: unknown) => void) => { connection.query(server.lockWait, (error) => { done(error, connection) }) } } })
    const table = `trx_levels_${stamp}_${index}`
    const counter = `${table}_counter`
    const storage = new KnexStorage({ knex, tableName: table, createTable: true })
    const sent: string[] = []
    knex.on('query', (query: { sql: string }) => { sent.push(query.sql) })
    const gates = new Map<string, Gate>()
    const ready = (async () => {
      await knex.schema.createTable(counter, (t) => { t.integer('id').primary(); t.integer('n').notNullable() })
      await knex(counter).insert({ id: 1, n: 0 })
      const app = Fastify()
      await app.register(idempotency, { storage })
      app.setErrorHandler(idempotencyErrorHandler())
      for (const level of ['read committed', 'repeatable read', 'serializable'] as const) {
        app.post(`/${level.replace(' ', '-')}`, { config: { idempotency: { transaction: { isolationLevel: level } } } }, async (request) => {
          const trx = transactionOf(request)
          const first = (await trx(counter).where({ id: 1 }).first()).n as number
          await gates.get(request.idempotency!.key)?.hold()
          const second = (await trx(counter).where({ id: 1 }).first()).n as number
          return { first, second }
        })
      }
      for (const level of ['read committed', 'serializable'] as const) {
        app.post(`/waiting-${level.replace(' ', '-')}`, { config: { idempotency: { wait: true, waitTimeout: scaled(20_000), storeTimeout: scaled(20_000), transaction: { isolationLevel: level } } } }, async (request) => {
          await gates.get(request.idempotency!.key)?.hold()
          return { ok: true }
        })
      }
      await app.ready()
      return app
    })()
    afterAll(async () => { await dropApp({ app: await ready, knex, tables: [counter], storeTable: table, others: [other] }) })

    for (const level of ['read committed', 'repeatable read', 'serializable'] as const) {
      it(`opens the transaction at ${level} before the handler's first statement, and the handler reads as that level does`, async () => {
        const app = await ready
        const key = newKey('level')
        const gate = new Gate()
        gates.set(key, gate)
        sent.length = 0
        const answer = app.inject({ method: 'POST', url: `/${level.replace(' ', '-')}`, headers: { 'idempotency-key': key }, payload: {} })
        await gate.entered
        // Another connection changes the row the handler read, between its two reads.
        const changed = await other(counter).where({ id: 1 }).increment('n', 1).then(() => true, () => false)
        gate.open()
        const res = await answer
        expect(res.statusCode).toBe(200)
        const { first, second } = res.json() as { first: number, second: number }
        expect({ changed, secondSeesChange: second !== first }).toEqual(EXPECTED[server.name]![level])
        const begin = sent.findIndex((sql) => sql.startsWith('BEGIN') || sql.startsWith('SET TRANSACTION'))
        expect(sent.slice(begin, begin + server.begins[level].length)).toEqual(server.begins[level])
      })
    }

    if (server.name === 'PostgreSQL') {
      for (const level of ['read committed', 'serializable'] as const) {
        it(`wakes a duplicate that waits (wait mode) when the first commits, at ${level}`, async () => {
          const app = await ready
          const key = newKey('waited')
          const gate = new Gate()
          gates.set(key, gate)
          const url = `/waiting-${level.replace(' ', '-')}`
          const first = app.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })
          await gate.entered
          const duplicate = app.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })
          // The duplicate has marked the lease it waits for (read committed), or waits for the row
          // lock the first request's transaction holds to mark it (serializable).
          await until(async () => level === 'read committed'
            ? (await other(table).select('waiting')).some((row: { waiting: boolean }) => row.waiting)
            : (await other.raw("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%SET waiting = true%'")).rows.length > 0)
          const openedAt = Date.now()
          gate.open()
          expect((await first).statusCode).toBe(200)
          const replay = await duplicate
          expect(replay.statusCode).toBe(200)
          expect(replay.headers['idempotent-replayed']).toBe('true')
          // Woken by the commit (its NOTIFY, or the row lock's end), not by the end of its wait.
          expect(Date.now() - openedAt).toBeLessThan(scaled(2000))
        })
      }
    }

    it('refuses to open a transaction that must hold a lease it cannot hold, and leaves no row behind', async () => {
      await ready
      const held = newKey('held')
      const lease = await storage.begin(held, 'fp', 60_000)
      expect(lease.state).toBe('acquired')
      const options = (key: string, token: string) => ({ request: true, isolationLevel: 'serializable' as const, lease: { key, token, lockTimeout: 60_000 } })
      if (server.name === 'PostgreSQL') {
        await expect(storage.transaction(options(held, 'not-its-token'))).rejects.toThrow(/the lease was lost before its transaction could hold it/)
        const absent = newKey('absent')
        await expect(storage.transaction(options(absent, 'any'))).rejects.toThrow(/the lease was lost/)
        expect(await storage.inspect(absent)).toEqual({ state: 'absent' })
      }
      // The lease it holds is untouched, and a transaction under it opens.
      const opened = await storage.transaction(options(held, (lease as { token: string }).token))
      await opened.rollback()
      expect((await storage.inspect(held)).state).toBe('in-flight')
    })

    it('stores the response inside a serializable transaction with statementTimeout 0 too (no lock_timeout set)', async () => {
      await ready
      const unbounded = new KnexStorage({ knex, tableName: table, statementTimeout: 0 })
      const key = newKey('unbounded')
      const lease = await unbounded.begin(key, 'fp', 60_000) as { token: string }
      const transaction = await unbounded.transaction({ request: true, isolationLevel: 'serializable', lease: { key, token: lease.token, lockTimeout: 60_000 } })
      expect(await transaction.complete(key, lease.token, { statusCode: 201, contentType: null, headers: {}, body: Buffer.from('kept') }, 60_000)).toBe(true)
      await transaction.commit()
      expect(await unbounded.inspect(key)).toMatchObject({ state: 'completed', response: { statusCode: 201 } })
    })

    it('knows a conflict of a handler\'s transaction from any other failure', () => {
      const conflicts = server.name === 'PostgreSQL' ? [{ code: '40001' }, { code: '40P01' }, { code: '55P03' }] : [{ errno: 1213 }, { errno: 1205 }, { errno: 1020 }]
      for (const error of conflicts) expect(storage.isConflict(Object.assign(new Error('conflict'), error))).toBe(true)
      expect(storage.isConflict(Object.assign(new Error('duplicate key'), { code: '23505', errno: 1062 }))).toBe(false)
      expect(storage.isConflict(null)).toBe(false)
    })
  })
}

describe('SQLite: serializable begins IMMEDIATE, the others DEFERRED', () => {
  const file = join(sqliteDir, 'levels.db')
  /** No busy wait: better-sqlite3 waits synchronously, and the holder is in this process. */
  const noWait = { afterCreate: (db: { pragma: (sql: string) => unknown }, done: (error: Error | null, db: unknown) => void) => { db.pragma('busy_timeout = 0'); done(null, db) } }
  const knex = knexFactory({ client: 'better-sqlite3', connection: { filename: file }, useNullAsDefault: true, pool: noWait })
  /** Another connection to the same file, as another process would have. */
  const other = knexFactory({ client: 'better-sqlite3', connection: { filename: file }, useNullAsDefault: true, pool: noWait })
  const table = `trx_levels_${stamp}_sqlite`
  const orders = `${table}_orders`
  const storage = new KnexStorage({ knex, tableName: table, createTable: true })
  const gates = new Map<string, Gate>()
  /** Called when a handler's write failed, before it throws. */
  const failed = new Map<string, () => Promise<void>>()
  let runs = 0
  const ready = (async () => {
    await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 200) })
    const app = Fastify()
    await app.register(idempotency, { storage })
    app.setErrorHandler(idempotencyErrorHandler())
    for (const [path, transaction] of [['/immediate', { isolationLevel: 'serializable' }], ['/deferred', true]] as const) {
      app.post(path, { config: { idempotency: { transaction } } }, async (request) => {
        runs++
        const key = request.idempotency!.key
        await gates.get(key)?.hold()
        try {
          await transactionOf(request)(orders).insert({ idem_key: key })
        } catch (error) {
          await failed.get(key)?.()
          throw error
        }
        return { ok: true }
      })
    }
    return app
  })()
  afterAll(async () => { await dropApp({ app: await ready, knex, tables: [orders], storeTable: table, others: [other] }) })
  const send = async (path: string, key: string) => await (await ready).inject({ method: 'POST', url: path, headers: { 'idempotency-key': key }, payload: {} })
  /** A request sent to `path`, once its handler is held at its gate (before it writes). */
  const held = async (path: string) => {
    const key = newKey(path.slice(1))
    const gate = new Gate()
    gates.set(key, gate)
    const answer = send(path, key)
    await gate.entered
    return { key, gate, answer }
  }

  it('immediate: the transaction holds the write lock from its start, before the handler writes', async () => {
    const { gate, answer } = await held('/immediate')
    await expect(other(orders).insert({ idem_key: 'elsewhere' })).rejects.toMatchObject({ code: 'SQLITE_BUSY' })
    gate.open()
    expect((await answer).statusCode).toBe(200)
  })

  it('immediate: a transaction that cannot take the write lock at BEGIN fails to open (SQLITE_BUSY), and the connection serves the next one', async () => {
    await ready
    const holder = await other.transaction()
    await holder(orders).insert({ idem_key: 'holding the write lock' })
    await expect(storage.transaction({ isolationLevel: 'serializable' })).rejects.toMatchObject({ code: 'SQLITE_BUSY' })
    await holder.commit()
    const opened = await storage.transaction({ isolationLevel: 'serializable' })
    await opened.rollback()
  })

  it('deferred: the write lock waits for the first write, which fails while another connection holds it: 503 with Retry-After, nothing kept, the retry commits', async () => {
    const { key, gate, answer } = await held('/deferred')
    // Nothing held yet: another connection writes.
    await other(orders).insert({ idem_key: 'elsewhere' })
    const holder = await other.transaction()
    await holder(orders).insert({ idem_key: 'holding the write lock' })
    // Once the handler's write has failed, the other connection commits (the key is then given back).
    failed.set(key, async () => { await holder.commit() })
    gate.open()
    const refused = await answer
    expect(refused.statusCode).toBe(503)
    expect(refused.json().type).toMatch(/#store-unavailable$/)
    expect(refused.headers['retry-after']).toBe('1')
    expect(await knex(orders).where({ idem_key: key }).count({ n: '*' })).toEqual([{ n: 0 }])
    gates.delete(key)
    failed.delete(key)
    const runsBefore = runs
    expect((await send('/deferred', key)).statusCode).toBe(200)
    expect(runs).toBe(runsBefore + 1)
    expect(await knex(orders).where({ idem_key: key }).count({ n: '*' })).toEqual([{ n: 1 }])
  })
})

describe.skipIf(!servers[0]!.availability.available)(`PostgreSQL: a serialization failure at COMMIT${servers[0]!.availability.reason}`, () => {
  const warnings: string[] = []
  const log = { warn: (message: string) => { warnings.push(String(message)) }, error: () => {}, debug: () => {}, deprecate: () => {} }
  // One connection, so that the request after the failure shows whether it was kept.
  const knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 }, log })
  const table = `trx_levels_${stamp}_commit`
  const orders = `${table}_orders`
  const ready = (async () => {
    // COMMIT fails as SERIALIZABLE's does when it finds a dangerous structure: deterministically,
    // through a constraint trigger checked at commit.
    await knex.raw(`CREATE TABLE ${orders} (id serial PRIMARY KEY, idem_key text, refused boolean NOT NULL DEFAULT false)`)
    await knex.raw(`CREATE FUNCTION ${orders}_refuse () RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.refused THEN RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001'; END IF; RETURN NEW; END $$`)
    await knex.raw(`CREATE CONSTRAINT TRIGGER ${orders}_refuse AFTER INSERT ON ${orders} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ${orders}_refuse()`)
    const app = Fastify()
    await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), transaction: { isolationLevel: 'serializable' } })
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/orders', { config: { idempotency: true } }, async (request) => {
      const trx = transactionOf(request)
      await trx(orders).insert({ idem_key: request.idempotency!.key, refused: (request.body as { refused: boolean }).refused })
      return { pid: (await trx.raw('SELECT pg_backend_pid() AS pid')).rows[0].pid as number }
    })
    await app.ready()
    return app
  })()
  afterAll(async () => {
    await (await ready).close()
    await knex.raw(`DROP TABLE IF EXISTS ${orders}`)
    await knex.raw(`DROP FUNCTION IF EXISTS ${orders}_refuse()`)
    await dropIdempotencyTable(knex, table)
    await knex.destroy()
  })

  it('is answered 503 with Retry-After, keeps nothing, and keeps its connection, which is sound', async () => {
    const app = await ready
    const send = async (key: string, refused: boolean) => await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { refused } })
    const before = (await send(newKey('commit'), false)).json().pid as number
    const key = newKey('commit')
    const refused = await send(key, true)
    expect(refused.statusCode).toBe(503)
    expect(refused.headers['retry-after']).toBe('1')
    expect(await knex(orders).where({ idem_key: key }).count({ n: '*' })).toEqual([{ n: '0' }])
    const after = await send(newKey('commit'), false)
    expect(after.statusCode).toBe(200)
    expect(warnings.filter((warning) => warning.includes('Connection Error'))).toEqual([])
    // The pool's one connection is the one it had.
    expect(after.json().pid).toBe(before)
  })
})
