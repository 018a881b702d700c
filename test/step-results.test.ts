/**
 * What a recovery point keeps of its result, over real HTTP on every store: BigInts, Dates and
 * circular plain objects come back as they went in; a result the record cannot hold (a class
 * instance such as an HTTP client's response, a function, one over maxResponseBytes) never makes
 * the step run twice, over any number of retries: the run that ran it goes on, later runs are
 * refused with 409 #result-not-recorded; a codec (`serialize`, `deserialize`) keeps anything else.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import type { Knex } from 'knex'
import idempotency, { idempotencyErrorHandler, IdempotencyResultNotRecordedError, type IdempotencyStorage, type ValueCodec } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'
import { storeCases } from './helpers/stores.js'

const RETRIES = 3

/** An HTTP client's response: an instance of its class, which refers to itself. */
class ClientResponse {
  readonly status = 201
  readonly id = 9007199254740993n
  readonly self: ClientResponse
  constructor () { this.self = this }
}

/** A plain object that refers to itself. */
function circular (): { id: bigint, self?: unknown } {
  const value: { id: bigint, self?: unknown } = { id: 9007199254740993n }
  value.self = value
  return value
}

/** What each step returns, by the route's name. */
const results: Record<string, () => unknown> = {
  bigint: () => ({ id: 9007199254740993n, rows: [1n, { total: -42n }] }),
  date: () => ({ at: new Date('2024-02-29T12:34:56.789Z'), list: [new Date(0)] }),
  circular,
  instance: () => new ClientResponse(),
  oversized: () => 'x'.repeat(2048),
  function: () => () => 1
}

const codec: ValueCodec<ClientResponse | { status: number, id: bigint }> = {
  serialize: (response) => JSON.stringify({ status: response.status, id: String(response.id) }),
  deserialize: (data) => {
    const { status, id } = JSON.parse(data.toString()) as { status: number, id: string }
    return { status, id: BigInt(id) }
  }
}

for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`step results on ${store.name}${store.reason}`, () => {
    let app: FastifyInstance
    let url = ''
    const calls = new Map<string, number>()
    /** Keys whose next run fails after its step, so that its response is not stored. */
    const failing = new Set<string>()

    beforeAll(async () => {
      const storage: IdempotencyStorage = await store.create()
      app = Fastify()
      await app.register(idempotency, { storage, maxResponseBytes: 1024 })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/:kind', { config: { idempotency: { fingerprint: { path: true } } } }, async (request, reply) => {
        const { kind } = request.params as { kind: string }
        const key = request.headers['idempotency-key'] as string
        const made = kind === 'serialized' ? () => new ClientResponse() : results[kind]!
        const value = await request.idempotency!.step('insert', () => {
          calls.set(key, (calls.get(key) ?? 0) + 1)
          return made()
        }, kind === 'serialized' ? codec as ValueCodec<unknown> : undefined)
        if (failing.delete(key)) throw new Error('the order could not be written after the insert')
        reply.code(201)
        return shown(value)
      })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })
    afterAll(async () => {
      await app?.close()
      await store.cleanup()
    })

    /** A first run that fails after its step, then `RETRIES` retries: the answers of the retries. */
    const retried = async (kind: string): Promise<{ key: string, answers: Array<{ status: number, body: string }> }> => {
      const key = newKey()
      failing.add(key)
      expect((await postWithKey(`${url}/${kind}`, key)).status).toBe(500)
      const answers = []
      for (let i = 0; i < RETRIES; i++) answers.push(await postWithKey(`${url}/${kind}`, key))
      return { key, answers }
    }

    for (const kind of ['bigint', 'date', 'circular']) {
      it(`keeps a ${kind} result by type: the retry gets the step's first result, and the step ran once`, async () => {
        const { key, answers } = await retried(kind)
        expect(answers[0]!.status).toBe(201)
        expect(JSON.parse(answers[0]!.body)).toEqual(shown(results[kind]!()))
        expect(answers.slice(1).every((answer) => answer.status === 201)).toBe(true)
        expect(calls.get(key)).toBe(1)
      })
    }

    for (const kind of ['instance', 'oversized', 'function']) {
      it(`runs a step whose ${kind} result cannot be recorded once over ${RETRIES} retries: each is refused with 409 #result-not-recorded`, async () => {
        const { key, answers } = await retried(kind)
        for (const answer of answers) {
          expect(answer.status).toBe(409)
          expect(JSON.parse(answer.body)).toMatchObject({ type: IdempotencyResultNotRecordedError.type, status: 409, idempotencyKey: key })
        }
        expect(calls.get(key)).toBe(1)
      })
    }

    it('answers the run that ran a step whose result cannot be recorded with its own result: the run goes on', async () => {
      const key = newKey()
      const first = await postWithKey(`${url}/instance`, key)
      expect(first.status).toBe(201)
      expect(JSON.parse(first.body)).toEqual(shown(new ClientResponse()))
      const again = await postWithKey(`${url}/instance`, key)
      expect([again.status, again.replayed]).toEqual([201, true])
      expect(calls.get(key)).toBe(1)
    })

    it('keeps what a codec\'s serialize makes of a result, and gives later runs what its deserialize makes of it', async () => {
      const { key, answers } = await retried('serialized')
      expect(answers.map((answer) => answer.status)).toEqual([201, 201, 201])
      expect(JSON.parse(answers[0]!.body)).toEqual({ status: 201, id: 'bigint:9007199254740993' })
      expect(calls.get(key)).toBe(1)
    })

    it.skipIf(store.knex === undefined || store.name === 'sqlite')('in transaction mode, commits the step\'s writes with the record that its result was lost', async () => {
      const knex = store.knex!()
      const table = `lost_${process.pid}_${Date.now()}`
      await knex.schema.createTable(table, (t) => { t.increments('id'); t.string('entry') })
      const trx = Fastify()
      const opened = await store.open()
      try {
        await trx.register(idempotency, { storage: opened.storage, transaction: true })
        trx.setErrorHandler(idempotencyErrorHandler())
        let fail = true
        trx.post('/pay', { config: { idempotency: true } }, async (request) => {
          await request.idempotency!.step('ledger', async ({ transaction }) => {
            await (transaction as Knex.Transaction)(table).insert({ entry: 'debit' })
            return new ClientResponse()
          })
          if (fail) throw new Error('after the ledger step')
          return { ok: true }
        })
        const trxUrl = `${await trx.listen({ host: '127.0.0.1', port: 0 })}/pay`
        const key = newKey()
        expect((await postWithKey(trxUrl, key)).status).toBe(500)
        fail = false
        expect((await postWithKey(trxUrl, key)).status).toBe(409)
        expect(await knex(table).count({ n: '*' })).toEqual([{ n: store.name === 'postgres' ? '1' : 1 }])
      } finally {
        await trx.close()
        await opened.close()
        await knex.schema.dropTableIfExists(table)
      }
    })
  })
}

/** A step result as JSON can show it: BigInts and Dates named by type, so that a wrong type shows. */
function shown (value: unknown): unknown {
  return JSON.parse(JSON.stringify(value, function (this: Record<string, unknown>, name, item: unknown) {
    const original = this[name]
    if (typeof original === 'bigint') return `bigint:${original}`
    if (original instanceof Date) return `date:${Number.isNaN(original.getTime()) ? 'invalid' : original.toISOString()}`
    if (name === 'self') return '[circular]'
    return item
  }))
}
