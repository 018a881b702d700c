/**
 * Store failures as the plugin sees them: a store that throws. (Real outages of each real store,
 * through a proxy or a private server, are in the store test files.)
 */
import { describe, expect, it } from 'vitest'
import { Writable } from 'node:stream'
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyOptions, type IdempotencyStorage } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { resendWhile } from './helpers/resend.js'
import { Gate } from './helpers/gate.js'
import { scaled } from './helpers/pace.js'

type Method = 'begin' | 'complete' | 'release' | 'renew'

/** A MemoryStorage whose chosen methods fail while `down` holds them. */
function breakable () {
  const inner = new MemoryStorage()
  const down = new Set<Method>()
  const guard = <T>(method: Method, call: () => Promise<T>): Promise<T> =>
    down.has(method) ? Promise.reject(new Error(`connect ECONNREFUSED (${method})`)) : call()
  const storage: IdempotencyStorage = {
    begin: (k, f, l) => guard('begin', () => inner.begin(k, f, l)),
    complete: (k, t, r, e) => guard('complete', () => inner.complete(k, t, r, e)),
    release: (k, t) => guard('release', () => inner.release(k, t)),
    renew: (k, t, l) => guard('renew', () => inner.renew(k, t, l))
  }
  return { storage, down, inner }
}

async function appWith (storage: IdempotencyStorage, options: IdempotencyOptions = {}) {
  const logs: Array<{ level: number, msg: string }> = []
  const stream = new Writable({ write (chunk, _enc, cb) { logs.push(JSON.parse(String(chunk))); cb() } })
  const app = Fastify({ logger: { level: 'info', stream } })
  await app.register(idempotency, { storage, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  let runs = 0
  app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { runs++; reply.code(201); return { run: runs } })
  await app.ready()
  const post = (key: string) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } })
  return { app, post, logs, runs: () => runs }
}

describe('store failures', () => {
  it('fails closed: 503 problem+json with Retry-After, and the handler does not run', async () => {
    const { storage, down } = breakable()
    down.add('begin')
    const t = await appWith(storage)
    const res = await t.post(newKey())
    expect(res.statusCode).toBe(503)
    expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
    expect(res.headers['retry-after']).toBe('1')
    expect(res.json().type).toMatch(/#store-unavailable$/)
    expect(res.body).not.toContain('ECONNREFUSED')
    expect(t.runs()).toBe(0)
  })

  it('with failOpen, runs the handler unprotected and logs a warning', async () => {
    const { storage, down } = breakable()
    down.add('begin')
    const t = await appWith(storage, { failOpen: true })
    const key = newKey()
    expect((await t.post(key)).statusCode).toBe(201)
    expect((await t.post(key)).statusCode).toBe(201)
    expect(t.runs()).toBe(2)
    expect(t.logs.some((line) => line.level === 40 && /failOpen/.test(line.msg))).toBe(true)
  })

  it('recovers without a restart when the store comes back', async () => {
    const { storage, down } = breakable()
    const t = await appWith(storage)
    const key = newKey()
    down.add('begin')
    expect((await t.post(key)).statusCode).toBe(503)
    down.delete('begin')
    expect((await t.post(key)).statusCode).toBe(201)
    expect((await t.post(key)).headers['idempotent-replayed']).toBe('true')
    expect(t.runs()).toBe(1)
  })

  it('still answers the client when storing fails after the handler ran, and keeps storing: duplicates get 409, then the replay, never a second run', async () => {
    const { storage, down } = breakable()
    const t = await appWith(storage, { lockTimeout: 600 })
    const key = newKey()
    down.add('complete')
    const res = await t.post(key)
    expect(res.statusCode).toBe(201)
    expect(res.json()).toEqual({ run: 1 })
    expect(t.logs.some((line) => line.level === 50 && /storing is retried/.test(line.msg))).toBe(true)
    // Past lockTimeout: the lease is renewed while storing is retried.
    await new Promise((resolve) => setTimeout(resolve, 900))
    expect((await t.post(key)).statusCode).toBe(409)
    down.delete('complete')
    const retry = await resendWhile([409], () => t.post(key))
    expect(retry.statusCode).toBe(201)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.json()).toEqual({ run: 1 })
    expect(t.runs()).toBe(1)
  })

  it('gives up storing at maxLockHold, loudly, and the key is free again once the lease lapses', async () => {
    const { storage, down } = breakable()
    // Renewed every lockTimeout / 8: a lease shorter than what the event loop stalls for on this
    // machine would lapse before maxLockHold, and free the key before the plugin gave up.
    const lockTimeout = scaled(100)
    const t = await appWith(storage, { lockTimeout, maxLockHold: 3 * lockTimeout })
    const key = newKey()
    down.add('complete')
    expect((await t.post(key)).statusCode).toBe(201)
    const retry = await resendWhile([409], () => t.post(key), { attempts: Math.ceil(20 * lockTimeout / 50) })
    expect(retry.statusCode).toBe(201)
    expect(t.runs()).toBe(2)
    // Said when it gave up, at maxLockHold, before the lease lapsed: by the time a retry could
    // run the handler again, not later.
    expect(t.logs.some((line) => line.level === 50 && /gave up storing it/.test(line.msg))).toBe(true)
  })

  it('makes its last attempt to store at maxLockHold, not a back-off pause past it: it has said it gave up before a retry can run the handler again', async () => {
    const { storage, down } = breakable()
    // Attempts 50, 150, 350, 750, 1550 and 3150 ms after the first one failed (about 150 ms after
    // the key was taken): the next back-off pause (2 s) would end past maxLockHold (3.6 s) and past
    // the lease's lapse (its last renewal, near 3.6 s, plus 800 ms). A lease of 800 ms outlives
    // the event loop's stalls on a busy machine.
    const t = await appWith(storage, { lockTimeout: 800, maxLockHold: 3600 })
    const key = newKey()
    down.add('complete')
    const started = Date.now()
    expect((await t.post(key)).statusCode).toBe(201)
    const gaveUp = (): boolean => t.logs.some((line) => line.level === 50 && /gave up storing it/.test(line.msg))
    const retry = await resendWhile([409], () => t.post(key), { pause: 20, attempts: 500 })
    expect(retry.statusCode).toBe(201)
    expect(t.runs()).toBe(2)
    expect(gaveUp(), `the retry ran the handler again ${Date.now() - started} ms after the first request, before the plugin said it gave up storing`).toBe(true)
  })

  it('still answers the client when releasing fails after an error response', async () => {
    const { storage, down } = breakable()
    const app = Fastify()
    await app.register(idempotency, { storage })
    app.post('/fails', { config: { idempotency: true } }, async () => { throw Object.assign(new Error('bad'), { statusCode: 422 }) })
    down.add('release')
    const res = await app.inject({ method: 'POST', url: '/fails', headers: { 'idempotency-key': newKey() }, payload: {} })
    expect(res.statusCode).toBe(422)
  })

  it('logs a warning when the lease was lost before the response could be stored', async () => {
    const { storage } = breakable()
    const t = await appWith({ ...storage, complete: async () => false })
    expect((await t.post(newKey())).statusCode).toBe(201)
    expect(t.logs.some((line) => line.level === 40 && /lease was lost/.test(line.msg))).toBe(true)
  })

  it('renews the lease of a long handler so a retry is not let in', async () => {
    const renewals: number[] = []
    const inner = new MemoryStorage()
    const storage: IdempotencyStorage = {
      begin: (k, f, l) => inner.begin(k, f, l),
      complete: (k, t, r, e) => inner.complete(k, t, r, e),
      release: (k, t) => inner.release(k, t),
      renew: async (k, t, l) => { renewals.push(Date.now()); return inner.renew(k, t, l) }
    }
    const app = Fastify()
    // 150 ms, scaled by the machine's pace: a lease the event loop's stalls outlive.
    const lockTimeout = scaled(150)
    await app.register(idempotency, { storage, lockTimeout })
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    const gate = new Gate()
    app.post('/slow', { config: { idempotency: true } }, async () => { runs++; await gate.hold(); return { ok: true } })
    const key = newKey()
    const first = app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: {} })
    while (renewals.length < 9) await new Promise((resolve) => setTimeout(resolve, 20))
    // 9 renewals, one every lockTimeout / 8, are past the first lockTimeout: without them the
    // lease would have lapsed.
    const retry = await app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: {} })
    expect(retry.statusCode).toBe(409)
    gate.open()
    expect((await first).statusCode).toBe(200)
    expect(runs).toBe(1)
    const count = renewals.length
    // Eight renewal periods and more: none comes once the request has ended.
    await new Promise((resolve) => setTimeout(resolve, lockTimeout + 50))
    expect(renewals.length).toBe(count)
  })
})

