/**
 * Whose key is it: a scope names the caller, and a request that carries credentials is never put
 * in a namespace shared with other callers because its scope found nobody in them. Over real HTTP,
 * on every store.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Writable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler, scopeByHeader, type IdempotencyOptions, type IdempotencyStorage } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const stores = await storeCases()

declare module 'fastify' {
  interface FastifyRequest {
    /** Set by the test apps' authentication hook: the signed-in account, if any. */
    account?: string
  }
}

/** Bearer tokens and sign-in cookies, each naming an account; an account may hold several. */
const TOKENS: Record<string, string> = { 'alice-token-1': 'alice', 'alice-token-2': 'alice', 'bob-token': 'bob' }
const COOKIES: Record<string, string> = { 'alice-cookie': 'alice', 'bob-cookie': 'bob' }

interface Served { app: FastifyInstance, origin: string, runs: () => number, logs: Array<Record<string, unknown>> }

/**
 * An app whose authentication hook signs in by bearer token or sign-in cookie, and whose
 * `/payments` answers with the account and its card's last digits.
 */
async function serve (storage: IdempotencyStorage, options: IdempotencyOptions): Promise<Served> {
  const logs: Array<Record<string, unknown>> = []
  const stream = new Writable({ write (chunk: Buffer, _encoding, callback) { for (const line of chunk.toString().split('\n')) if (line !== '') logs.push(JSON.parse(line) as Record<string, unknown>); callback() } })
  const app = Fastify({ logger: { level: 'warn', stream } })
  app.addHook('onRequest', async (request) => {
    const bearer = /^Bearer (.+)$/.exec(request.headers.authorization ?? '')?.[1]
    const login = /(?:^|; )sid=([^;]+)/.exec(request.headers.cookie ?? '')?.[1]
    request.account = (bearer === undefined ? undefined : TOKENS[bearer]) ?? (login === undefined ? undefined : COOKIES[login])
  })
  await app.register(idempotency, { storage, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  let runs = 0
  app.post('/payments', { config: { idempotency: true } }, async (request, reply) => {
    runs++
    reply.code(201)
    return { account: request.account ?? null, card: request.account === 'alice' ? '4242' : request.account === 'bob' ? '1881' : null }
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, origin: `http://127.0.0.1:${(app.server.address() as { port: number }).port}`, runs: () => runs, logs }
}

async function pay (origin: string, key: string, headers: Record<string, string>): Promise<{ status: number, type: string | null, body: Record<string, unknown> }> {
  const res = await fetch(`${origin}/payments`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key, ...headers }, body: '{"amount":100}' })
  return { status: res.status, type: res.headers.get('content-type'), body: await res.json() as Record<string, unknown> }
}

const byAccount = (request: FastifyRequest) => request.account

for (const store of stores) {
  describe.skipIf(!store.available)(`scopes over HTTP: ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    it('scopeByHeader(\'authorization\') never hands a cookie-authenticated caller another\'s response: such requests are refused, and logged', async () => {
      const served = await serve(storage, { scope: scopeByHeader('authorization') })
      try {
        const key = newKey('cookie')
        const alice = await pay(served.origin, key, { cookie: 'sid=alice-cookie' })
        const bob = await pay(served.origin, key, { cookie: 'sid=bob-cookie' })
        expect(JSON.stringify(bob.body)).not.toContain('4242')
        for (const answer of [alice, bob]) {
          expect(answer.status).toBe(500)
          expect(answer.type).toMatch(/^application\/problem\+json/)
          expect(answer.body).toMatchObject({ type: expect.stringMatching(/#scope-unresolved$/), status: 500, idempotencyKey: key })
        }
        expect(served.runs()).toBe(0)
        const errors = served.logs.filter((line) => line.level === 50).map((line) => String(line.msg))
        expect(errors).toHaveLength(2)
        expect(errors[0]).toMatch(/scope of route \/payments found no caller in a request that carries credentials \(Cookie\)/)
        // Callers without credentials share one namespace, as on a route without a scope.
        const anonymous = await pay(served.origin, newKey('anonymous'), {})
        expect(anonymous.status).toBe(201)
      } finally {
        await served.app.close()
      }
    })

    it('scoped by the signed-in account: a retry with a refreshed token replays, another account\'s same key runs apart', async () => {
      const served = await serve(storage, { scope: byAccount })
      try {
        const key = newKey('account')
        const first = await pay(served.origin, key, { authorization: 'Bearer alice-token-1' })
        const refreshed = await pay(served.origin, key, { authorization: 'Bearer alice-token-2' })
        const byCookie = await pay(served.origin, key, { cookie: 'sid=alice-cookie' })
        const bob = await pay(served.origin, key, { cookie: 'sid=bob-cookie' })
        expect(first).toMatchObject({ status: 201, body: { account: 'alice', card: '4242' } })
        expect(refreshed.body).toEqual(first.body)
        expect(byCookie.body).toEqual(first.body)
        expect(bob).toMatchObject({ status: 201, body: { account: 'bob', card: '1881' } })
        expect(served.runs()).toBe(2)
      } finally {
        await served.app.close()
      }
    })

    it('scopeByHeader is per credential: a refreshed token is a new scope, and the retry runs again', async () => {
      const served = await serve(storage, { scope: scopeByHeader('authorization') })
      try {
        const key = newKey('credential')
        await pay(served.origin, key, { authorization: 'Bearer alice-token-1' })
        const refreshed = await pay(served.origin, key, { authorization: 'Bearer alice-token-2' })
        expect(refreshed.status).toBe(201)
        expect(served.runs()).toBe(2)
      } finally {
        await served.app.close()
      }
    })
  })
}

describe('a scope function that misbehaves', () => {
  async function answer (scope: IdempotencyOptions['scope'], headers: Record<string, string> = {}) {
    const served = await serve(new (await import('../lib/index.js')).MemoryStorage(), { scope })
    try {
      const result = await pay(served.origin, newKey('bad'), headers)
      return { ...result, runs: served.runs(), errors: served.logs.filter((line) => line.level === 50) }
    } finally {
      await served.app.close()
    }
  }

  const invalid: Array<[string, unknown, RegExp]> = [
    ['an empty string', '', /returned an empty string/],
    ['a number', 42, /returned a number/],
    ['an object', { id: 'alice' }, /returned an object/],
    ['a promise of a boolean', Promise.resolve(true), /returned a boolean/]
  ]
  for (const [name, value, reason] of invalid) {
    it(`that returns ${name}: 500 problem+json #scope-unresolved, logged with the route, the handler not run`, async () => {
      const result = await answer(() => value as string)
      expect(result.status).toBe(500)
      expect(result.type).toMatch(/^application\/problem\+json/)
      expect(result.body).toMatchObject({ type: expect.stringMatching(/#scope-unresolved$/), title: 'Idempotency scope unresolved' })
      expect(result.runs).toBe(0)
      expect(result.errors).toHaveLength(1)
      expect(String(result.errors[0]!.msg)).toMatch(new RegExp(`scope of route /payments ${reason.source}`))
    })
  }

  it('that throws an HTTP error of its own: the app\'s answer, as from any hook', async () => {
    const result = await answer(() => { throw Object.assign(new Error('Sign in first'), { statusCode: 401 }) })
    expect(result.status).toBe(401)
    expect(result.body).toMatchObject({ statusCode: 401, message: 'Sign in first' })
    expect(result.runs).toBe(0)
  })

  it('that throws a bug: Fastify\'s own 500, logged with its stack by Fastify', async () => {
    const result = await answer(() => { throw new TypeError('cannot read account') })
    expect(result.status).toBe(500)
    expect(result.runs).toBe(0)
    expect(result.errors).toHaveLength(1)
    expect(result.errors[0]).toMatchObject({ err: { message: 'cannot read account', stack: expect.stringContaining('TypeError') } })
  })

  it('that finds nobody (undefined or null) for a caller without credentials: the shared namespace of callers without one', async () => {
    for (const nobody of [undefined, null]) {
      const result = await answer(() => nobody)
      expect(result.status).toBe(201)
      expect(result.errors).toEqual([])
    }
  })

  it('that finds nobody for a caller with an unknown bearer token: refused, not shared', async () => {
    const result = await answer(byAccount, { authorization: 'Bearer stolen' })
    expect(result.status).toBe(500)
    expect(String(result.errors[0]!.msg)).toMatch(/found no caller in a request that carries credentials \(Authorization\)/)
    expect(result.runs).toBe(0)
  })
})
