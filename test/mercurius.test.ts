/**
 * Mercurius (GraphQL) with the recipe of docs/frameworks/mercurius.md, on every store, over real
 * HTTP: a mutation answered 200 with `errors` is not kept (a retry runs it again), a successful one
 * is replayed, a query's answer is never kept, every way of guarding /graphql guards it (its
 * options, an onRoute hook added before the plugin or after it), and refusals keep their status and retry signals
 * through Mercurius's own error handler.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import mercurius from 'mercurius'
import { getOperationAST, parse } from 'graphql'
import idempotency, { type StoredResponse } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

interface GraphQLOperation { query?: unknown, operationName?: unknown }

/** As in docs/frameworks/mercurius.md. */
function isQuery ({ query, operationName }: GraphQLOperation): boolean {
  if (typeof query !== 'string') return false
  return getOperationAST(parse(query), typeof operationName === 'string' ? operationName : undefined)?.operation === 'query'
}

/** As in docs/frameworks/mercurius.md. */
function storeGraphQLIf (response: StoredResponse, request: FastifyRequest): boolean {
  const operations = [request.body].flat() as GraphQLOperation[]
  if (operations.every(isQuery)) return false
  const results = [JSON.parse(response.body.toString())].flat() as Array<{ errors?: unknown }>
  return results.every((result) => result.errors === undefined)
}

const schema = `
  type Query { balance(account: String!): Int }
  type Mutation { pay(account: String!, amount: Int!): String }
`

/** How /graphql is guarded. */
type Guarding = 'additionalRouteOptions' | 'an onRoute hook added before the plugin' | 'an onRoute hook added after the plugin'

interface Server {
  app: FastifyInstance
  /** Resolver runs per account. */
  runs: Map<string, number>
  /** Accounts whose next `pay` fails, once. */
  failOnce: Set<string>
  /** The account whose `pay` holds until the gate opens. */
  held: { account: string, gate: Gate } | null
  post: (key: string | null, body: unknown) => Promise<{ status: number, headers: Headers, json: { data?: unknown, errors?: Array<{ message: string }> } | Array<{ data?: unknown, errors?: unknown }> }>
  get: (key: string, query: string) => Promise<{ status: number, replayed: boolean }>
}

