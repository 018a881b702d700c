/**
 * `storeIf(response, request)`: a route (or the plugin) decides, from the answer about to be
 * stored, whether to keep it. `false` gives the key back as a status that is not cacheable does,
 * so a retry runs the handler again. On every store, over real HTTP: the plugin's and a route's,
 * what it sees on every path an answer takes (a body, a stream, a body too large, a hijacked
 * reply, with redact and encryption), and what happens when it throws, answers something that is
 * not a boolean, or never answers.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { randomBytes } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import { Readable } from 'node:stream'
import { setImmediate as nextTurn } from 'node:timers/promises'
import Fastify, { type FastifyInstance, type RouteShorthandOptions, type RouteHandlerMethod } from 'fastify'
import idempotency, { CHANNEL_PREFIX, idempotencyErrorHandler, type IdempotencyEvent, type IdempotencyOptions, type StoredResponse } from '../lib/index.js'
import { transactionOf } from '../lib/knex.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

interface Answer { status: number, headers: Headers, body: string, replayed: boolean }

interface Server {
  app: FastifyInstance
  post: (path: string, key: string, body?: object) => Promise<Answer>
  /** Lines the app logged at error level. */
  errors: () => string[]
}

const servers: Server[] = []
/** Every `execute` event, to wait for a request's outcome to be settled. */
const executed: IdempotencyEvent[] = []
const onExecute = (message: unknown): void => { executed.push(message as IdempotencyEvent) }
const rejections: unknown[] = []
const onRejection = (reason: unknown): void => { rejections.push(reason) }
beforeAll(() => {
  diagnostics.subscribe(`${CHANNEL_PREFIX}execute`, onExecute)
  process.on('unhandledRejection', onRejection)
})
afterAll(() => {
  diagnostics.unsubscribe(`${CHANNEL_PREFIX}execute`, onExecute)
  process.off('unhandledRejection', onRejection)
})
afterEach(async () => {
  await Promise.all(servers.splice(0).map((server) => server.app.close()))
  expect(rejections).toEqual([])
})

/** The execute event of `key`, once published (the answer may reach the client first: hijacked). */
async function settled (key: string): Promise<IdempotencyEvent> {
  for (;;) {
    const event = executed.find((e) => e.idempotencyKey === key)
    if (event !== undefined) return event
    await new Promise<void>((resolve) => {
      const wake = (): void => { diagnostics.unsubscribe(`${CHANNEL_PREFIX}execute`, wake); resolve() }
      diagnostics.subscribe(`${CHANNEL_PREFIX}execute`, wake)
    })
  }
}

type Routes = Record<string, [RouteShorthandOptions['config'], RouteHandlerMethod]>

