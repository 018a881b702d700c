/**
 * Recovery points (`request.idempotency.step`) over real HTTP on every store: results recorded and
 * returned on the next run, a failed step not recorded, a mismatch refused, values of every kind,
 * bounds, events, encryption, and transaction mode on the SQL stores.
 */
import { randomBytes } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import type { Knex } from 'knex'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyEvent, type IdempotencyOptions, type IdempotencyStorage, type TransactionalStorage } from '../lib/index.js'
import { storeCases } from './helpers/stores.js'
import { postWithKey } from './helpers/http-client.js'

const cases = await storeCases()

interface Calls { [step: string]: number }

for (const store of cases) {
  describe.skipIf(!store.available)(`recovery points on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    const apps: FastifyInstance[] = []
    const calls: Calls = {}
    /** What the next request's handler does after its first step. */
    /** Where the next run fails: after the first steps, or inside the last one. */
    let failing: 'after-first' | 'inside' | null = null
    const count = (step: string) => { calls[step] = (calls[step] ?? 0) + 1 }

    async function start (options: IdempotencyOptions = {}): Promise<string> {
      const app = Fastify()
      await app.register(idempotency, { storage, ...options })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/checkout', { config: { idempotency: true } }, async (request, reply) => {
        const step = request.idempotency!.step.bind(request.idempotency)
        const charge = await step('charge', ({ key }) => { count('charge'); return { id: 'ch_1', downstream: key } })
        const receipt = await step('receipt', () => { count('receipt'); return Buffer.from([0, 1, 2, 255]) })
        const nothing = await step('notify', () => { count('notify') })
        if (failing === 'after-first') throw new Error('the order could not be written')
        const order = await step('order', () => {
          count('order')
          if (failing === 'inside') throw new Error('order step failed')
          return ['ord_1', 7, null, { nested: true }]
        })
        reply.code(201)
        return { charge, receipt: receipt.toString('hex'), nothing: nothing === undefined, order }
      })
      apps.push(app)
      return `${await app.listen({ host: '127.0.0.1', port: 0 })}/checkout`
    }

    const post = (url: string, key: string, body: object = { amount: 1 }): Promise<{ status: number, body: string }> => postWithKey(url, key, body)

    /** One run of `key` that fails where `failure` says; the runs after it do not fail. */
    const runFailing = async (failure: 'after-first' | 'inside', url: string, key: string, body?: object): Promise<{ status: number, body: string }> => {
      failing = failure
      try {
        return await post(url, key, body)
      } finally {
        failing = null
      }
    }

    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => {
      for (const app of apps) await app.close()
      await store.cleanup()
    })

    it('returns each completed step\'s recorded result on the next run, without running it again', async () => {
      const url = await start()
      const key = `steps-${store.name}`
      for (const name of Object.keys(calls)) delete calls[name]
      expect((await runFailing('after-first', url, key)).status).toBe(500)
      const retry = await post(url, key)
      expect(retry.status).toBe(201)
      const body = JSON.parse(retry.body)
      expect(body.charge.id).toBe('ch_1')
      expect(body.charge.downstream).toMatch(/^idem_[\w-]{43}$/)
      expect(body.receipt).toBe('000102ff')
      expect(body.nothing).toBe(true)
      expect(body.order).toEqual(['ord_1', 7, null, { nested: true }])
      expect(calls).toEqual({ charge: 1, receipt: 1, notify: 1, order: 1 })
    })

    it('gives a step the same downstream key on every run, and another key another one', async () => {
      const url = await start()
      await runFailing('after-first', url, `dk-a-${store.name}`)
      const a = JSON.parse((await post(url, `dk-a-${store.name}`)).body)
      const b = JSON.parse((await post(url, `dk-b-${store.name}`)).body)
      expect(a.charge.downstream).not.toBe(b.charge.downstream)
    })

    it('does not record a step whose function threw: the next run calls it again', async () => {
      const url = await start()
      const key = `throws-${store.name}`
      for (const name of Object.keys(calls)) delete calls[name]
      expect((await runFailing('inside', url, key)).status).toBe(500)
      expect((await post(url, key)).status).toBe(201)
      expect(calls).toEqual({ charge: 1, receipt: 1, notify: 1, order: 2 })
    })

    it('refuses a step reached with another fingerprint (409 mismatch), without running it', async () => {
      const url = await start()
      const key = `mismatch-${store.name}`
      await runFailing('after-first', url, key, { amount: 1 })
      const before = calls.charge ?? 0
      const other = await post(url, key, { amount: 2 })
      expect(other.status).toBe(409)
      expect(JSON.parse(other.body).type).toMatch(/#fingerprint-mismatch$/)
      expect(calls.charge).toBe(before)
    })

    it('seals step records with encryption on, and opens them on the next run', async () => {
      const url = await start({ encryption: { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) } })
      const key = `sealed-${store.name}`
      const before = calls.charge ?? 0
      await runFailing('after-first', url, key)
      const charge = JSON.parse((await post(url, key)).body).charge
      expect(charge.id).toBe('ch_1')
      expect(calls.charge).toBe(before + 1)
      // The step's result carries its downstream key: nowhere in the store in clear.
      if (store.dump !== undefined) expect(await store.dump()).not.toContain(charge.downstream)
    })
  })
}

describe('recovery points: bounds, events, misuse', () => {
  let app: FastifyInstance
  const logged: string[] = []
  const events: IdempotencyEvent[] = []
  const listen = (message: unknown) => { events.push(message as IdempotencyEvent) }
  beforeAll(async () => {
    diagnostics.subscribe('fastify-idempotency:step-run', listen)
    diagnostics.subscribe('fastify-idempotency:step-replay', listen)
    app = Fastify({ logger: { level: 'error', stream: { write: (line: string) => { logged.push(line) } } } })
    await app.register(idempotency, { maxResponseBytes: 100 })
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/many', { config: { idempotency: true } }, async (request) => {
      for (let i = 0; i <= 100; i++) await request.idempotency!.step(`s${i}`, () => i)
      return {}
    })
    app.post('/large', { config: { idempotency: true } }, async (request) => await request.idempotency!.step('big', () => 'x'.repeat(200)))
    app.post('/function', { config: { idempotency: true } }, async (request) => await request.idempotency!.step('fn', () => (() => 1) as unknown as number))
    app.post('/unnamed', { config: { idempotency: true } }, async (request) => await request.idempotency!.step('', () => 1))
    app.post('/line-feed', { config: { idempotency: true } }, async (request) => await request.idempotency!.step('a\nb', () => 1))
    app.post('/once', { config: { idempotency: true } }, async (request) => {
      const first = await request.idempotency!.step('a', () => 1)
      const again = await request.idempotency!.step('a', () => 2)
      return { first, again }
    })
  })
  afterAll(async () => {
    diagnostics.unsubscribe('fastify-idempotency:step-run', listen)
    diagnostics.unsubscribe('fastify-idempotency:step-replay', listen)
    await app.close()
  })
  const post = (url: string, key: string) => app.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })

  it.each([
    ['/many', 'at most 100 distinct steps'],
    ['/unnamed', 'needs a name'],
    ['/line-feed', 'holds no line feed']
  ])('fails %s with a clear error', async (url, message) => {
    logged.length = 0
    expect((await post(url, `${url}-k`)).statusCode).toBe(500)
    expect(logged.join('')).toContain(message)
  })

  it.each([
    ['/large', 'kept up to maxResponseBytes (100)'],
    ['/function', 'a value that cannot be kept']
  ])('goes on with a result of %s that cannot be recorded, and logs why', async (url, message) => {
    logged.length = 0
    expect((await post(url, `${url}-k`)).statusCode).toBe(200)
    expect(logged.join('')).toContain(message)
    expect(logged.join('')).toContain('#result-not-recorded')
  })

  it('refuses a codec whose serialize or deserialize is not a function', async () => {
    const local = Fastify()
    await local.register(idempotency)
    local.post('/bad', { config: { idempotency: true } }, async (request) => await request.idempotency!.step('s', () => 1, { serialize: 'json', deserialize: String } as never))
    const res = await local.inject({ method: 'POST', url: '/bad', headers: { 'idempotency-key': 'bad-1' }, payload: {} })
    expect(res.statusCode).toBe(500)
    expect(res.json().message).toMatch(/a codec of serialize and deserialize functions/)
    await local.close()
  })

  it('runs a step name once per run: the second call returns the first result', async () => {
    expect((await post('/once', 'once-1')).json()).toEqual({ first: 1, again: 1 })
  })

  it('publishes step-run and step-replay with the step name', async () => {
    events.length = 0
    await post('/once', 'events-1')
    expect(events.map((e) => [e.outcome, e.step])).toEqual([['step-run', 'a'], ['step-replay', 'a']])
  })
})

// Store cases of their own: a case is created and cleaned up once.
for (const store of (await storeCases()).filter((item) => item.knex !== undefined)) {
  describe.skipIf(!store.available)(`recovery points in transaction mode on ${store.name}${store.reason}`, () => {
    let app: FastifyInstance
    let knex: Knex
    const table = `steps_trx_${process.pid}_${Date.now()}`
    let fail = true
    let url = ''

    beforeAll(async () => {
      const storage = await store.create()
      knex = store.knex!()
      await knex.schema.createTable(table, (t) => { t.increments('id'); t.string('entry') })
      app = Fastify()
      await app.register(idempotency, { storage, transaction: true })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/pay', { config: { idempotency: true } }, async (request, reply) => {
        await request.idempotency!.step('ledger', async ({ transaction }) => {
          await (transaction as Knex.Transaction)(table).insert({ entry: 'debit' })
          return 'ok'
        })
        await (request.idempotency!.transaction as Knex.Transaction)(table).insert({ entry: 'order' })
        if (fail) throw new Error('after the ledger step')
        reply.code(201)
        return { ok: true }
      })
      url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/pay`
    })
    afterAll(async () => {
      await app.close()
      await knex.schema.dropTableIfExists(table)
      await store.cleanup()
    })

    it.skipIf(store.name === 'sqlite')('commits a step\'s own writes with its record though the handler fails later; the retry does not repeat them', async () => {
      const post = async () => (await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': 'trx-1' }, body: '{}' })).status
      const entries = async () => (await knex(table).select('entry').orderBy('id') as Array<{ entry: string }>).map((row) => row.entry)
      expect(await post()).toBe(500)
      // The step's write committed with its record; the handler's own write was rolled back.
      expect(await entries()).toEqual(['debit'])
      fail = false
      expect(await post()).toBe(201)
      expect(await entries()).toEqual(['debit', 'order'])
    })

    it.skipIf(store.name !== 'sqlite')('refuses a step in transaction mode on SQLite at once, naming why', async () => {
      const started = Date.now()
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': 'trx-sqlite' }, body: '{}' })
      expect(res.status).toBe(500)
      expect(Date.now() - started).toBeLessThan(2000)
      expect(await knex(table).count({ n: '*' })).toEqual([{ n: 0 }])
    })
  })
}

