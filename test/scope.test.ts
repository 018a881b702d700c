import { describe, expect, it } from 'vitest'
import Fastify, { type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler, NO_CALLER_SCOPE, scopeByHeader, type IdempotencyStorage } from '../lib/index.js'
import { storageKey } from '../lib/engine/storage-key.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { postWithKey } from './helpers/http-client.js'
import { servedOn } from './helpers/served.js'
import { storeCases } from './helpers/stores.js'

const request = (headers: Record<string, string | string[]>) => ({ headers }) as unknown as FastifyRequest

describe('scopeByHeader', () => {
  const scope = scopeByHeader('Authorization')

  it('gives one caller one scope, and two callers two, without the credential in it', () => {
    const alice = scope(request({ authorization: 'Bearer sk_live_alice' }))
    expect(scope(request({ authorization: 'Bearer sk_live_alice' }))).toBe(alice)
    expect(scope(request({ authorization: 'Bearer sk_live_bob' }))).not.toBe(alice)
    expect(alice).not.toContain('sk_live')
    expect(alice).toMatch(/^sha256:[\w-]{43}$/)
  })

  it('finds no caller in a request without the header, and keeps a repeated header apart from one value', () => {
    expect(scope(request({}))).toBeUndefined()
    expect(scope(request({ authorization: ['a', 'b'] }))).not.toBe(scope(request({ authorization: 'a, b' })))
  })

  it('refuses an empty name at start-up', () => {
    expect(() => scopeByHeader('')).toThrow(/header name/)
  })
})

/**
 * The namespaces scopes make, over real HTTP on every store: a request without a caller and any
 * value a scope may return (the former 'none' of requests without a caller, strings holding line
 * feeds or the plugin's own markers) never share an entry.
 */
for (const store of await storeCases()) {
  describe.skipIf(!store.available)(`scope namespaces on ${store.name}${store.reason}`, () => {
    const scopes: Record<string, string | undefined> = {
      anonymous: undefined,
      none: 'none',
      newline: '\n',
      'ends-in-newline': 'a\n',
      'holds-newline': 'a\nb',
      'step-marker': '\u0000step:x',
      'hash-marker': '\u0000sha256:x',
      a: 'a'
    }
    let runs = 0
    /** Holds the next request in its handler. */
    let holding: Gate | null = null
    let shared: IdempotencyStorage
    const served = servedOn(store, async (storage) => {
      shared = storage
      const app = Fastify()
      await app.register(idempotency, { storage, scope: (request) => scopes[String(request.headers['x-caller'])] })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const gate = holding
        holding = null
        await gate?.hold()
        reply.code(201)
        return { run: ++runs, caller: request.headers['x-caller'] }
      })
      return { app }
    })

    it('keeps a request without a caller and every scope value apart: each runs once, and replays its own answer', async () => {
      const key = newKey()
      const first = new Map<string, string>()
      for (const caller of Object.keys(scopes)) {
        const answer = await postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': caller })
        expect([answer.status, answer.replayed], caller).toEqual([201, false])
        first.set(caller, answer.body)
      }
      for (const caller of Object.keys(scopes)) {
        const again = await postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': caller })
        expect([again.replayed, again.body], caller).toEqual([true, first.get(caller)])
      }
      expect(runs).toBe(Object.keys(scopes).length)
    })

    it('keeps a request without a caller on a scoped route apart from the same key on a route without a scope', async () => {
      const app = Fastify()
      await app.register(idempotency, { storage: shared })
      let unscopedRuns = 0
      app.post('/orders', { config: { idempotency: true } }, async () => ({ unscoped: ++unscopedRuns }))
      const key = newKey()
      await postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': 'anonymous' })
      const unscoped = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { sku: 'A1' } })
      expect(unscoped.headers['idempotent-replayed']).toBeUndefined()
      expect(unscoped.json()).toEqual({ unscoped: 1 })
      await app.close()
    })

    it('lists a request whose scope starts with a marker of the plugin\'s own keys as a request, not as a step\'s record', async () => {
      const key = newKey()
      const gate = holding = new Gate()
      const held = postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': 'step-marker' })
      await gate.entered
      const { leases } = await served.app.idempotency.inFlight()
      expect(leases.map((lease) => lease.storageKey)).toContain(storageKey(key, '\u0000step:x'))
      gate.open()
      expect((await held).status).toBe(201)
    })

    it('lets operators address the requests without a caller: scope NO_CALLER_SCOPE', async () => {
      const key = newKey()
      await postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': 'anonymous' })
      expect(await served.app.idempotency.inspect(key, { scope: 'none' })).toMatchObject({ state: 'absent' })
      expect(await served.app.idempotency.inspect(key, { scope: NO_CALLER_SCOPE })).toMatchObject({ state: 'stored', scope: NO_CALLER_SCOPE, statusCode: 201 })
      expect(await served.app.idempotency.forget(key, { scope: NO_CALLER_SCOPE })).toMatchObject({ outcome: 'forgotten', previous: 'stored' })
      const again = await postWithKey(`${served.url}/orders`, key, { sku: 'A1' }, { 'x-caller': 'anonymous' })
      expect(again.replayed).toBe(false)
    })
  })
}
