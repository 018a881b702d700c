/**
 * Recovery points recorded by an earlier version, under the key it used (`\u0000step:` and a hash
 * of the request's storage key and the step's name), are still found after an upgrade, over real
 * HTTP on every store, with and without encryption: a handler that charged before the upgrade and
 * is retried after it does not charge again, and a step an earlier version's process is running
 * right now is answered 409 in progress. Records are kept where `forget` finds them from then on.
 */
import { hash, randomBytes } from 'node:crypto'
import { describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyStorage } from '../lib/index.js'
import { ResponseCipher } from '../lib/encryption.js'
import { stepRecordPrefix } from '../lib/engine/steps.js'
import { storageKey } from '../lib/engine/storage-key.js'
import { servedOn } from './helpers/served.js'
import { storeCases, type StoreCase } from './helpers/stores.js'
import { postWithKey } from './helpers/http-client.js'

const ENCRYPTION = { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) }

/** A MemoryStorage seen through the four required methods only, as a custom store without `inspect` is. */
function withoutOperations (inner: MemoryStorage): IdempotencyStorage {
  return {
    begin: async (...args) => await inner.begin(...args),
    complete: async (...args) => await inner.complete(...args),
    release: async (...args) => await inner.release(...args),
    renew: async (...args) => await inner.renew(...args)
  }
}

let withoutInspect = new MemoryStorage()
const memoryWithoutInspect: StoreCase = {
  name: 'a custom store without inspect',
  available: true,
  reason: '',
  create: async () => (withoutInspect = new MemoryStorage()),
  cleanup: async () => {},
  open: async () => ({ storage: withoutInspect, close: async () => {} })
}

for (const encrypted of [false, true]) {
  for (const store of [...await storeCases(), memoryWithoutInspect]) {
    describe.skipIf(!store.available)(`recovery points of an earlier version on ${store.name}${encrypted ? ' with encryption' : ''}${store.reason}`, () => {
      let app: FastifyInstance
      let storage: IdempotencyStorage
      let inner: IdempotencyStorage
      const calls = { charge: 0, notify: 0 }
      let ordersDown = true
      const cipher = encrypted ? new ResponseCipher(ENCRYPTION) : null
      const key = `cart-${process.pid}-${Date.now()}`
      const requestKey = storageKey(key, null, cipher)
      const recordHash = (name: string) => hash('sha256', `${requestKey}\n${name}`, 'base64url')
      const currentKey = (name: string) => stepRecordPrefix(requestKey) + recordHash(name)
      const earlierKey = (name: string) => `\u0000step:${recordHash(name)}`

      const served = servedOn(store, async (created) => {
        inner = created
        storage = store === memoryWithoutInspect ? withoutOperations(inner as MemoryStorage) : inner
        app = Fastify()
        await app.register(idempotency, { storage, ...(encrypted ? { encryption: ENCRYPTION } : {}) })
        app.setErrorHandler(idempotencyErrorHandler())
        app.post('/checkout', { config: { idempotency: true } }, async (request) => {
          const charge = await request.idempotency!.step('charge', () => ({ id: `ch_${++calls.charge}` }))
          await request.idempotency!.step('notify', () => { calls.notify++ })
          if (ordersDown) throw new Error('the orders database is down')
          return { charge: charge.id }
        })
        return { app }
      })

      const checkout = async () => {
        const { status, body } = await postWithKey(`${served.url}/checkout`, key, '{"amount":4200}')
        return { status, body }
      }

      it('replays a record kept where an earlier version kept it, and answers 409 for a step it is running', async () => {
        expect((await checkout()).status).toBe(500)
        expect(calls).toEqual({ charge: 1, notify: 1 })
        // Move the charge's record where an earlier version kept it, sealed for that key.
        const charge = await inner.inspect!(currentKey('charge'))
        if (charge.state !== 'completed') throw new Error(`expected the charge recorded, got ${charge.state}`)
        const record = cipher === null ? charge.response : cipher.seal(earlierKey('charge'), cipher.open(currentKey('charge'), charge.response))
        const earlier = await inner.begin(earlierKey('charge'), charge.fingerprint, 60_000)
        if (earlier.state !== 'acquired') throw new Error('expected the earlier key free')
        expect(await inner.complete(earlierKey('charge'), earlier.token, record, 60_000)).toBe(true)
        // And an earlier version's process running the notification right now.
        const running = await inner.begin(earlierKey('notify'), charge.fingerprint, 60_000)
        if (running.state !== 'acquired') throw new Error('expected the earlier key free')
        for (const name of ['charge', 'notify']) await inner.forget!(currentKey(name), { force: true, relatedPrefix: '\u0000nothing:' })
        ordersDown = false

        const during = await checkout()
        expect(during.status).toBe(409)
        expect(JSON.parse(during.body).type).toMatch(/#request-in-progress$/)
        expect(calls).toEqual({ charge: 1, notify: 1 })
        // The lease this version took on the current key was given back.
        expect((await inner.inspect!(currentKey('notify'))).state).toBe('absent')

        expect(await inner.release(earlierKey('notify'), running.token)).toBe(true)
        const after = await checkout()
        expect(after).toEqual({ status: 200, body: '{"charge":"ch_1"}' })
        expect(calls).toEqual({ charge: 1, notify: 2 })
        // Looking at the earlier key left nothing there.
        expect((await inner.inspect!(earlierKey('notify'))).state).toBe('absent')
      })
    })
  }
}

describe('recovery points when the look at an earlier record fails', () => {
  it('answers 503 without running the step, and gives back the lease it took', async () => {
    const inner = new MemoryStorage()
    const isEarlierKey = (key: string) => key.startsWith('\u0000step:') && key.length === '\u0000step:'.length + 43
    const storage: IdempotencyStorage = {
      ...withoutOperations(inner),
      inspect: async (key) => {
        if (isEarlierKey(key)) throw new Error('connection reset')
        return await inner.inspect(key)
      }
    }
    const app = Fastify()
    await app.register(idempotency, { storage })
    app.setErrorHandler(idempotencyErrorHandler())
    let charges = 0
    app.post('/checkout', { config: { idempotency: true } }, async (request) => {
      await request.idempotency!.step('charge', () => { charges++ })
      return { ok: true }
    })
    const res = await app.inject({ method: 'POST', url: '/checkout', headers: { 'idempotency-key': 'k' }, payload: {} })
    expect(res.statusCode).toBe(503)
    expect(charges).toBe(0)
    const requestKey = storageKey('k', null)
    expect((await inner.inspect(stepRecordPrefix(requestKey) + hash('sha256', `${requestKey}\ncharge`, 'base64url'))).state).toBe('absent')
    await app.close()
  })
})