describe('recovery points when the store fails', () => {
  /** MemoryStorage, with faults switched on for step records (keys that start with NUL + 'step:'). */
  const inner = new MemoryStorage()
  const faults = { begin: false, complete: false, completeFalse: false, transaction: false, stepTransaction: false, trxCompleteFalse: false }
  let openTransactions = 0
  const isStep = (key: string) => key.startsWith('\u0000step:')
  const rolledBack: string[] = []
  const storage: TransactionalStorage = {
    begin: async (key, fingerprint, lockTimeout) => {
      if (faults.begin && isStep(key)) throw new Error('store down')
      return await inner.begin(key, fingerprint, lockTimeout)
    },
    complete: async (key, token, response, expiration) => {
      if (isStep(key) && faults.complete) throw new Error('write failed')
      if (isStep(key) && faults.completeFalse) return false
      return await inner.complete(key, token, response, expiration)
    },
    release: async (key, token) => await inner.release(key, token),
    renew: async (key, token, lockTimeout) => await inner.renew(key, token, lockTimeout),
    transaction: async () => {
      if (faults.transaction || (faults.stepTransaction && openTransactions > 0)) throw new Error('no connection')
      openTransactions++
      return {
        handle: {},
        complete: async (key, token, response, expiration) => faults.trxCompleteFalse && isStep(key) ? false : await inner.complete(key, token, response, expiration),
        commit: async () => { openTransactions-- },
        rollback: async () => { openTransactions--; rolledBack.push('rollback') }
      }
    }
  }
  let runs = 0
  let app: FastifyInstance
  beforeAll(async () => {
    app = Fastify()
    await app.register(idempotency, { storage })
    app.setErrorHandler(idempotencyErrorHandler())
    const handler = async (request: FastifyRequest) => ({ value: await request.idempotency!.step('s', () => ++runs) })
    app.post('/plain', { config: { idempotency: true } }, handler)
    app.post('/trx', { config: { idempotency: { transaction: true } } }, handler)
    app.post('/open', { config: { idempotency: { failOpen: true } } }, handler)
    app.post('/late', { config: { idempotency: true } }, async (request, reply) => {
      reply.code(201).send({ ok: true })
      await new Promise((resolve) => setTimeout(resolve, 20))
      await request.idempotency!.step('too-late', () => 1).catch((error: Error) => { lateError = error.message })
      return reply
    })
  })
  let lateError = ''
  afterAll(async () => { await app.close() })
  const post = (url: string, key: string) => app.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })
  const reset = () => { for (const name of Object.keys(faults) as Array<keyof typeof faults>) faults[name] = false }

  it('answers 503 when the store fails at the step, and runs nothing', async () => {
    reset()
    faults.begin = true
    const before = runs
    const res = await post('/plain', 'f-begin')
    expect(res.statusCode).toBe(503)
    expect(runs).toBe(before)
  })

  it('answers 503 when the record cannot be written, and the retry runs the step again', async () => {
    for (const fault of ['complete', 'completeFalse'] as const) {
      reset()
      faults[fault] = true
      const before = runs
      expect((await post('/plain', `f-${fault}`)).statusCode).toBe(503)
      faults[fault] = false
      expect((await post('/plain', `f-${fault}`)).statusCode).toBe(200)
      expect(runs).toBe(before + 2)
    }
  })

  it('in transaction mode: 503 when the step\'s transaction cannot be opened or its record is refused (rolled back)', async () => {
    reset()
    faults.transaction = true
    const before = runs
    expect((await post('/trx', 'f-trx-open')).statusCode).toBe(503)
    reset()
    faults.stepTransaction = true
    expect((await post('/trx', 'f-trx-step-open')).statusCode).toBe(503)
    expect(runs).toBe(before)
    reset()
    faults.trxCompleteFalse = true
    rolledBack.length = 0
    expect((await post('/trx', 'f-trx-complete')).statusCode).toBe(503)
    expect(rolledBack.length).toBeGreaterThan(0)
  })

  it('answers 409 in progress when another run holds the step, and 409 unreadable for a record it cannot read', async () => {
    reset()
    await app.ready()
    // Another run holds this step's record: reach the same step key through the first run's lease.
    const first = await post('/plain', 'f-held')
    expect(first.statusCode).toBe(200)
    const stepKeys: string[] = []
    const spy = storage.begin
    storage.begin = async (key, fingerprint, lockTimeout) => {
      if (isStep(key)) { stepKeys.push(key); return { state: 'in-flight', fingerprint, lockExpiresAt: Date.now() + 5000 } }
      return await spy(key, fingerprint, lockTimeout)
    }
    try {
      const held = await post('/plain', 'f-held-2')
      expect(held.statusCode).toBe(409)
      expect(held.json().type).toMatch(/#request-in-progress$/)
      storage.begin = async (key, fingerprint, lockTimeout) => {
        if (isStep(key)) return { state: 'completed', fingerprint, response: { statusCode: 200, contentType: 'text/plain', headers: {}, body: Buffer.from('?') } }
        return await spy(key, fingerprint, lockTimeout)
      }
      const unreadable = await post('/plain', 'f-unreadable')
      expect(unreadable.statusCode).toBe(409)
      expect(unreadable.json().type).toMatch(/#stored-response-unreadable$/)
    } finally {
      storage.begin = spy
    }
    expect(stepKeys).toHaveLength(1)
  })

  it('runs the step unrecorded when the request runs unprotected (failOpen), and refuses a step after the response was sent', async () => {
    reset()
    faults.begin = true
    const outage = inner.begin.bind(inner)
    inner.begin = async () => { throw new Error('down') }
    try {
      const before = runs
      expect((await post('/open', 'f-open')).json()).toEqual({ value: before + 1 })
    } finally {
      inner.begin = outage
    }
    reset()
    await post('/late', 'f-late')
    await new Promise((resolve) => setTimeout(resolve, 50))
    expect(lateError).toMatch(/called after the response was sent/)
  })
})
