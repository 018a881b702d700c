/**
 * MariaDB under the faults a lock-holding transaction brings, over real HTTP: a knex pool of one
 * connection, rows and a range of keys locked by another connection's open transaction,
 * statements cancelled by KnexStorage's `statementTimeout`, calls the plugin gives up on at
 * `storeTimeout`, and many keys sent with concurrent duplicates. No key may run its handler twice.
 *
 * The case that ran handlers twice: a new key's INSERT waits for a gap lock after the statement
 * read the clock, so the lease it writes is measured from before the wait. Held longer than
 * `lockTimeout`, that lease was already over when `begin` answered: the handler ran, and the
 * duplicate queued behind it on the pool took the key over at once and ran as well.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../lib/knex.js'
import { MARIADB, mysqlConnection, service } from './helpers/services.js'
import { postWithKey } from './helpers/http-client.js'

const LEASE = 1000
/**
 * Below storeTimeout, as documented, and above lockTimeout (as the defaults are when lockTimeout
 * is set to a few seconds): a statement waiting on a locked row is cancelled after it.
 */
const STATEMENT_TIMEOUT = 1500
const STORE_TIMEOUT = 2500
const HANDLER = 300
const DUPLICATES = 3
const stamp = `${process.pid}_${Date.now()}`
const mariadb = await service(MARIADB)

interface Run { start: number, end: number }

/** The pool knex keeps (tarn), as far as the test watches it. */
interface Pool { numPendingAcquires: () => number, numUsed: () => number }

