/**
 * Transaction mode as the plugin drives it, with a transactional storage that records what it is
 * asked (the real one, KnexStorage on each database, is in transaction.test.ts).
 */
import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyOptions, type StorageTransaction, type StoredResponse, type TransactionalStorage } from '../lib/index.js'
import { transactionOf } from '../lib/knex.js'
import { newKey } from './helpers/app.js'

type Failure = 'none' | 'commit' | 'lease'

function recording (failure: () => Failure) {
  const log: string[] = []
  const inner = new MemoryStorage()
  const storage: TransactionalStorage = {
    begin: (k, f, l) => inner.begin(k, f, l),
    complete: (k, t, r, e) => inner.complete(k, t, r, e),
    release: async (k, t) => { log.push('release'); return inner.release(k, t) },
    renew: (k, t, l) => inner.renew(k, t, l),
    transaction: async (): Promise<StorageTransaction> => {
      log.push('open')
      let pending: [string, string, StoredResponse, number] | null = null
      return {
        handle: { writes: log },
        complete: async (k, t, r, e) => {
          log.push('complete')
          if (failure() === 'lease') return false
          pending = [k, t, r, e]
          return true
        },
        commit: async () => {
          if (failure() === 'commit') throw new Error('serialization failure')
          log.push('commit')
          if (pending !== null) await inner.complete(...pending)
        },
        rollback: async () => { log.push('rollback') }
      }
    }
  }
  return { storage, log }
}

async function appWith (storage: TransactionalStorage, options: IdempotencyOptions = {}) {
  const app = Fastify()
  await app.register(idempotency, { storage, transaction: true, maxResponseBytes: 100, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
    const handle = request.idempotency!.transaction as { writes: string[] }
    handle.writes.push('write')
    const mode = (request.body as { mode?: string }).mode
    if (mode === 'throw') throw new Error('handler failed')
    if (mode === '400') { reply.code(400); return { bad: true } }
    if (mode === 'big') return 'x'.repeat(500)
    reply.code(201)
    return { id: 1 }
  })
  await app.ready()
  return (key: string, mode?: string) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { mode } })
}

