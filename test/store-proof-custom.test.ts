/**
 * The start-up proof as the plugin runs it for any store (engine/store-proof.ts,
 * http/store-check.ts): a store's `prove` is told whether a route waits, its failure is one line,
 * its warnings are logged and published; a store with only `ready` is asked that; a proof that
 * throws, or never answers and ignores its signal, fails the start in time; one store shared by two
 * registrations is proven once, and again at the next start after a failure. And the helpers the
 * stores' proofs share (storage/proof.ts), and the probe key no listing shows (storage/redis/keys.ts).
 */
import diagnostics from 'node:diagnostics_channel'
import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import fp from 'fastify-plugin'
import idempotency, { MemoryStorage, type IdempotencyOptions, type IdempotencyStoreCheckEvent, type StoreCheck, type StoreProofOptions } from '../lib/index.js'
import { proveStore } from '../lib/engine/store-proof.js'
import { beforeAbort, driverReason, proofFailure, ProofAbortedError } from '../lib/storage/proof.js'
import { redisKeyOf, storageKeyOf } from '../lib/storage/redis/keys.js'
import { untilReady } from '../lib/storage/redis/driver.js'
import { EventEmitter } from 'node:events'
import { readyError, startError } from './helpers/start-error.js'

/** A MemoryStorage that proves itself as `prove` says, and records what it was asked. */
function proving (prove: (options: StoreProofOptions) => Promise<StoreCheck[]>): MemoryStorage & { asked: StoreProofOptions[] } {
  const asked: StoreProofOptions[] = []
  return Object.assign(new MemoryStorage(), { asked, prove: async (options: StoreProofOptions) => { asked.push(options); return await prove(options) } })
}

const passedCheck: StoreCheck = { name: 'one', outcome: 'passed', found: 'fine' }

describe('the start-up proof, for any store', () => {
  it('is told whether a route waits for keys in flight', async () => {
    const plain = proving(async () => [passedCheck])
    expect(await startError(plain)).toBeNull()
    const waiting = proving(async () => [passedCheck])
    const app = Fastify()
    await app.register(idempotency, { storage: waiting })
    app.post('/orders', { config: { idempotency: { wait: true } } }, async () => ({ ok: true }))
    await app.ready()
    await app.close()
    expect([plain.asked.map((options) => options.wait), waiting.asked.map((options) => options.wait)]).toEqual([[false], [true]])
  })

  it('fails the start with the first failure and how many more; logs each warning and publishes every check', async () => {
    const events: IdempotencyStoreCheckEvent[] = []
    const listen = (event: unknown): void => { events.push(event as IdempotencyStoreCheckEvent) }
    diagnostics.subscribe('fastify-idempotency:store-check', listen)
    try {
      const checks: StoreCheck[] = [
        { name: 'a', outcome: 'failed', found: 'a was refused', cure: 'allow a' },
        { name: 'b', outcome: 'failed', found: 'b was refused', cure: 'allow b' },
        { name: 'c', outcome: 'failed', found: 'c was refused', cure: 'allow c' },
        { name: 'd', outcome: 'warning', found: 'd is risky', cure: 'accept d' }
      ]
      expect(await startError(proving(async () => checks))).toBe('fastify-idempotency: the store cannot work: MemoryStorage: a was refused: allow a (and 2 more checks failed: b, c) (checkStore: false starts the app anyway)')
      expect(await startError(proving(async () => checks.slice(1)))).toBe('fastify-idempotency: the store cannot work: MemoryStorage: b was refused: allow b (and 1 more check failed: c) (checkStore: false starts the app anyway)')
      const lines: string[] = []
      const app = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { lines.push(JSON.parse(line).msg) } } } })
      await app.register(idempotency, { storage: proving(async () => [passedCheck, checks[3]!]) })
      await app.ready()
      await app.close()
      expect(lines).toEqual(['fastify-idempotency: MemoryStorage: d is risky: accept d'])
      expect(events.at(-1)).toEqual({ store: 'MemoryStorage', check: 'd', outcome: 'warning', found: 'd is risky', cure: 'accept d', via: 'app' })
    } finally {
      diagnostics.unsubscribe('fastify-idempotency:store-check', listen)
    }
  })

  it('a proof that throws fails the start saying so; one that never answers is given up on in time', async () => {
    expect(await startError(proving(async () => { throw new Error('no table here\nsecond line') }))).toBe("fastify-idempotency: the store cannot work: MemoryStorage: the start-up proof failed: no table here: see the store's documentation of its start-up check (checkStore: false starts the app anyway)")
    const deaf = proving(async () => await new Promise<never>(() => {}))
    const started = Date.now()
    expect(await startError(deaf, { storeTimeout: 100 })).toMatch(/MemoryStorage: the start-up proof failed: the store did not answer within 100 ms/)
    expect(Date.now() - started).toBeLessThan(5000)
    expect(deaf.asked[0]!.signal?.aborted).toBe(true)
  })

  it('a store with only ready() is asked that, told whether a route waits; one with neither is not checked', async () => {
    const asked: Array<Partial<StoreProofOptions> | undefined> = []
    const ready = Object.assign(new MemoryStorage(), { ready: async (options?: Partial<StoreProofOptions>) => { asked.push(options) } })
    expect(await startError(ready)).toBeNull()
    expect(asked).toEqual([{ wait: false }])
    expect(await proveStore(ready, { wait: true, timeout: 1000, via: 'command' })).toEqual({ store: 'MemoryStorage', checks: [{ name: 'ready', outcome: 'passed', found: 'the store says it can work' }], failure: null, warnings: [] })
    expect(await proveStore(new MemoryStorage(), { wait: true, timeout: 1000, via: 'command' })).toEqual({ store: 'MemoryStorage', checks: [], failure: null, warnings: [] })
  })

  it('one store under two registrations is proven once; after a failure, the next start proves it again', async () => {
    let failing = true
    const store = proving(async () => [failing ? { name: 'a', outcome: 'failed', found: 'down', cure: 'start it' } : passedCheck])
    const options: IdempotencyOptions = { storage: store }
    const twice = async (): Promise<string | null> => {
      const app = Fastify()
      await app.register(idempotency, options)
      await app.register(fp(async (child) => { await child.register(idempotency, options) }, { encapsulate: true }))
      return await readyError(app)
    }
    expect(await twice()).toMatch(/MemoryStorage: down: start it/)
    expect(store.asked).toHaveLength(1)
    failing = false
    expect(await twice()).toBeNull()
    expect(store.asked).toHaveLength(2)
  })
})