async function serve (options: IdempotencyOptions, routes: Routes): Promise<Server> {
  const logged: string[] = []
  const app = Fastify({ logger: { level: 'error', stream: { write: (line: string) => { logged.push(line) } } } })
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  for (const [path, [config, handler]] of Object.entries(routes)) app.post(path, { config }, handler)
  await app.listen({ host: '127.0.0.1', port: 0 })
  const origin = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`
  const server: Server = {
    app,
    post: async (path, key, body = {}) => {
      const res = await fetch(origin + path, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(body) })
      return { status: res.status, headers: res.headers, body: await res.text(), replayed: res.headers.get('idempotent-replayed') === 'true' }
    },
    errors: () => logged.map((line) => JSON.parse(line) as { msg: string }).map((entry) => entry.msg)
  }
  servers.push(server)
  return server
}

/** A handler that counts its runs and answers 201 with the run's number. */
function counted (): { runs: () => number, handler: RouteHandlerMethod } {
  let runs = 0
  return { runs: () => runs, handler: async (_request, reply) => { reply.code(201).header('x-run', String(++runs)); return { run: runs } } }
}

for (const store of cases) {
  describe.skipIf(!store.available)(`storeIf on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    it('the plugin\'s: false gives the key back, so a retry runs the handler again; true stores, so it replays', async () => {
      const route = counted()
      const server = await serve({ storage, storeIf: (response) => JSON.parse(response.body.toString()).run > 1 }, { '/orders': [{ idempotency: true }, route.handler] })
      const key = newKey()
      const first = await server.post('/orders', key)
      expect(first.status).toBe(201)
      expect((await settled(key)).reason).toBe('declined')
      const retry = await server.post('/orders', key)
      expect([retry.replayed, JSON.parse(retry.body)]).toEqual([false, { run: 2 }])
      const replay = await server.post('/orders', key)
      expect([replay.replayed, JSON.parse(replay.body)]).toEqual([true, { run: 2 }])
      expect(route.runs()).toBe(2)
    })

    it('a route\'s: false gives the key back; a route\'s storeIf replaces the plugin\'s, both ways', async () => {
      const keepAll = counted()
      const keepNone = counted()
      const inherits = counted()
      const server = await serve({ storage, storeIf: () => false }, {
        '/keep-all': [{ idempotency: { storeIf: () => true } }, keepAll.handler],
        '/inherits': [{ idempotency: true }, inherits.handler]
      })
      const strict = await serve({ storage }, { '/keep-none': [{ idempotency: { storeIf: async () => false } }, keepNone.handler] })
      for (const [target, path, route, replays] of [[server, '/keep-all', keepAll, true], [server, '/inherits', inherits, false], [strict, '/keep-none', keepNone, false]] as const) {
        const key = newKey()
        await target.post(path, key)
        const retry = await target.post(path, key)
        expect({ path, replayed: retry.replayed, runs: route.runs() }).toEqual({ path, replayed: replays, runs: replays ? 1 : 2 })
      }
    })

    it('sees the answer as sent (status, headers, body as a Buffer), before redact and encryption, and only for a cacheable status', async () => {
      const seen: StoredResponse[] = []
      const server = await serve({
        storage,
        encryption: { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) },
        storeIf: (response) => { seen.push(response); return true },
        redact: (response) => ({ ...response, body: Buffer.from('{"secret":"[redacted]"}') })
      }, {
        '/secret': [{ idempotency: true }, async (_request, reply) => reply.code(201).header('location', '/secret/1').send({ secret: 's3cr3t' })],
        '/refused': [{ idempotency: true }, async (_request, reply) => reply.code(402).send({ refused: true })],
        '/thrown': [{ idempotency: true }, async () => { throw new Error('declined by the bank') }]
      })
      const key = newKey()
      await server.post('/secret', key)
      expect(seen).toHaveLength(1)
      expect(seen[0]).toMatchObject({ statusCode: 201, contentType: 'application/json; charset=utf-8', headers: { location: '/secret/1' } })
      expect(Buffer.isBuffer(seen[0]!.body)).toBe(true)
      expect(seen[0]!.body.toString()).toBe('{"secret":"s3cr3t"}')
      expect(seen[0]!.bodyOmitted).toBeUndefined()
      expect((await server.post('/secret', key)).body).toBe('{"secret":"[redacted]"}')
      await server.post('/refused', newKey())
      await server.post('/thrown', newKey())
      expect(seen).toHaveLength(1)
    })

    it('sees a streamed body whole, and a body too large or a hijacked reply as an outcome without its body; false frees each', async () => {
      const seen: Record<string, StoredResponse> = {}
      const runs: Record<string, number> = { '/stream': 0, '/large': 0, '/hijacked': 0 }
      const count = (path: string): number => ++runs[path]!
      const server = await serve({ storage, maxResponseBytes: 16, storeIf: (response, request) => { seen[request.url] = response; return false } }, {
        '/stream': [{ idempotency: true }, async (request, reply) => { count(request.url); reply.type('text/plain'); return Readable.from(['str', 'eam']) }],
        '/large': [{ idempotency: true }, async (request) => ({ run: count(request.url), padding: 'x'.repeat(64) })],
        '/hijacked': [{ idempotency: true }, async (request, reply) => {
          count(request.url)
          reply.hijack()
          reply.raw.setHeader('content-type', 'text/plain')
          reply.raw.writeHead(200)
          reply.raw.end('raw')
        }]
      })
      for (const path of Object.keys(runs)) {
        const key = newKey()
        await server.post(path, key)
        await settled(key)
        expect((await server.post(path, key)).replayed).toBe(false)
        expect(runs[path]).toBe(2)
      }
      expect(seen['/stream']!.body.toString()).toBe('stream')
      for (const path of ['/large', '/hijacked']) expect(seen[path]).toMatchObject({ statusCode: 200, bodyOmitted: true, body: Buffer.alloc(0) })
    })

    describe('when storeIf misbehaves, the client gets its answer, the answer is stored, and the failure is logged', () => {
      /** The last storeIf that rejects later, for the test to reject once its time limit has passed. */
      let rejectLate: ((error: Error) => void) | null = null
      const misbehaving: Record<string, () => unknown> = {
        throws: () => { throw new Error('cannot decide') },
        rejects: async () => { throw new Error('cannot decide') },
        'returns undefined': () => undefined,
        'returns the string "false"': () => 'false',
        'returns 0': () => 0,
        'resolves to null': async () => null,
        'returns an object': () => ({ keep: false }),
        'returns a function': () => () => false,
        'never settles': () => new Promise(() => {}),
        'rejects after its time limit': () => new Promise((_resolve, reject) => { rejectLate = reject })
      }
      for (const [name, storeIf] of Object.entries(misbehaving)) {
        it(`it ${name}`, async () => {
          const route = counted()
          const server = await serve({ storage, storeTimeout: 300, storeIf: storeIf as never }, { '/orders': [{ idempotency: true }, route.handler] })
          const key = newKey()
          const first = await server.post('/orders', key)
          expect([first.status, JSON.parse(first.body)]).toEqual([201, { run: 1 }])
          const retry = await server.post('/orders', key)
          expect([retry.status, retry.replayed, retry.body]).toEqual([201, true, first.body])
          expect(route.runs()).toBe(1)
          expect(server.errors()).toEqual(['idempotency storeIf failed: the response is stored as if it had returned true, so a retry replays it instead of running the handler again'])
          // A rejection after the limit is nobody's to handle, and must not surface (afterEach checks).
          if (rejectLate !== null) {
            (rejectLate as (error: Error) => void)(new Error('too late'))
            rejectLate = null
            await nextTurn()
          }
        })
      }
    })

    it('logs why: the error it threw, what it returned, or its time limit', async () => {
      const answers: Array<[() => unknown, RegExp]> = [
        [() => { throw new Error('cannot decide') }, /cannot decide/],
        [() => 'yes', /storeIf must return a boolean or a promise of one \(it returned the string "yes"\)/],
        [() => ({ keep: true }), /\(it returned an object\)/],
        [() => new Promise(() => {}), /storeIf did not settle within 200 ms/]
      ]
      for (const [storeIf, why] of answers) {
        const lines: string[] = []
        const app = Fastify({ logger: { level: 'error', stream: { write: (line: string) => { lines.push(line) } } } })
        await app.register(idempotency, { storage, storeTimeout: 200, storeIf: storeIf as never })
        app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
        const key = newKey()
        const res = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: {} })
        expect(res.statusCode).toBe(200)
        const entry = JSON.parse(lines[0]!) as { err: { message: string }, idempotencyKey: string }
        expect(entry.idempotencyKey).toBe(key)
        expect(entry.err.message).toMatch(why)
        await app.close()
      }
    })

    it('is refused at start-up when it is not a function, on the plugin and on a route', async () => {
      await expect(serve({ storage, storeIf: true as never }, {})).rejects.toThrow('fastify-idempotency: invalid options: storeIf must be a function of the request')
      const app = Fastify()
      await app.register(idempotency, { storage })
      expect(() => app.post('/orders', { config: { idempotency: { storeIf: 'errors' as never } } }, async () => ({}))).toThrow('fastify-idempotency: invalid config.idempotency of route POST /orders: storeIf must be a function of the request')
      await app.close()
    })

    it.skipIf(store.knex === undefined)('in transaction mode, false rolls the handler\'s writes back with the key, and the client still gets the answer', async () => {
      const knex = store.knex!()
      const table = `store_if_${process.pid}_${Date.now()}`
      await knex.schema.createTable(table, (t) => { t.increments('id'); t.string('idem_key', 200).notNullable() })
      try {
        const server = await serve({ storage, transaction: true, storeIf: (response) => !JSON.parse(response.body.toString()).declined }, {
          '/orders': [{ idempotency: true }, async (request, reply) => {
            await transactionOf(request)(table).insert({ idem_key: request.idempotency!.key })
            reply.code(201)
            return { declined: (request.body as { decline?: boolean }).decline === true }
          }]
        })
        const count = async (key: string): Promise<number> => Number((await knex(table).where({ idem_key: key }).count({ n: '*' }))[0]!.n)
        const key = newKey()
        const declined = await server.post('/orders', key, { decline: true })
        expect([declined.status, JSON.parse(declined.body)]).toEqual([201, { declined: true }])
        expect(await count(key)).toBe(0)
        const other = newKey()
        await server.post('/orders', other)
        expect(await count(other)).toBe(1)
        expect((await server.post('/orders', other)).replayed).toBe(true)
      } finally {
        await knex.schema.dropTableIfExists(table)
      }
    })
  })
}
