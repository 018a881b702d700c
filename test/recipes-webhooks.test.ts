/**
 * The webhook recipe (docs/jobs.md#webhooks, examples/recipes/standard-webhooks.ts): two receiver
 * processes on one KnexStorage table of the shared PostgreSQL, in transaction mode, each event a
 * credit row in PostgreSQL, counted there. The test is the provider: it signs deliveries as
 * Standard Webhooks says (with the reference library), retries them, forges them, delays and kills
 * a receiver; every event is credited exactly once, and a refused delivery stores nothing.
 */
import { randomBytes } from 'node:crypto'
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { Webhook } from 'standardwebhooks'
import { KnexStorage, createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { createIdempotency, type StandaloneIdempotency } from '../lib/standalone.js'
import { POSTGRES, pgConnection, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'

const postgres = await service(POSTGRES)
const run = `${process.pid}_${Date.now()}`
const STORE_TABLE = `recipes_hooks_keys_${run}`
const CREDITS_TABLE = `recipes_hooks_credits_${run}`
const SECRET = `whsec_${randomBytes(24).toString('base64')}`
const URL_PATH = '/webhooks/payments'
/** A killed receiver's event is free for another after this. */
const LOCK_TIMEOUT = 1000

interface Answer { status: number, headers: Headers, body: string }

describe.skipIf(!postgres.available)(`Webhook recipe: each Standard Webhooks event credited once, a refused delivery storing nothing${postgres.reason}`, () => {
  let knex: Knex
  let receivers: Worker[] = []
  let inspector: StandaloneIdempotency
  let events = 0

  beforeAll(async () => {
    knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
    await createIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.createTable(CREDITS_TABLE, (t) => { t.increments('id'); t.string('event_id').notNullable(); t.integer('amount').notNullable(); t.integer('pid').notNullable() })
    receivers = await Promise.all([1, 2].map(async () => await startWorker('webhook-receiver.ts', { STORE_TABLE, CREDITS_TABLE, SECRET, LOCK_TIMEOUT: String(LOCK_TIMEOUT) })))
    inspector = createIdempotency({ storage: new KnexStorage({ knex, tableName: STORE_TABLE }) })
  })

  afterAll(async () => {
    await killWorkers()
    await inspector.close()
    await dropIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.dropTable(CREDITS_TABLE)
    await knex.destroy()
  })

  const portOf = (receiver: Worker): string => receiver.lines.find((line) => line.startsWith('READY '))!.split(' ')[1]!
  const newEvent = (amount = 4200) => ({ id: `msg_${run}_${++events}`, payload: JSON.stringify({ type: 'payment.succeeded', data: { paymentId: `pay_${events}`, amount } }) })

  /** One delivery of the provider, signed now (or at `at`, or with another secret), to `receiver`. */
  async function deliver (receiver: Worker, { id, payload }: { id: string, payload: string }, options: { at?: Date, secret?: string, body?: string, test?: string } = {}): Promise<Answer> {
    const at = options.at ?? new Date()
    const headers: Record<string, string> = {
      'content-type': 'application/json',
      'webhook-id': id,
      'webhook-timestamp': String(Math.floor(at.getTime() / 1000)),
      'webhook-signature': new Webhook(options.secret ?? SECRET).sign(id, at, payload)
    }
    if (options.test !== undefined) headers['x-test'] = options.test
    const res = await fetch(`http://127.0.0.1:${portOf(receiver)}${URL_PATH}`, { method: 'POST', headers, body: options.body ?? payload })
    return { status: res.status, headers: res.headers, body: await res.text() }
  }

  const credits = async (id: string): Promise<Array<{ id: number, pid: number }>> => await knex(CREDITS_TABLE).where({ event_id: id }).select('id', 'pid')
  const stored = async (id: string): Promise<string> => (await inspector.inspect(id, { scope: `webhook:${URL_PATH}` })).state

  it('the provider\'s retries of an event are answered from the store, by either receiver', async () => {
    const [a, b] = receivers as [Worker, Worker]
    const event = newEvent()
    const first = await deliver(a, event)
    expect(first.status).toBe(200)
    for (const receiver of [a, b]) {
      const retry = await deliver(receiver, event)
      expect(retry.status).toBe(200)
      expect(retry.headers.get('idempotent-replayed')).toBe('true')
      expect(retry.body).toBe(first.body)
    }
    expect(await credits(event.id)).toEqual([{ id: JSON.parse(first.body).credited, pid: a.pid }])
  })

  it('a forged, altered or stale delivery is refused with 401 and stores nothing: the genuine one is then credited once', async () => {
    const [a] = receivers as [Worker]
    const event = newEvent()
    const forged = await deliver(a, event, { secret: `whsec_${randomBytes(24).toString('base64')}` })
    const altered = await deliver(a, event, { body: event.payload.replace('4200', '1') })
    const stale = await deliver(a, event, { at: new Date(Date.now() - 10 * 60_000) })
    expect([forged.status, altered.status, stale.status]).toEqual([401, 401, 401])
    expect(await stored(event.id)).toBe('absent')
    expect(await credits(event.id)).toEqual([])

    const genuine = await deliver(a, event)
    expect(genuine.status).toBe(200)
    expect(await stored(event.id)).toBe('stored')
    expect(await credits(event.id)).toHaveLength(1)
  })

  it('a retry while the first delivery is still handled gets 409 with Retry-After, and the one after it the kept answer', async () => {
    const [a, b] = receivers as [Worker, Worker]
    const event = newEvent()
    const slow = deliver(a, event, { test: 'hold' })
    await a.line(`HANDLING ${event.id}`)
    const early = await deliver(b, event)
    expect(early.status).toBe(409)
    expect(JSON.parse(early.body).type).toMatch(/#request-in-progress$/)
    expect(Number(early.headers.get('retry-after'))).toBeGreaterThanOrEqual(1)
    a.send(`RELEASE ${event.id}`)
    const first = await slow
    expect(first.status).toBe(200)
    const late = await deliver(b, event)
    expect([late.status, late.headers.get('idempotent-replayed'), late.body]).toEqual([200, 'true', first.body])
    expect(await credits(event.id)).toHaveLength(1)
  })

  it('a receiver killed after its credit was written, before the commit: the credit rolls back, and the provider\'s retries reach the other receiver, which credits it once', async () => {
    const [a, b] = receivers as [Worker, Worker]
    const event = newEvent()
    const lost = deliver(a, event, { test: 'hang' }).catch((error: unknown) => error)
    await a.line(`HANGING ${event.id}`)
    await a.kill('SIGKILL')
    expect(await lost).toBeInstanceOf(Error)
    expect(await credits(event.id)).toEqual([])
    // The provider retries on its schedule; this one follows Retry-After, ten times at most.
    let answer = await deliver(b, event)
    for (let attempt = 1; answer.status === 409 && attempt < 10; attempt++) {
      await sleep(Number(answer.headers.get('retry-after-ms') ?? 1000))
      answer = await deliver(b, event)
    }
    expect(answer.status).toBe(200)
    expect(await credits(event.id)).toEqual([{ id: JSON.parse(answer.body).credited, pid: b.pid }])
  })

  it('docs/jobs.md shows the receiver these tests run', () => {
    expectDocumented('standard-webhooks.ts')
  })
})