describe('what the stores\' proofs share', () => {
  it('a step given up on names itself, and its own failure later goes nowhere', async () => {
    const stop = new AbortController()
    stop.abort()
    let fail!: (error: Error) => void
    const late = new Promise<never>((_resolve, reject) => { fail = reject })
    await expect(beforeAbort(late, stop.signal, 'SET')).rejects.toThrow(new ProofAbortedError("SET: no answer before the proof's time was up"))
    fail(new Error('too late'))
    expect(await beforeAbort(Promise.resolve(1), undefined, 'GET')).toBe(1)
    expect(proofFailure('S', [passedCheck])).toBeNull()
  })

  it('a driver\'s reason, without the statement knex puts before it', () => {
    expect(driverReason(new Error('CREATE TABLE IF NOT EXISTS "t" (\n  id int\n) - permission denied for schema public'))).toBe('permission denied for schema public')
    expect(driverReason(new Error('select 1 - relation "t" does not exist'))).toBe('relation "t" does not exist')
    expect(driverReason(new Error('An error was signalled by the server - NOPERM\nmore'))).toBe('An error was signalled by the server - NOPERM')
    expect(driverReason('connect ECONNREFUSED')).toBe('connect ECONNREFUSED')
  })

  it('a Redis client still connecting is waited for until ready, or said to be still connecting (or never connected) when the time is up', async () => {
    const stop = new AbortController()
    const client = new EventEmitter()
    const waiting = untilReady(client, ['ready'], stop.signal, 'ioredis')
    client.emit('error', new Error('connect ECONNREFUSED 127.0.0.1:1'))
    stop.abort()
    await expect(waiting).rejects.toThrow('the ioredis client was still connecting when the time was up (its last error: connect ECONNREFUSED 127.0.0.1:1)')
    expect(client.listenerCount('error') + client.listenerCount('ready')).toBe(0)
    await expect(untilReady(new EventEmitter(), ['ready'], stop.signal, 'node-redis', () => false)).rejects.toThrow('the node-redis client was never connected: call its connect() before the app starts')
    // A client with the older name for removing a listener only.
    const older = new EventEmitter()
    const { on, removeListener } = older
    const bare = { on: on.bind(older), removeListener: removeListener.bind(older) }
    const ready = untilReady(bare, ['ready'], undefined, 'ioredis')
    older.emit('ready')
    await ready
    expect(older.listenerCount('ready')).toBe(0)
  })

  it('a Redis probe key is no idempotency key: listings skip it', () => {
    const open = 'idempotency:{'
    expect(storageKeyOf(open, `${open}%probe:.abc}`)).toBeNull()
    expect(storageKeyOf(open, redisKeyOf(open, '%probe:{x}'))).toBe('%probe:{x}')
  })
})