async function serve (storage: IdempotencyStorage, guarding: Guarding): Promise<Server> {
  const app = Fastify()
  const server: Server = { app, runs: new Map(), failOnce: new Set(), held: null, post: null!, get: null! }
  const ran = (account: string): number => {
    const n = (server.runs.get(account) ?? 0) + 1
    server.runs.set(account, n)
    return n
  }
  const guardFromHook = (): void => {
    app.addHook('onRoute', (route) => {
      if (route.url === '/graphql' && route.method === 'POST') route.config = { ...route.config, idempotency: { storeIf: storeGraphQLIf } }
    })
  }
  if (guarding === 'an onRoute hook added before the plugin') guardFromHook()
  await app.register(idempotency, { storage })
  if (guarding === 'an onRoute hook added after the plugin') guardFromHook()
  await app.register(mercurius, {
    schema,
    allowBatchedQueries: true,
    resolvers: {
      Query: { balance: (_root: unknown, { account }: { account: string }) => ran(account) },
      Mutation: {
        pay: async (_root: unknown, { account, amount }: { account: string, amount: number }) => {
          const run = ran(account)
          if (server.held?.account === account) await server.held.gate.hold()
          if (server.failOnce.delete(account)) throw new Error('payment provider timed out')
          return `paid ${amount} (run ${run})`
        }
      }
    },
    ...(guarding === 'additionalRouteOptions' ? { additionalRouteOptions: { config: { idempotency: { storeIf: storeGraphQLIf } } } } : {})
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  const origin = `http://127.0.0.1:${(app.server.address() as { port: number }).port}/graphql`
  server.post = async (key, body) => {
    const res = await fetch(origin, { method: 'POST', headers: { 'content-type': 'application/json', ...(key === null ? {} : { 'idempotency-key': key }) }, body: JSON.stringify(body) })
    return { status: res.status, headers: res.headers, json: await res.json() as Awaited<ReturnType<Server['post']>>['json'] }
  }
  server.get = async (key, query) => {
    const res = await fetch(`${origin}?query=${encodeURIComponent(query)}`, { headers: { 'idempotency-key': key } })
    await res.arrayBuffer()
    return { status: res.status, replayed: res.headers.get('idempotent-replayed') === 'true' }
  }
  return server
}

const pay = (account: string, amount = 42) => ({ query: 'mutation Pay($account: String!, $amount: Int!) { pay(account: $account, amount: $amount) }', variables: { account, amount } })
const balance = (account: string) => ({ query: `query { balance(account: "${account}") }` })

for (const store of cases) {
  describe.skipIf(!store.available)(`Mercurius on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    for (const guarding of ['additionalRouteOptions', 'an onRoute hook added before the plugin', 'an onRoute hook added after the plugin'] as const) {
      describe(`/graphql guarded through ${guarding}`, () => {
        let server: Server
        beforeAll(async () => { server = await serve(storage, guarding) })
        afterAll(async () => { await server.app.close() })
        afterEach(() => { server.held?.gate.open(); server.held = null })

        it('a mutation that failed (errors in a 200) runs again on a retry; once it succeeds, it is replayed', async () => {
          const key = newKey()
          server.failOnce.add(key)
          const failed = await server.post(key, pay(key))
          expect(failed.status).toBe(200)
          expect(failed.json).toMatchObject({ data: { pay: null }, errors: [{ message: 'payment provider timed out' }] })
          const retried = await server.post(key, pay(key))
          expect([retried.status, retried.headers.get('idempotent-replayed'), retried.json]).toEqual([200, null, { data: { pay: 'paid 42 (run 2)' } }])
          const replayed = await server.post(key, pay(key))
          expect([replayed.headers.get('idempotent-replayed'), replayed.json]).toEqual(['true', { data: { pay: 'paid 42 (run 2)' } }])
          expect(server.runs.get(key)).toBe(2)
        })

        it('a query over POST with a key runs every time: its answer is never kept', async () => {
          const key = newKey()
          for (const run of [1, 2, 3]) {
            const answer = await server.post(key, balance(key))
            expect([answer.headers.get('idempotent-replayed'), answer.json]).toEqual([null, { data: { balance: run } }])
          }
        })

        it('a batch is kept only when every result in it is free of errors', async () => {
          const key = newKey()
          const account = `${key}-batch`
          server.failOnce.add(account)
          const batch = [pay(account, 1), balance(account)]
          const failed = await server.post(key, batch)
          expect((failed.json as Array<{ errors?: unknown }>)[0]!.errors).toBeDefined()
          const retried = await server.post(key, batch)
          expect(retried.headers.get('idempotent-replayed')).toBeNull()
          expect((await server.post(key, batch)).headers.get('idempotent-replayed')).toBe('true')
        })

        it('GET /graphql is not guarded', async () => {
          const key = newKey()
          await server.get(key, `{ balance(account: "${key}") }`)
          expect((await server.get(key, `{ balance(account: "${key}") }`)).replayed).toBe(false)
          expect(server.runs.get(key)).toBe(2)
        })

        it('a refusal is a GraphQL error with its status and retry signals: in progress (retry after), mismatch (do not retry)', async () => {
          const key = newKey()
          const gate = new Gate()
          server.held = { account: key, gate }
          const first = server.post(key, pay(key))
          await gate.entered
          const inProgress = await server.post(key, pay(key))
          expect(inProgress.status).toBe(409)
          expect(inProgress.json).toMatchObject({ data: null, errors: [{ message: expect.stringMatching(/still being processed/) }] })
          expect([inProgress.headers.get('x-should-retry'), inProgress.headers.get('stripe-should-retry')]).toEqual(['true', 'true'])
          expect(Number(inProgress.headers.get('retry-after'))).toBeGreaterThanOrEqual(1)
          gate.open()
          expect((await first).status).toBe(200)
          const mismatch = await server.post(key, pay(key, 43))
          expect(mismatch.status).toBe(409)
          expect([mismatch.headers.get('x-should-retry'), mismatch.headers.get('stripe-should-retry'), mismatch.headers.get('retry-after')]).toEqual(['false', 'false', null])
          expect(server.runs.get(key)).toBe(1)
        })
      })
    }
  })
}
