/**
 * A soak of the MariaDB store under a transaction that holds locks on its keys, as the fault campaign
 * ran it (not part of `npm test`: test/locked-rows-mariadb.test.ts is the test, sized down):
 *
 *   npx tsx test/soak/locked-rows-mariadb.ts [runs]       (SOAK_EVENTS=1 to print what happened)
 *
 * Each run: a knex pool of one connection, lockTimeout 3 s, statementTimeout 4 s (the default),
 * storeTimeout 8 s, a handler of 1.5 s, 70 keys each sent by 4 clients at once, which retry on
 * 409 and 503 (after Retry-After, at most 1 s) until one of them gets 201. Another connection first
 * locks the range of the keys (their rows and the gaps between them, as a locking read of a range
 * does) for 7.5 s: statements wait for it, are cancelled by statementTimeout, and the calls behind
 * them on the pool are given up at storeTimeout. It prints the keys whose handler ran more than
 * once, and whether two runs overlapped.
 *
 * SOAK_LOCK_HELD=8000 SOAK_STORE_TIMEOUT=5000 SOAK_ACQUIRE_TIMEOUT=1000 runs the campaign's 8 s
 * lock with the default storeTimeout, calls failing at the pool after 1 s (knex's
 * acquireConnectionTimeout) instead of queueing behind calls already given up on.
 *
 * Before the fix, every run had one key run twice, overlapping, 61-679 ms apart (8 runs of 8;
 * 4 of 4 with the campaign's settings): the INSERT waiting for the gap lock when it ended had
 * measured its lease from before the wait. After it, no key ran twice (8 of 8, and 4 of 4).
 */
import { setTimeout as sleep } from 'node:timers/promises'
import knexFactory from 'knex'
import Fastify from 'fastify'
import idempotency, { channels, idempotencyErrorHandler, type IdempotencyEvent } from '../../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../../lib/knex.js'
import { mysqlConnection } from '../helpers/services.js'

const KEYS = 70
const CLIENTS = 4
const LOCK_TIMEOUT = 3000
const STATEMENT_TIMEOUT = Number(process.env.SOAK_STATEMENT_TIMEOUT ?? 4000)
const STORE_TIMEOUT = Number(process.env.SOAK_STORE_TIMEOUT ?? 8000)
const HANDLER = 1500
/** Not a multiple of statementTimeout: the statement waiting when the lock ends has waited ~3.5 s. */
const LOCK_HELD = Number(process.env.SOAK_LOCK_HELD ?? 7500)
const CLIENT_DEADLINE = 40_000
/** How long a call waits for the pool's connection (knex's default: 60 s). */
const ACQUIRE_TIMEOUT = Number(process.env.SOAK_ACQUIRE_TIMEOUT ?? 60_000)
const verbose = process.env.SOAK_EVENTS !== undefined

interface Run { start: number, end: number }

async function soak (run: number): Promise<{ twice: number, overlapping: number, statuses: Record<string, number> }> {
  const stamp = `${process.pid}_${Date.now()}`
  const table = `soak_locked_${stamp}`
  const knex = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 }, acquireConnectionTimeout: ACQUIRE_TIMEOUT })
  const other = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 } })
  const storage = new KnexStorage({ knex, tableName: table, createTable: true, statementTimeout: STATEMENT_TIMEOUT })
  const app = Fastify()
  await app.register(idempotency, { storage, lockTimeout: LOCK_TIMEOUT, storeTimeout: STORE_TIMEOUT })
  app.setErrorHandler(idempotencyErrorHandler())
  const t0 = Date.now()
  const runs = new Map<string, Run[]>()
  app.post('/charges', { config: { idempotency: true } }, async (request, reply) => {
    const entry = { start: Date.now() - t0, end: 0 }
    const key = request.headers['idempotency-key'] as string
    runs.set(key, [...(runs.get(key) ?? []), entry])
    await sleep(HANDLER)
    entry.end = Date.now() - t0
    reply.code(201)
    return { key }
  })
  /** What the plugin reported for each key. */
  const events = new Map<string, string[]>()
  const listeners = (['execute', 'lease-lost', 'store-error'] as const).map((outcome) => {
    const listener = (message: unknown): void => {
      const event = message as IdempotencyEvent
      const error = event.error === undefined ? '' : ` (${String((event.error as Error).message).slice(0, 80)})`
      events.set(event.idempotencyKey, [...(events.get(event.idempotencyKey) ?? []), `+${Date.now() - t0} ms ${outcome} ${event.phase ?? ''}${event.reason ?? ''}${error}`])
    }
    channels[outcome].subscribe(listener)
    return () => channels[outcome].unsubscribe(listener)
  })
  const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/charges`
  const statuses: Record<string, number> = {}
  const post = async (key: string): Promise<{ status: number, retryAfter: number }> => {
    const res = await fetch(url, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{"amount":100}' })
    await res.text()
    statuses[res.status] = (statuses[res.status] ?? 0) + 1
    return { status: res.status, retryAfter: Number(res.headers.get('retry-after') ?? 1) }
  }
  try {
    // The table exists before it is locked.
    await storage.purgeExpired()
    const trx = await other.transaction()
    await trx(table).where('idempotency_key', '>=', Buffer.from('soak-')).andWhere('idempotency_key', '<', Buffer.from('soak.')).forUpdate().select('idempotency_key')
    const lockedAt = Date.now() - t0
    const unlocked = sleep(LOCK_HELD).then(async () => {
      await trx.rollback()
      if (verbose) console.log(`    locked from +${lockedAt} ms to +${Date.now() - t0} ms`)
    })
    const done = new Set<string>()
    const until = Date.now() + CLIENT_DEADLINE
    const client = async (key: string): Promise<void> => {
      await sleep(Math.random() * 2000)
      while (!done.has(key) && Date.now() < until) {
        const { status, retryAfter } = await post(key)
        if (status === 201) done.add(key)
        else await sleep(Math.random() * Math.min(1000, retryAfter * 1000))
      }
    }
    const keys = Array.from({ length: KEYS }, (_, i) => `soak-${i}-${stamp}`)
    await Promise.all([unlocked, ...keys.flatMap((key) => Array.from({ length: CLIENTS }, () => client(key)))])
    let twice = 0
    let overlapping = 0
    for (const [key, list] of runs) {
      if (list.length < 2) continue
      twice++
      const overlap = list.some((a, i) => list.some((b, j) => i < j && b.start < a.end && a.start < b.end))
      if (overlap) overlapping++
      const first = list[0]!.start
      console.log(`  run ${run}: ${key.split('-').slice(0, 2).join('-')} ran ${list.length} times, at +${list.map((entry) => entry.start - first).join(' ms, +')} ms${overlap ? ', overlapping' : ''}`)
      if (verbose) console.log(`    runs at +${list.map((entry) => entry.start).join(' ms, +')} ms; ${(events.get(key) ?? []).join('; ')}`)
    }
    return { twice, overlapping, statuses }
  } finally {
    for (const unsubscribe of listeners) unsubscribe()
    await app.close()
    await dropIdempotencyTable(knex, table).catch(() => {})
    await knex.destroy()
    await other.destroy()
  }
}

const total = Number(process.argv[2] ?? 3)
for (let run = 1; run <= total; run++) {
  const { twice, overlapping, statuses } = await soak(run)
  console.log(`run ${run}: ${twice} of ${KEYS} keys ran twice or more (${overlapping} overlapping); answers ${JSON.stringify(statuses)}`)
}
