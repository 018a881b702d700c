/**
 * What a user of the plugin notices, run against every store on its real server: the seed's
 * rules and test rules, and the contract's decisions that concern the request lifecycle.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Readable } from 'node:stream'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify from 'fastify'
import idempotency, { IdempotencyFingerprintMismatchError, idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyOptions } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { buildApp, newKey, type Handler } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'
import { Gate } from './helpers/gate.js'
import { scaled } from './helpers/pace.js'
import { resendWhile } from './helpers/resend.js'

const cases = await storeCases()

for (const store of cases) {
  describe.skipIf(!store.available)(`behaviour on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    const app = (options: IdempotencyOptions = {}, routes: Record<string, Handler> = {}, routeConfig: object | true = true) =>
      buildApp({ storage, ...options }, routes, routeConfig)
    const post = (target: Awaited<ReturnType<typeof app>>, key: string | undefined, payload: unknown, extra: { url?: string, method?: string, headers?: Record<string, string> } = {}) =>
      target.app.inject({
        method: (extra.method ?? 'POST') as 'POST',
        url: extra.url ?? '/orders',
        headers: { ...(key === undefined ? {} : { 'idempotency-key': key }), ...extra.headers },
        payload: payload as string
      })
    /** The first request to `url` answers `status`, which is not stored: its retry runs the handler again. */
    const expectRunAgain = async (target: Awaited<ReturnType<typeof app>>, url: string, status: number): Promise<void> => {
      const key = newKey()
      expect((await post(target, key, {}, { url })).statusCode).toBe(status)
      const retry = await post(target, key, {}, { url })
      expect(retry.statusCode).toBe(200)
      expect(retry.json()).toEqual({ run: 2 })
    }

    it('runs the first request and returns the application\'s response unchanged', async () => {
      const t = await app()
      const res = await post(t, newKey(), { amount: 10 })
      expect(res.statusCode).toBe(201)
      expect(res.headers.location).toBe('/orders/1')
      expect(res.headers['idempotent-replayed']).toBeUndefined()
      expect(res.json()).toEqual({ id: 1, received: { amount: 10 } })
      expect(t.runs.get('/orders')).toBe(1)
    })

    it('replays a repeat byte for byte (status, body, content type, headers) without running the handler', async () => {
      const t = await app()
      const key = newKey()
      const first = await post(t, key, { amount: 10 })
      const again = await post(t, key, { amount: 10 })
      expect(again.statusCode).toBe(first.statusCode)
      expect(again.rawPayload.equals(first.rawPayload)).toBe(true)
      expect(again.headers['content-type']).toBe(first.headers['content-type'])
      expect(again.headers.location).toBe('/orders/1')
      expect(again.headers['x-run']).toBe('1')
      expect(again.headers['content-length']).toBe(first.headers['content-length'])
      expect(again.headers['idempotent-replayed']).toBe('true')
      expect(t.runs.get('/orders')).toBe(1)
    })

    it('refuses a repeat with another body with 409 problem+json, without running the handler', async () => {
      const t = await app()
      const key = newKey()
      await post(t, key, { amount: 10 })
      const res = await post(t, key, { amount: 99 })
      expect(res.statusCode).toBe(409)
      expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
      expect(res.json()).toEqual({
        type: IdempotencyFingerprintMismatchError.type,
        title: 'Idempotency fingerprint mismatch',
        status: 409,
        detail: expect.any(String),
        idempotencyKey: key
      })
      expect(t.runs.get('/orders')).toBe(1)
    })

    it('leaves the stored entry replayable after a mismatch, even when 409 is cacheable', async () => {
      const t = await app({ addCacheableStatusCodes: [409] })
      const key = newKey()
      const first = await post(t, key, { amount: 10 })
      expect((await post(t, key, { amount: 99 })).statusCode).toBe(409)
      const again = await post(t, key, { amount: 10 })
      expect(again.statusCode).toBe(201)
      expect(again.body).toBe(first.body)
      expect(t.runs.get('/orders')).toBe(1)
    })

    it('answers a mismatch with 422 when mismatchStatusCode says so', async () => {
      const t = await app({ mismatchStatusCode: 422 })
      const key = newKey()
      await post(t, key, { amount: 10 })
      const res = await post(t, key, { amount: 11 })
      expect(res.statusCode).toBe(422)
      expect(res.json().status).toBe(422)
    })

    it('ignores JSON member order and white space', async () => {
      const t = await app()
      const key = newKey()
      await post(t, key, '{"a":1,"b":{"y":[1,2],"x":"z"}}', { headers: { 'content-type': 'application/json' } })
      const again = await post(t, key, ' { "b" : { "x" : "z", "y" : [ 1 , 2 ] } ,\n "a" : 1.0 } ', { headers: { 'content-type': 'application/json' } })
      expect(again.statusCode).toBe(201)
      expect(again.headers['idempotent-replayed']).toBe('true')
      expect(t.runs.get('/orders')).toBe(1)
    })

    const components: Array<{ name: string, option: IdempotencyOptions['fingerprint'], first: Parameters<typeof post>[3], second: Parameters<typeof post>[3] }> = [
      { name: 'method', option: { method: true }, first: { url: '/any', method: 'POST' }, second: { url: '/any', method: 'PUT' } },
      { name: 'path', option: { path: true }, first: { url: '/any' }, second: { url: '/other' } },
      { name: 'query', option: { query: true }, first: { url: '/any?a=1&b=2' }, second: { url: '/any?a=1&b=3' } },
      { name: 'contentType', option: { contentType: true }, first: { url: '/any', headers: { 'content-type': 'application/json' } }, second: { url: '/any', headers: { 'content-type': 'application/json; charset=utf-8' } } },
      { name: 'headers', option: { headers: ['X-Tenant'] }, first: { url: '/any', headers: { 'x-tenant': 'a' } }, second: { url: '/any', headers: { 'x-tenant': 'b' } } }
    ]
    for (const component of components) {
      it(`refuses a change of ${component.name} when it is part of the fingerprint, and replays it when it is not`, async () => {
        const routes = { '/any': () => ({ ok: true }), '/other': () => ({ ok: true }) }
        const strict = await app({ fingerprint: component.option }, routes)
        const key = newKey()
        expect((await post(strict, key, { a: 1 }, component.first)).statusCode).toBe(200)
        expect((await post(strict, key, { a: 1 }, component.first)).headers['idempotent-replayed']).toBe('true')
        expect((await post(strict, key, { a: 1 }, component.second)).statusCode).toBe(409)

        const lax = await app({}, routes)
        const other = newKey()
        expect((await post(lax, other, { a: 1 }, component.first)).statusCode).toBe(200)
        const replay = await post(lax, other, { a: 1 }, component.second)
        expect(replay.statusCode).toBe(200)
        expect(replay.headers['idempotent-replayed']).toBe('true')
      })
    }

    it('sorts query parameters: the same parameters in another order replay', async () => {
      const t = await app({ fingerprint: { query: true } }, { '/any': () => ({ ok: true }) })
      const key = newKey()
      await post(t, key, {}, { url: '/any?b=2&a=1' })
      expect((await post(t, key, {}, { url: '/any?a=1&b=2' })).headers['idempotent-replayed']).toBe('true')
      expect((await post(t, key, {}, { url: '/any?a=%31&b=2' })).headers['idempotent-replayed']).toBe('true')
    })

    it('compares a key reused by an app with other FingerprintOptions on the same store under the options its entry was made with', async () => {
      const bodyOnly = await app()
      const withMethod = await app({ fingerprint: { method: true } })
      const key = newKey()
      expect((await post(bodyOnly, key, { a: 1 })).statusCode).toBe(201)
      expect((await post(withMethod, key, { a: 1 })).headers['idempotent-replayed']).toBe('true')
      expect((await post(withMethod, key, { a: 2 })).statusCode).toBe(409)
      expect(withMethod.runs.get('/orders')).toBeUndefined()
    })

    it('fingerprints only the JSON members a route includes, or all but those it excludes', async () => {
      const include = await app({ fingerprint: { body: { include: ['/amount'] } } })
      const key = newKey()
      await post(include, key, { amount: 5, note: 'a' })
      expect((await post(include, key, { amount: 5, note: 'b' })).headers['idempotent-replayed']).toBe('true')
      expect((await post(include, key, { amount: 6, note: 'a' })).statusCode).toBe(409)

      const exclude = await app({ fingerprint: { body: { exclude: ['/sentAt'] } } })
      const other = newKey()
      await post(exclude, other, { amount: 5, sentAt: 1 })
      expect((await post(exclude, other, { amount: 5, sentAt: 2 })).headers['idempotent-replayed']).toBe('true')
      expect((await post(exclude, other, { amount: 6, sentAt: 1 })).statusCode).toBe(409)
    })

    for (const status of [400, 500]) {
      it(`does not store a ${status} response: a retry runs the handler`, async () => {
        const t = await app({}, { '/flaky': (_req, reply, run) => { reply.code(run === 1 ? status : 201); return { run } } })
        const key = newKey()
        expect((await post(t, key, {}, { url: '/flaky' })).statusCode).toBe(status)
        const retry = await post(t, key, {}, { url: '/flaky' })
        expect(retry.statusCode).toBe(201)
        expect(retry.headers['idempotent-replayed']).toBeUndefined()
        expect((await post(t, key, {}, { url: '/flaky' })).headers['idempotent-replayed']).toBe('true')
        expect(t.runs.get('/flaky')).toBe(2)
      })
    }

    it('does not store a thrown error: a retry runs the handler', async () => {
      const t = await app({}, { '/throws': (_req, _reply, run) => { if (run === 1) throw new Error('boom'); return { run } } })
      await expectRunAgain(t, '/throws', 500)
    })

    it('stores an added cacheable status, and not a removed one', async () => {
      const routes: Record<string, Handler> = { '/status': (_req, reply, run) => { reply.code(run === 1 ? 400 : 201); return { run } } }
      const added = await app({ addCacheableStatusCodes: [400] }, routes)
      const key = newKey()
      expect((await post(added, key, {}, { url: '/status' })).statusCode).toBe(400)
      const replay = await post(added, key, {}, { url: '/status' })
      expect(replay.statusCode).toBe(400)
      expect(replay.headers['idempotent-replayed']).toBe('true')

      const removed = await app({ removeCacheableStatusCodes: [201] })
      const other = newKey()
      await post(removed, other, {})
      expect((await post(removed, other, {})).headers['idempotent-replayed']).toBeUndefined()
      expect(removed.runs.get('/orders')).toBe(2)
    })

    it('runs the handler again after expiration and stores its new response', async () => {
      // Long enough for a replay to come before it on a loaded machine.
      const expiration = scaled(150)
      const t = await app({ expiration })
      const key = newKey()
      const first = await post(t, key, { a: 1 })
      expect((await post(t, key, { a: 1 })).headers['idempotent-replayed']).toBe('true')
      // Another body is a mismatch (409) until the stored response expires, then a new request.
      const after = await resendWhile([409], () => post(t, key, { a: 2 }), { attempts: Math.ceil(4 * expiration / 50) })
      expect(after.statusCode).toBe(201)
      expect(after.headers['idempotent-replayed']).toBeUndefined()
      expect(after.json().id).toBe(2)
      expect(after.body).not.toBe(first.body)
      const replay = await post(t, key, { a: 2 })
      expect(replay.headers['idempotent-replayed']).toBe('true')
      expect(replay.body).toBe(after.body)
    })

    it('answers a duplicate of an in-flight request with 409 request-in-progress and Retry-After; a different body with the mismatch', async () => {
      const gate = new Gate()
      const t = await app({ lockTimeout: '30s' }, { '/slow': async () => { await gate.hold(); return { done: true } } })
      const key = newKey()
      const first = post(t, key, { a: 1 }, { url: '/slow' })
      await gate.entered
      const duplicate = await post(t, key, { a: 1 }, { url: '/slow' })
      expect(duplicate.statusCode).toBe(409)
      expect(duplicate.json().type).toMatch(/#request-in-progress$/)
      expect(duplicate.json().idempotencyKey).toBe(key)
      expect(Number(duplicate.headers['retry-after'])).toBeGreaterThanOrEqual(1)
      expect(Number(duplicate.headers['retry-after'])).toBeLessThanOrEqual(30)
      const different = await post(t, key, { a: 2 }, { url: '/slow' })
      expect(different.json().type).toMatch(/#fingerprint-mismatch$/)
      gate.open()
      expect((await first).statusCode).toBe(200)
      expect((await post(t, key, { a: 1 }, { url: '/slow' })).headers['idempotent-replayed']).toBe('true')
      expect(t.runs.get('/slow')).toBe(1)
    })

    it('runs the handler once for 20 simultaneous requests with one key', async () => {
      const gate = new Gate()
      const t = await app({}, { '/gated': async () => { await gate.hold(); return { done: true } } })
      const key = newKey()
      const pending = Array.from({ length: 20 }, () => post(t, key, { a: 1 }, { url: '/gated' }))
      const settled: number[] = []
      for (const p of pending) void p.then((res) => settled.push(res.statusCode))
      // The 19 refused answer while the first still waits at the gate.
      while (settled.length < 19) await sleep(5)
      expect(settled.every((code) => code === 409)).toBe(true)
      gate.open()
      const all = await Promise.all(pending)
      expect(all.filter((res) => res.statusCode === 200)).toHaveLength(1)
      expect(t.runs.get('/gated')).toBe(1)
    })

    it('with wait, lets a duplicate wait for the first request and receive its response', async () => {
      const gate = new Gate()
      const t = await app({ wait: true, waitTimeout: '20s' }, { '/slow': async (_req, reply) => { await gate.hold(); reply.code(201); return { done: true } } })
      const key = newKey()
      const first = post(t, key, { a: 1 }, { url: '/slow' })
      await gate.entered
      const duplicates = Array.from({ length: 5 }, () => post(t, key, { a: 1 }, { url: '/slow' }))
      const mismatch = await post(t, key, { a: 2 }, { url: '/slow' })
      expect(mismatch.statusCode).toBe(409)
      expect(mismatch.json().type).toMatch(/#fingerprint-mismatch$/)
      gate.open()
      const firstAnswer = await first
      for (const duplicate of await Promise.all(duplicates)) {
        expect(duplicate.statusCode).toBe(201)
        expect(duplicate.body).toBe(firstAnswer.body)
        expect(duplicate.headers['idempotent-replayed']).toBe('true')
      }
      expect(t.runs.get('/slow')).toBe(1)
    })

    it('with wait, lets exactly one waiter run the handler when the first request stored nothing', async () => {
      const gate = new Gate()
      const t = await app({ wait: true, waitTimeout: '20s' }, {
        '/fails-once': async (_req, reply, run) => {
          if (run === 1) { await gate.hold(); reply.code(500); return { failed: true } }
          reply.code(201)
          return { run }
        }
      })
      const key = newKey()
      const first = post(t, key, { a: 1 }, { url: '/fails-once' })
      await gate.entered
      const waiters = Array.from({ length: 6 }, () => post(t, key, { a: 1 }, { url: '/fails-once' }))
      gate.open()
      expect((await first).statusCode).toBe(500)
      const answers = await Promise.all(waiters)
      expect(t.runs.get('/fails-once')).toBe(2)
      expect(answers.every((res) => res.statusCode === 201 && res.body === answers[0]!.body)).toBe(true)
      expect(answers.filter((res) => res.headers['idempotent-replayed'] === undefined)).toHaveLength(1)
    })

    it('with wait, answers 409 in progress once waitTimeout has passed', async () => {
      const gate = new Gate()
      const t = await app({}, { '/slow': async () => { await gate.hold(); return { done: true } } }, { wait: true, waitTimeout: 300 })
      const key = newKey()
      const first = post(t, key, { a: 1 }, { url: '/slow' })
      await gate.entered
      const before = Date.now()
      const late = await post(t, key, { a: 1 }, { url: '/slow' })
      expect(late.statusCode).toBe(409)
      expect(late.json().type).toMatch(/#request-in-progress$/)
      expect(Date.now() - before).toBeGreaterThanOrEqual(280)
      gate.open()
      await first
    })

    it('does not run the handler on a replay when other onSend hooks are asynchronous', async () => {
      const instance = Fastify()
      await instance.register(idempotency, { storage })
      instance.setErrorHandler(idempotencyErrorHandler())
      // An app-wide asynchronous onSend hook (compression, signing, ...) delays the replay's send.
      instance.addHook('onSend', async (_request, _reply, payload) => { await new Promise((resolve) => setImmediate(resolve)); return payload })
      let runs = 0
      instance.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; reply.code(201); return { run: runs } })
      const key = newKey()
      const send = () => instance.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } })
      await send()
      const replay = await send()
      expect(replay.headers['idempotent-replayed']).toBe('true')
      expect(replay.json()).toEqual({ run: 1 })
      expect(runs).toBe(1)
      await instance.close()
    })

    it('does not store a thrown error even when the error handler answers with a cacheable status', async () => {
      const t = await app({ addCacheableStatusCodes: [409] }, {
        '/conflict': (_req, _reply, run) => { if (run === 1) throw Object.assign(new Error('taken'), { statusCode: 409 }); return { run } }
      })
      await expectRunAgain(t, '/conflict', 409)
    })

    it('answers a body too deeply nested to fingerprint with 400 problem+json, not 500', async () => {
      const t = await app()
      const deep = '['.repeat(20_000) + ']'.repeat(20_000)
      const res = await post(t, newKey(), deep, { headers: { 'content-type': 'application/json' } })
      expect(res.statusCode).toBe(400)
      expect(res.json().type).toMatch(/#fingerprint-failed$/)
      expect(t.runs.get('/orders')).toBeUndefined()
    })

    it('runs a route through the innermost registration only, when registered at the root and again in a child', async () => {
      const instance = Fastify()
      instance.setErrorHandler(idempotencyErrorHandler())
      await instance.register(idempotency, { storage, replayHeader: 'X-Outer' })
      let runs = 0
      await instance.register(async (child) => {
        await child.register(idempotency, { storage, replayHeader: 'X-Inner' })
        child.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs }))
      }, { prefix: '/child' })
      const key = newKey()
      const send = () => instance.inject({ method: 'POST', url: '/child/orders', headers: { 'idempotency-key': key }, payload: {} })
      expect((await send()).statusCode).toBe(200)
      const replay = await send()
      expect(replay.statusCode).toBe(200)
      expect(replay.headers['x-inner']).toBe('true')
      expect(replay.headers['x-outer']).toBeUndefined()
      expect(runs).toBe(1)
      await instance.close()
    })

    it('works when registered in two encapsulated contexts', async () => {
      const instance = Fastify()
      instance.setErrorHandler(idempotencyErrorHandler())
      let runs = 0
      for (const prefix of ['/a', '/b']) {
        await instance.register(async (child) => {
          await child.register(idempotency, { storage })
          child.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs }))
        }, { prefix })
      }
      const key = newKey()
      for (const url of ['/a/orders', '/a/orders', '/b/orders']) {
        await instance.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })
      }
      expect(runs).toBe(1)
      await instance.close()
    })

    it('passes a request without a key through, unprotected, unless the route requires one', async () => {
      const t = await app()
      expect((await post(t, undefined, {})).statusCode).toBe(201)
      expect((await post(t, undefined, {})).headers['idempotent-replayed']).toBeUndefined()
      expect(t.runs.get('/orders')).toBe(2)
      const required = await app({}, {}, { required: true })
      const res = await post(required, undefined, {})
      expect(res.statusCode).toBe(400)
      expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
      expect(res.json().type).toMatch(/#key-missing$/)
      expect(required.runs.get('/orders')).toBeUndefined()
    })

    it('refuses invalid keys with 400 problem+json before running anything', async () => {
      const t = await app()
      for (const bad of ['', 'has space', 'x'.repeat(256), '"unterminated', '"a" , "b"', 'tab\there', '\u00e9t\u00e9']) {
        const res = await t.app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': bad }, payload: {} })
        expect(res.statusCode, JSON.stringify(bad)).toBe(400)
        expect(res.json().type).toMatch(/#key-invalid$/)
      }
      expect(t.runs.get('/orders')).toBeUndefined()
    })

    it('accepts the quoted sf-string form as the same key as the bare form', async () => {
      const t = await app()
      const key = newKey()
      await post(t, key, { a: 1 })
      const quoted = await post(t, `"${key}"`, { a: 1 })
      expect(quoted.headers['idempotent-replayed']).toBe('true')
    })

    it('keeps scopes apart: the same key from two principals is two operations', async () => {
      const t = await app({ scope: (request) => String(request.headers['x-user']) })
      const key = newKey()
      const alice = await post(t, key, { a: 1 }, { headers: { 'x-user': 'alice' } })
      const bob = await post(t, key, { a: 1 }, { headers: { 'x-user': 'bob' } })
      expect(bob.headers['idempotent-replayed']).toBeUndefined()
      expect(bob.json().id).toBe(2)
      expect((await post(t, key, { a: 1 }, { headers: { 'x-user': 'alice' } })).body).toBe(alice.body)
      expect((await post(t, key, { a: 9 }, { headers: { 'x-user': 'bob' } })).statusCode).toBe(409)
    })

    it('accepts any scope the application returns: long ones, multi-byte ones, lone surrogates, each kept apart', async () => {
      // A scope from a header or a token can be long, or not well-formed Unicode; such a scope
      // used to make PostgreSQL answer 503 on every attempt while memory and Redis accepted it.
      const scopes: Record<string, string> = {
        long: 't'.repeat(2000),
        longer: 't'.repeat(2001),
        multibyte: '\u00e9'.repeat(300),
        'lone-high': 'tenant-\uD800',
        'lone-low': 'tenant-\uDC00'
      }
      const t = await app({ scope: (request) => scopes[String(request.headers['x-principal'])]! })
      const key = newKey()
      const first = new Map<string, string>()
      for (const principal of Object.keys(scopes)) {
        const res = await post(t, key, { a: 1 }, { headers: { 'x-principal': principal } })
        expect(res.statusCode, principal).toBe(201)
        expect(res.headers['idempotent-replayed'], principal).toBeUndefined()
        first.set(principal, res.body)
      }
      for (const principal of Object.keys(scopes)) {
        const again = await post(t, key, { a: 1 }, { headers: { 'x-principal': principal } })
        expect(again.headers['idempotent-replayed'], principal).toBe('true')
        expect(again.body, principal).toBe(first.get(principal))
        expect((await post(t, key, { a: 2 }, { headers: { 'x-principal': principal } })).statusCode, principal).toBe(409)
      }
      expect(t.runs.get('/orders')).toBe(Object.keys(scopes).length)
    })

    it('never stores nor replays GET, HEAD or OPTIONS under a key, also on a route declared with several methods', async () => {
      const app = Fastify()
      await app.register(idempotency, { storage })
      app.setErrorHandler(idempotencyErrorHandler())
      let reads = 0
      let writes = 0
      app.get('/balance', { config: { idempotency: true } }, async () => ({ balance: ++reads }))
      app.route({ method: ['GET', 'POST', 'OPTIONS'], url: '/things', config: { idempotency: true }, handler: async (request) => request.method === 'POST' ? { write: ++writes } : { read: ++reads } })
      await app.ready()
      const key = newKey()
      const send = (method: string, url: string) => app.inject({ method: method as 'GET', url, headers: { 'idempotency-key': key } })
      // A client sending one key on every request reads fresh values, never a stored one.
      for (const [method, url] of [['GET', '/balance'], ['HEAD', '/balance'], ['GET', '/balance'], ['GET', '/things'], ['OPTIONS', '/things'], ['HEAD', '/things'], ['GET', '/things']]) {
        const res = await send(method!, url!)
        expect(res.statusCode, `${method} ${url}`).toBe(200)
        expect(res.headers['idempotent-replayed'], `${method} ${url}`).toBeUndefined()
      }
      expect(reads).toBe(7)
      expect((await send('GET', '/balance')).json()).toEqual({ balance: 8 })
      // The unsafe method of the same route is guarded, and the safe requests stored nothing under the key.
      const post = await send('POST', '/things')
      expect(post.json()).toEqual({ write: 1 })
      expect((await send('POST', '/things')).headers['idempotent-replayed']).toBe('true')
      expect(writes).toBe(1)
      await app.close()
    })

    it('replays a Buffer body and a streamed body byte for byte', async () => {
      const bytes = Buffer.from(Array.from({ length: 4096 }, (_, i) => (i * 7) % 256))
      const t = await app({}, {
        '/buffer': (_req, reply) => { reply.type('application/octet-stream'); return bytes },
        '/stream': (_req, reply) => { reply.type('application/x-custom'); return Readable.from([bytes.subarray(0, 1000), bytes.subarray(1000)]) }
      })
      for (const url of ['/buffer', '/stream']) {
        const key = newKey()
        const first = await post(t, key, {}, { url })
        const again = await post(t, key, {}, { url })
        expect(first.rawPayload.equals(bytes)).toBe(true)
        expect(again.rawPayload.equals(bytes)).toBe(true)
        expect(again.headers['content-type']).toBe(first.headers['content-type'])
        expect(again.headers['idempotent-replayed']).toBe('true')
        expect(t.runs.get(url)).toBe(1)
      }
    })

    it('keeps the outcome of a response over maxResponseBytes: a retry gets its status and headers, no body, and the handler does not run again', async () => {
      const big = 'x'.repeat(2048)
      const t = await app({ maxResponseBytes: 1024 }, {
        '/big': (_req, reply) => { reply.code(201).header('location', '/reports/1'); return big },
        '/big-stream': (_req, reply) => { reply.code(201).header('location', '/reports/1').type('text/plain'); return Readable.from([Buffer.from(big.slice(0, 1000)), Buffer.from(big.slice(1000))]) }
      })
      for (const url of ['/big', '/big-stream']) {
        const key = newKey()
        const first = await post(t, key, {}, { url })
        expect(first.body).toBe(big)
        const retry = await post(t, key, {}, { url })
        expect(retry.statusCode).toBe(201)
        expect(retry.headers.location).toBe('/reports/1')
        expect(retry.headers['content-type']).toBe(first.headers['content-type'])
        expect(retry.headers['idempotent-replayed']).toBe('true')
        expect(retry.headers['idempotent-body-omitted']).toBe('true')
        expect(retry.body).toBe('')
        expect(t.runs.get(url)).toBe(1)
        // Another request under the key is still a mismatch.
        expect((await post(t, key, { other: true }, { url })).statusCode).toBe(409)
      }
    })

    it("with unstorableResponse: 'release', sends but does not store a response over maxResponseBytes, and frees the key", async () => {
      const big = 'x'.repeat(2048)
      const t = await app({ maxResponseBytes: 1024, unstorableResponse: 'release' }, {
        '/big': () => big,
        '/big-stream': () => Readable.from([Buffer.from(big.slice(0, 1000)), Buffer.from(big.slice(1000))])
      })
      for (const url of ['/big', '/big-stream']) {
        const key = newKey()
        expect((await post(t, key, {}, { url })).body).toBe(big)
        const retry = await post(t, key, {}, { url })
        expect(retry.body).toBe(big)
        expect(retry.headers['idempotent-replayed']).toBeUndefined()
        expect(t.runs.get(url)).toBe(2)
      }
    })

    it('does not replay hop-by-hop headers, date or set-cookie (unless replaySetCookie)', async () => {
      const routes: Record<string, Handler> = {
        '/cookie': (_req, reply) => {
          reply.header('set-cookie', ['a=1', 'b=2']).header('x-custom', 'kept').header('cache-control', 'no-store')
          return { ok: true }
        }
      }
      const t = await app({}, routes)
      const key = newKey()
      const first = await post(t, key, {}, { url: '/cookie' })
      expect(first.headers['set-cookie']).toEqual(['a=1', 'b=2'])
      const again = await post(t, key, {}, { url: '/cookie' })
      expect(again.headers['set-cookie']).toBeUndefined()
      expect(again.headers['x-custom']).toBe('kept')
      expect(again.headers['cache-control']).toBe('no-store')
      expect(again.headers.connection).toBe(first.headers.connection)
      expect(again.headers['transfer-encoding']).toBeUndefined()

      const cookies = await app({ replaySetCookie: true }, routes)
      const other = newKey()
      await post(cookies, other, {}, { url: '/cookie' })
      expect((await post(cookies, other, {}, { url: '/cookie' })).headers['set-cookie']).toEqual(['a=1', 'b=2'])
    })

    it('keeps the outcome of a hijacked reply: a retry gets its status, no body, and the handler does not run again', async () => {
      const t = await app({}, {
        '/hijack': (_req, reply) => {
          reply.hijack()
          reply.raw.setHeader('x-raw', 'yes')
          reply.raw.writeHead(202)
          reply.raw.end('raw')
        }
      })
      const key = newKey()
      expect((await post(t, key, {}, { url: '/hijack' })).body).toBe('raw')
      // In progress until the raw response has ended and its outcome is stored.
      const retry = await resendWhile([409], () => post(t, key, {}, { url: '/hijack' }))
      expect(retry.statusCode).toBe(202)
      expect(retry.headers['x-raw']).toBe('yes')
      expect(retry.headers['idempotent-body-omitted']).toBe('true')
      expect(retry.body).toBe('')
      expect(t.runs.get('/hijack')).toBe(1)
    })

    it("with unstorableResponse: 'release', releases the key of a hijacked reply, so a retry runs", async () => {
      const t = await app({ unstorableResponse: 'release' }, {
        '/hijack': (_req, reply) => {
          reply.hijack()
          reply.raw.writeHead(200)
          reply.raw.end('raw')
        }
      })
      const key = newKey()
      expect((await post(t, key, {}, { url: '/hijack' })).body).toBe('raw')
      // In progress until the raw response has ended and the key is released.
      expect((await resendWhile([409], () => post(t, key, {}, { url: '/hijack' }))).body).toBe('raw')
      expect(t.runs.get('/hijack')).toBe(2)
    })

    it('sends the replay header under another name, or none', async () => {
      const renamed = await app({ replayHeader: 'X-Replayed' })
      const key = newKey()
      await post(renamed, key, {})
      const again = await post(renamed, key, {})
      expect(again.headers['x-replayed']).toBe('true')
      expect(again.headers['idempotent-replayed']).toBeUndefined()
      const silent = await app({ replayHeader: false })
      const other = newKey()
      await post(silent, other, {})
      const quiet = await post(silent, other, {})
      expect(quiet.headers['idempotent-replayed']).toBeUndefined()
      expect(silent.runs.get('/orders')).toBe(1)
    })

    it('applies a route\'s overrides over the plugin options', async () => {
      const t = await app({ fingerprint: { headers: ['x-a'] } }, {}, { required: true, fingerprint: { query: true } })
      const key = newKey()
      expect((await post(t, undefined, {})).statusCode).toBe(400)
      await post(t, key, {}, { url: '/orders?x=1', headers: { 'x-a': '1' } })
      expect((await post(t, key, {}, { url: '/orders?x=2', headers: { 'x-a': '1' } })).statusCode).toBe(409)
      expect((await post(t, key, {}, { url: '/orders?x=1', headers: { 'x-a': '2' } })).statusCode).toBe(409)
      expect((await post(t, key, {}, { url: '/orders?x=1', headers: { 'x-a': '1' } })).statusCode).toBe(201)
    })
  })
}