describe('transaction mode (plugin side)', () => {
  it('commits the handler\'s writes with the stored response, and replays without a transaction', async () => {
    const { storage, log } = recording(() => 'none')
    const send = await appWith(storage)
    const key = newKey()
    expect((await send(key)).statusCode).toBe(201)
    expect(log).toEqual(['open', 'write', 'complete', 'commit'])
    const replay = await send(key)
    expect(replay.headers['idempotent-replayed']).toBe('true')
    expect(log).toEqual(['open', 'write', 'complete', 'commit'])
  })

  for (const [mode, status] of [['throw', 500], ['400', 400]] as const) {
    it(`rolls back and frees the key when the handler answers ${status}`, async () => {
      const { storage, log } = recording(() => 'none')
      const send = await appWith(storage)
      const key = newKey()
      expect((await send(key, mode)).statusCode).toBe(status)
      expect(log).toEqual(['open', 'write', 'rollback', 'release'])
      expect((await send(key)).statusCode).toBe(201)
    })
  }

  for (const failure of ['commit', 'lease'] as const) {
    it(`answers 503 problem+json, never the success, when ${failure === 'commit' ? 'the commit fails' : 'the lease was lost'}`, async () => {
      let mode: Failure = failure
      const { storage, log } = recording(() => mode)
      const send = await appWith(storage)
      const key = newKey()
      const res = await send(key)
      expect(res.statusCode).toBe(503)
      expect(res.json().type).toMatch(/#store-unavailable$/)
      expect(log).toContain('rollback')
      expect(log.at(-1)).toBe('release')
      mode = 'none'
      expect((await send(key)).statusCode).toBe(201)
    })
  }

  it('commits the writes of a success too large to store with its outcome, and sends it', async () => {
    const { storage, log } = recording(() => 'none')
    const send = await appWith(storage)
    const res = await send(newKey(), 'big')
    expect(res.statusCode).toBe(200)
    expect(log).toEqual(['open', 'write', 'complete', 'commit'])
  })

  it("with unstorableResponse: 'release', refuses to send a success it cannot store (too large), rolling back", async () => {
    const { storage, log } = recording(() => 'none')
    const send = await appWith(storage, { unstorableResponse: 'release' })
    const res = await send(newKey(), 'big')
    expect(res.statusCode).toBe(503)
    expect(log).toEqual(['open', 'write', 'rollback', 'release'])
  })

  it('exposes the key (and no transaction) on request.idempotency outside transaction mode', async () => {
    const app = Fastify()
    await app.register(idempotency)
    app.post('/o', { config: { idempotency: true } }, async (request) => ({ context: request.idempotency }))
    app.post('/plain', async (request) => ({ context: request.idempotency }))
    const res = await app.inject({ method: 'POST', url: '/o', headers: { 'idempotency-key': 'k-1' }, payload: {} })
    expect(res.json()).toEqual({ context: { key: 'k-1' } })
    expect((await app.inject({ method: 'POST', url: '/plain', payload: {} })).json()).toEqual({ context: null })
  })

  it('transactionOf(request) names the problem when the route is not in transaction mode', async () => {
    const app = Fastify()
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler({ fallback (error, _request, reply) { reply.code(500).send({ message: error.message }) } }))
    app.post('/o', { config: { idempotency: true } }, async (request) => ({ trx: transactionOf(request) !== undefined }))
    const res = await app.inject({ method: 'POST', url: '/o', headers: { 'idempotency-key': 'k-2' }, payload: {} })
    expect(res.statusCode).toBe(500)
    expect(res.json().message).toMatch(/there is no transaction here \(is it in transaction mode/)
  })

  it('refuses transaction mode on a storage without transactions, at start-up', async () => {
    const app = Fastify()
    await expect(app.register(idempotency, { transaction: true })).rejects.toThrow(/transaction mode needs a storage that supports transactions \(KnexStorage\), not MemoryStorage/)
  })
})

describe('a handler whose transaction conflicted with another', () => {
  /** What the store says a conflict is: here, an error with this code, as a driver's. */
  const conflict = (): Error => Object.assign(new Error('could not serialize access due to concurrent update'), { code: 'conflict' })

  async function conflicting (errorHandler: 'problem' | 'fastify' | 'own') {
    const { storage, log } = recording(() => 'none')
    storage.isConflict = (error) => (error as { code?: unknown }).code === 'conflict'
    const app = Fastify()
    await app.register(idempotency, { storage, transaction: true })
    if (errorHandler === 'problem') app.setErrorHandler(idempotencyErrorHandler())
    if (errorHandler === 'own') app.setErrorHandler((error: Error, _request, reply) => reply.send({ mine: error.message }))
    let runs = 0
    app.post('/transfers', { config: { idempotency: true } }, async (request) => {
      runs++
      const { fail } = request.body as { fail?: 'conflict' | 'wrapped' | 'other' }
      if (fail === 'conflict') throw conflict()
      if (fail === 'wrapped') throw new Error('the transfer failed', { cause: conflict() })
      if (fail === 'other') throw new Error('the handler failed')
      return { ok: true }
    })
    const send = (key: string, fail?: string) => app.inject({ method: 'POST', url: '/transfers', headers: { 'idempotency-key': key }, payload: { fail } })
    return { send, log, runs: () => runs }
  }

  it('is answered 503 #store-unavailable with Retry-After by idempotencyErrorHandler, rolled back, and its key free', async () => {
    const { send, log, runs } = await conflicting('problem')
    const key = newKey('conflict')
    const refused = await send(key, 'conflict')
    expect(refused.statusCode).toBe(503)
    expect(refused.headers['content-type']).toMatch(/^application\/problem\+json/)
    expect(refused.json()).toMatchObject({ type: expect.stringMatching(/#store-unavailable$/), status: 503, idempotencyKey: key })
    expect(refused.headers['retry-after']).toBe('1')
    expect(log).toContain('rollback')
    expect((await send(key)).statusCode).toBe(200)
    expect(runs()).toBe(2)
  })

  it('is told apart through a cause, and any other failure of the handler stays its own (500)', async () => {
    const { send } = await conflicting('problem')
    expect((await send(newKey('conflict'), 'wrapped')).statusCode).toBe(503)
    const other = await send(newKey('conflict'), 'other')
    expect(other.statusCode).toBe(500)
    expect(other.headers['retry-after']).toBeUndefined()
  })

  it('keeps the 503 and its Retry-After with Fastify\'s own error handler, and with one of the app\'s that sets no status', async () => {
    for (const handler of ['fastify', 'own'] as const) {
      const { send } = await conflicting(handler)
      const refused = await send(newKey('conflict'), 'conflict')
      expect({ handler, status: refused.statusCode, retryAfter: refused.headers['retry-after'] }).toEqual({ handler, status: 503, retryAfter: '1' })
    }
  })
})
