/**
 * Transaction mode on one database at one isolation level, as an app would use it: the five
 * workloads the matrix runs on each store and level (test/transaction-isolation*.test.ts).
 *
 * - distinct keys at once, no rows shared: every request commits;
 * - duplicates of one key at once: the handler runs once;
 * - a handler longer than `lockTimeout`: its lease holds, it runs once and commits, and a
 *   duplicate sent after the first lease would have lapsed does not run;
 * - recovery points: a request that fails after its step is retried, and the step is not run again
 *   (on a store with one connection, refused at once);
 * - a real write conflict: every request increments one shared row; each either commits or is
 *   answered 503 with Retry-After and keeps nothing, and its retry commits.
 *
 * Each workload adds its counts to `MATRIX_COUNTS` (commits, aborts, runs per key), which
 * docs/transactions.md records; `IDEMPOTENCY_MATRIX_REPORT=1` prints them after the file.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify, { type FastifyInstance } from 'fastify'
import type { Knex } from 'knex'
import idempotency, { idempotencyErrorHandler, type IdempotencyRouteOptions } from '../../lib/index.js'
import { KnexStorage, dropIdempotencyTable, transactionOf } from '../../lib/knex.js'
import { newKey } from './app.js'
import { scaled } from './pace.js'
import type { Availability } from './services.js'

export interface MatrixTarget {
  /** How the suite names it: the store and the level. */
  label: string
  availability: Availability
  connect: () => Knex
  /** The routes' `transaction` option. */
  transaction: NonNullable<IdempotencyRouteOptions['transaction']>
  /** Whether recovery points can run beside the request's transaction (not with one connection). */
  steps: boolean
}

/**
 * What one workload counted: requests committed, replayed, refused as in progress (409) and
 * aborted (503, over every round of retries), the most runs of the handler for one key, and the
 * rounds of requests it took until every key had committed.
 */
export interface MatrixCount {
  target: string
  workload: string
  commits: number
  replays: number
  inProgress: number
  aborts: number
  maxRunsPerKey: number
  rounds: number
}

export const MATRIX_COUNTS: MatrixCount[] = []

/** Short, and scaled: the long handler outlives it by half, the renewals come every eighth of it. */
const LOCK_TIMEOUT = scaled(500)
const CONCURRENT = 18

interface Answer { key: string, status: number, replayed: boolean, retryAfter: string | undefined, body: string }