describe.skipIf(!mariadb.available)(`MariaDB with a pool of one, locked rows and gaps, cancelled statements and abandoned calls${mariadb.reason}`, () => {
  const table = `locked_rows_${stamp}`
  let knex: Knex
  let other: Knex
  let app: FastifyInstance
  let url: string
  const runs = new Map<string, Run[]>()

  beforeAll(async () => {
    knex = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 } })
    // The other connection: two lock-holding transactions and a connection to watch them with.
    other = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 3 } })
    const storage = new KnexStorage({ knex, tableName: table, createTable: true, statementTimeout: STATEMENT_TIMEOUT })
    app = Fastify()
    await app.register(idempotency, { storage, lockTimeout: LEASE, storeTimeout: STORE_TIMEOUT })
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/charges', { config: { idempotency: true } }, async (request, reply) => {
      const run = { start: Date.now(), end: 0 }
      const key = request.headers['idempotency-key'] as string
      runs.set(key, [...(runs.get(key) ?? []), run])
      await sleep(HANDLER)
      run.end = Date.now()
      reply.code(201)
      return { key }
    })
    url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/charges`
    // The table exists before any lock is taken.
    expect(await post(`warm-${stamp}`)).toBe(201)
  })
  afterAll(async () => {
    await app.close()
    await dropIdempotencyTable(knex, table).catch(() => {})
    await knex.destroy()
    await other.destroy()
  })

  async function post (key: string): Promise<number> {
    return (await postWithKey(url, key, '{"amount":100}')).status
  }

  const pool = (): Pool => (knex.client as { pool: Pool }).pool
  /**
   * Statements on this table still running after 100 ms: waiting for a lock the other connection
   * holds. (PROCESSLIST, not INNODB_TRX: InnoDB refreshes that one only when nobody has read it for
   * 100 ms, so a poll of it sees the past.)
   */
  async function lockWaits (): Promise<number> {
    const [rows] = await other.raw("SELECT COUNT(*) AS n FROM information_schema.PROCESSLIST WHERE COMMAND = 'Execute' AND TIME_MS > 100 AND INFO LIKE ?", [`%${table}%`])
    return Number((rows as Array<{ n: unknown }>)[0]!.n)
  }
  /** No call of the store waits for the pool or holds its connection: every late lease was given back. */
  async function poolIdle (): Promise<void> {
    await vi.waitFor(() => { expect(pool().numPendingAcquires() + pool().numUsed()).toBe(0) }, { timeout: 20_000, interval: 20 })
  }
  function expectNoKeyRanTwice (): void {
    const twice = [...runs].filter(([, list]) => list.length > 1).map(([key, list]) => `${key}: ${JSON.stringify(list)}`)
    expect(twice).toEqual([])
  }

  it('cancels the statements on locked rows, gives back the leases of calls it gave up on, and runs no key twice', async () => {
    // Three, each holding the one connection for STATEMENT_TIMEOUT: the pool stays busy well past
    // STORE_TIMEOUT after the other keys were sent, however slowly they arrive.
    const locked = Array.from({ length: 3 }, (_, i) => `row-${i}-${stamp}`)
    const others = Array.from({ length: 12 }, (_, i) => `other-${i}-${stamp}`)
    // Expired rows, so taking these keys means writing rows the other connection holds.
    for (const key of locked) expect(await post(key)).toBe(201)
    await other(table).whereIn('idempotency_key', locked.map((key) => Buffer.from(key))).update({ expires_at: 1 })
    runs.clear()
    const trx = await other.transaction()
    let answers: number[]
    try {
      for (const key of locked) await trx(table).where('idempotency_key', Buffer.from(key)).forUpdate().select('idempotency_key')
      // The locked keys first on the pool: each holds its one connection until the statement is
      // cancelled, so every other key's call waits past storeTimeout and is given up.
      const first = post(locked[0]!)
      await vi.waitFor(async () => { expect(await lockWaits()).toBe(1) }, { timeout: 5000, interval: 10 })
      const rest = locked.slice(1).map((key) => post(key))
      await vi.waitFor(() => { expect(pool().numPendingAcquires()).toBe(locked.length - 1) }, { timeout: 5000, interval: 5 })
      const duplicates = others.flatMap((key) => Array.from({ length: DUPLICATES }, () => post(key)))
      answers = await Promise.all([first, ...rest, ...duplicates])
    } finally {
      await trx.rollback()
    }
    expect(answers.filter((status) => status !== 503)).toEqual([])
    // The calls given up on still ran once the pool was free, and took leases: given back at once.
    await poolIdle()
    expect(await Promise.all([...locked, ...others].map((key) => post(key)))).toEqual([...locked, ...others].map(() => 201))
    expectNoKeyRanTwice()
  })

  it('never runs a handler on a lease that a gap-lock wait left lapsed: the duplicate behind it runs alone', async () => {
    const keys = Array.from({ length: 16 }, (_, i) => `gap-${i}-${stamp}`)
    runs.clear()
    const trx = await other.transaction()
    let answers: number[]
    try {
      // A locking read of a range with no rows in it: a gap lock, which every INSERT of a new key
      // in the range waits for.
      await trx(table).where('idempotency_key', '>=', Buffer.from('gap-')).andWhere('idempotency_key', '<', Buffer.from('gap.')).forUpdate().select('idempotency_key')
      const first = post(keys[0]!)
      await vi.waitFor(async () => { expect(await lockWaits()).toBe(1) }, { timeout: 5000, interval: 10 })
      const waitingSince = Date.now()
      // Its duplicates next on the pool, then other keys with theirs.
      const duplicates = keys.flatMap((key, i) => Array.from({ length: i === 0 ? DUPLICATES : DUPLICATES + 1 }, () => post(key)))
      await vi.waitFor(() => { expect(pool().numPendingAcquires()).toBe(duplicates.length) }, { timeout: 5000, interval: 5 })
      // Past the first request's lease as measured from before its wait, and within
      // statementTimeout: the INSERT goes through once the lock is gone.
      await sleep(LEASE + 200 - (Date.now() - waitingSince))
      await trx.rollback()
      answers = await Promise.all([first, ...duplicates])
    } finally {
      if (!trx.isCompleted()) await trx.rollback()
    }
    expectNoKeyRanTwice()
    await poolIdle()
    // Every key ran once, now or on its retry.
    for (const key of keys) expect([201]).toContain(await post(key))
    expect(keys.map((key) => runs.get(key)?.length)).toEqual(keys.map(() => 1))
    expect(answers.every((status) => [201, 409, 503].includes(status))).toBe(true)
  })
})