describe('a store that never answers', () => {
  it('answers 503 within storeTimeout, keeps answering other requests, and gives back a lease granted too late', async () => {
    const inner = new MemoryStorage()
    let hang = true
    const late: Array<() => void> = []
    const storage: IdempotencyStorage = {
      begin: (k, f, l) => hang ? new Promise((resolve) => { late.push(() => { resolve(inner.begin(k, f, l)) }) }) : inner.begin(k, f, l),
      complete: (k, t, r, e) => inner.complete(k, t, r, e),
      release: (k, t) => inner.release(k, t),
      renew: (k, t, l) => inner.renew(k, t, l)
    }
    const t = await appWith(storage, { storeTimeout: 200 })
    const key = newKey()
    const started = Date.now()
    const answers = await Promise.all([t.post(key), t.post(newKey()), t.post(newKey())])
    const elapsed = Date.now() - started
    expect(answers.map((res) => res.statusCode)).toEqual([503, 503, 503])
    expect(answers[0]!.json().type).toMatch(/#store-unavailable$/)
    expect(elapsed).toBeGreaterThanOrEqual(200)
    expect(elapsed).toBeLessThan(1000)
    expect(t.runs()).toBe(0)
    // The store wakes up and grants the lease nobody waits for any more: it is given back.
    hang = false
    for (const grant of late) grant()
    await new Promise((resolve) => setTimeout(resolve, 20))
    expect(inner.leases).toBe(0)
    expect((await t.post(key)).statusCode).toBe(201)
  })

  it('answers the client when storing hangs, and keeps the key from a second run', async () => {
    const inner = new MemoryStorage()
    let hang = true
    const storage: IdempotencyStorage = {
      begin: (k, f, l) => inner.begin(k, f, l),
      complete: (k, t, r, e) => hang ? new Promise(() => {}) : inner.complete(k, t, r, e),
      release: (k, t) => inner.release(k, t),
      renew: (k, t, l) => inner.renew(k, t, l)
    }
    // A lease long enough that a busy machine's late timers cannot let it lapse between renewals.
    const t = await appWith(storage, { storeTimeout: 100, lockTimeout: 600 })
    const key = newKey()
    const started = Date.now()
    expect((await t.post(key)).statusCode).toBe(201)
    expect(Date.now() - started).toBeLessThan(1000)
    // Past lockTimeout: the lease lives because it is renewed while storing is retried.
    await new Promise((resolve) => setTimeout(resolve, 900))
    expect((await t.post(key)).statusCode).toBe(409)
    hang = false
    const retry = await resendWhile([409], () => t.post(key))
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(t.runs()).toBe(1)
  })
})