export function transactionMatrix (target: MatrixTarget): void {
  describe.skipIf(!target.availability.available)(`transaction mode, ${target.label}${target.availability.reason}`, () => {
    const stamp = `${process.pid}_${Date.now().toString(36)}_${Math.floor(Math.random() * 1e6)}`
    const table = `trxm_${stamp}`
    const orders = `${table}_orders`
    const counter = `${table}_counter`
    const ledger = `${table}_ledger`
    let knex: Knex
    let app: FastifyInstance | undefined
    /** Runs of each handler, per key. */
    const runs = new Map<string, number>()
    const charges = new Map<string, number>()
    /** Called when a handler with this key starts. */
    const started = new Map<string, () => void>()
    const count = (map: Map<string, number>, key: string): number => {
      const n = (map.get(key) ?? 0) + 1
      map.set(key, n)
      return n
    }

    beforeAll(async () => {
      knex = target.connect()
      await knex.schema.createTable(orders, (t) => { t.increments('id'); t.string('idem_key', 200).notNullable() })
      await knex.schema.createTable(counter, (t) => { t.integer('id').primary(); t.integer('n').notNullable() })
      await knex.schema.createTable(ledger, (t) => { t.increments('id'); t.string('idem_key', 200).notNullable(); t.integer('seen').notNullable() })
      await knex(counter).insert({ id: 1, n: 0 })
      // MATRIX_LOG=1: the plugin's warnings and errors, with the driver's error behind each 503.
      app = Fastify({ logger: process.env.MATRIX_LOG === '1' ? { level: 'warn' } : false })
      await app.register(idempotency, { storage: new KnexStorage({ knex, tableName: table, createTable: true }), lockTimeout: LOCK_TIMEOUT, transaction: target.transaction })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.idempotency!.key
        count(runs, key)
        started.get(key)?.()
        const trx = transactionOf(request)
        await trx(orders).insert({ idem_key: key })
        const { hold } = request.body as { hold?: number }
        if (hold !== undefined) {
          // A read first, as a handler that checks before it writes: the transaction's snapshot
          // is taken here, before any renewal of its lease.
          await trx(counter).where({ id: 1 }).first()
          // The scenario is a handler that takes this long, not a race to win.
          await sleep(hold)
        }
        reply.code(201)
        return { key }
      })
      app.post('/steps', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.idempotency!.key
        const run = count(runs, key)
        const charge = await request.idempotency!.step('charge', () => count(charges, key))
        await transactionOf(request)(orders).insert({ idem_key: key })
        if (run === 1) throw new Error('the first attempt fails after its step')
        reply.code(201)
        return { charge }
      })
      app.post('/conflict', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.idempotency!.key
        count(runs, key)
        const trx = transactionOf(request)
        const { n } = await trx(counter).where({ id: 1 }).first() as { n: number }
        await trx(counter).where({ id: 1 }).update({ n: trx.raw('n + 1') })
        await trx(ledger).insert({ idem_key: key, seen: n })
        reply.code(201)
        return { seen: n }
      })
      await app.ready()
    })

    afterAll(async () => {
      if (knex !== undefined) await dropApp({ app, knex, tables: [orders, counter, ledger], storeTable: table })
    })

    const send = async (url: string, key: string, body: object = {}): Promise<Answer> => {
      const res = await app!.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: body })
      return { key, status: res.statusCode, replayed: res.headers['idempotent-replayed'] === 'true', retryAfter: res.headers['retry-after'] as string | undefined, body: res.body }
    }
    const rowsOf = async (name: string, key: string): Promise<number> => Number((await knex(name).where({ idem_key: key }).count({ n: '*' }))[0]!.n)
    const record = (workload: string, answers: Answer[], keys: string[], rounds = 1): void => {
      MATRIX_COUNTS.push({
        target: target.label,
        workload,
        commits: answers.filter((a) => a.status === 201 && !a.replayed).length,
        replays: answers.filter((a) => a.status === 201 && a.replayed).length,
        inProgress: answers.filter((a) => a.status === 409).length,
        aborts: answers.filter((a) => a.status === 503).length,
        maxRunsPerKey: Math.max(...keys.map((key) => runs.get(key) ?? 0)),
        rounds
      })
    }

    it(`commits ${CONCURRENT} concurrent requests with distinct keys and no shared rows: none aborts`, async () => {
      const keys = Array.from({ length: CONCURRENT }, () => newKey('distinct'))
      const answers = await Promise.all(keys.map((key) => send('/orders', key)))
      record('distinct keys', answers, keys)
      expect(answers.filter((a) => a.status !== 201).map((a) => `${a.status} ${a.body}`)).toEqual([])
      for (const key of keys) {
        expect(await rowsOf(orders, key)).toBe(1)
        expect(runs.get(key)).toBe(1)
      }
    })

    it('runs the handler once for 10 concurrent duplicates', async () => {
      const key = newKey('dup')
      const answers = await Promise.all(Array.from({ length: 10 }, () => send('/orders', key)))
      record('duplicates', answers, [key])
      expect(answers.filter((a) => a.status === 201 && !a.replayed)).toHaveLength(1)
      expect(answers.filter((a) => !(a.status === 409 || (a.status === 201 && a.replayed)) && !(a.status === 201 && !a.replayed)).map((a) => `${a.status} ${a.body}`)).toEqual([])
      expect(runs.get(key)).toBe(1)
      expect(await rowsOf(orders, key)).toBe(1)
    })

    it('keeps the lease of a handler that outlives lockTimeout: it commits once, and a duplicate sent after lockTimeout does not run', async () => {
      const key = newKey('long')
      const entered = new Promise<void>((resolve) => started.set(key, resolve))
      const first = send('/orders', key, { hold: Math.round(LOCK_TIMEOUT * 1.6) })
      await entered
      // Past the lease the first request took: only its renewal can keep the key.
      await sleep(Math.round(LOCK_TIMEOUT * 1.15))
      const duplicate = await send('/orders', key, { hold: Math.round(LOCK_TIMEOUT * 1.6) })
      const answer = await first
      record('longer than lockTimeout', [answer, duplicate], [key])
      expect(`${answer.status} ${answer.body}`).toBe(`201 ${JSON.stringify({ key })}`)
      expect(answer.replayed).toBe(false)
      expect(runs.get(key)).toBe(1)
      expect(await rowsOf(orders, key)).toBe(1)
      expect([409, 201]).toContain(duplicate.status)
      expect(duplicate.status === 409 || duplicate.replayed).toBe(true)
    })

    if (target.steps) {
      it('keeps what a recovery point did: the retry of a request that failed after its step does not run the step again', async () => {
        const key = newKey('steps')
        const failed = await send('/steps', key)
        expect(failed.status).toBe(500)
        expect(await rowsOf(orders, key)).toBe(0)
        const retry = await send('/steps', key)
        record('recovery points', [failed, retry], [key])
        expect(`${retry.status} ${retry.body}`).toBe(`201 ${JSON.stringify({ charge: 1 })}`)
        expect(charges.get(key)).toBe(1)
        expect(runs.get(key)).toBe(2)
        expect(await rowsOf(orders, key)).toBe(1)
      })
    } else {
      it('refuses a recovery point at once: the store has one connection, which the request\'s transaction holds', async () => {
        const key = newKey('steps')
        const startedAt = Date.now()
        const refused = await send('/steps', key)
        record('recovery points', [refused], [key])
        expect(refused.status).toBe(500)
        expect(Date.now() - startedAt).toBeLessThan(scaled(2000))
        expect(charges.get(key)).toBeUndefined()
        expect(await rowsOf(orders, key)).toBe(0)
      })
    }

    it('answers a real write conflict on a shared row with 503 and Retry-After, keeps nothing of it, and commits its retry', async () => {
      const keys = Array.from({ length: 8 }, () => newKey('conflict'))
      const before = Number((await knex(counter).where({ id: 1 }).first() as { n: number }).n)
      let answers = await Promise.all(keys.map((key) => send('/conflict', key)))
      const all = [...answers]
      const notRetriable = (list: Answer[]): string[] => list.filter((a) => a.status !== 201 && (a.status !== 503 || a.retryAfter === undefined || !a.body.includes('#store-unavailable'))).map((a) => `${a.status} ${a.body}`)
      expect(notRetriable(answers)).toEqual([])
      const committed = answers.filter((a) => a.status === 201).length
      expect(Number((await knex(counter).where({ id: 1 }).first() as { n: number }).n)).toBe(before + committed)
      expect(Number((await knex(ledger).whereIn('idem_key', keys).count({ n: '*' }))[0]!.n)).toBe(committed)
      // The retries, until each key has committed once: a refused request kept nothing, so each
      // retry runs again.
      let rounds = 1
      for (; rounds <= keys.length + 1 && answers.some((a) => a.status !== 201); rounds++) {
        answers = await Promise.all(answers.map(async (a) => a.status === 201 ? a : await send('/conflict', a.key)))
        all.push(...answers.filter((a) => !all.includes(a)))
      }
      record('write conflict', all, keys, rounds)
      expect(notRetriable(all)).toEqual([])
      expect(answers.map((a) => a.status)).toEqual(keys.map(() => 201))
      expect(Number((await knex(counter).where({ id: 1 }).first() as { n: number }).n)).toBe(before + keys.length)
      for (const key of keys) expect(await rowsOf(ledger, key)).toBe(1)
    })
  })
}

/**
 * What a test file's transaction-mode app leaves: the app closed, the tables its handlers wrote and
 * the store's table dropped (on `knex`), then `knex` and the file's other knex instances destroyed.
 */
export async function dropApp ({ app, knex, tables, storeTable, others = [] }: { app: FastifyInstance | undefined, knex: Knex, tables: string[], storeTable: string, others?: Knex[] }): Promise<void> {
  await app?.close()
  for (const name of tables) await knex.schema.dropTableIfExists(name)
  await dropIdempotencyTable(knex, storeTable)
  for (const instance of [knex, ...others]) await instance.destroy()
}

/** Print the counts (with IDEMPOTENCY_MATRIX_REPORT=1), for docs/transactions.md. */
export function reportMatrix (): void {
  afterAll(() => {
    if (process.env.IDEMPOTENCY_MATRIX_REPORT !== '1') return
    for (const c of MATRIX_COUNTS) console.log(`MATRIX | ${c.target} | ${c.workload} | ${c.commits} | ${c.replays} | ${c.inProgress} | ${c.aborts} | ${c.maxRunsPerKey} | ${c.rounds}`)
  })
}
