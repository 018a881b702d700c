/**
 * `run(key, input, fn)`, the plugin's guarantees for any function, on every store on its real
 * server: through `createIdempotency` (no Fastify) and through `fastify.idempotency.run`.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify from 'fastify'
import idempotency, { IdempotencyFingerprintMismatchError, IdempotencyRequestInProgressError, IdempotencyResultNotRecordedError, IdempotencyStoreUnavailableError } from '../lib/index.js'
import { createIdempotency, runScope, type RunContext, type StandaloneIdempotency, type StandaloneOptions } from '../lib/standalone.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'
import { transactionOf } from '../lib/knex.js'

const cases = await storeCases()
const KEY_1 = Buffer.alloc(32, 7).toString('base64')
const HASH_SECRET = Buffer.alloc(32, 9).toString('base64')
const silent = { debug: () => {}, info: () => {}, warn: () => {}, error: () => {} }

/** A counted function: how often it ran, what it returns. */
function counted<T> (result: (run: number) => T | Promise<T>) {
  const fn = async (): Promise<T> => await result(++fn.runs)
  fn.runs = 0
  return fn
}

for (const store of cases) {
  describe.skipIf(!store.available)(`run() on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    const opened: StandaloneIdempotency[] = []
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => {
      for (const idem of opened) await idem.close()
      await store.cleanup()
    })
    const open = (options: StandaloneOptions = {}): StandaloneIdempotency => {
      const idem = createIdempotency({ storage, logger: silent, ...options })
      opened.push(idem)
      return idem
    }

    it('runs the function once and returns the kept result to every later call with the key and input', async () => {
      const idem = open()
      const key = newKey('job')
      const fn = counted((run) => ({ charged: 42, run }))
      expect(await idem.run(key, { amount: 42 }, fn)).toEqual({ charged: 42, run: 1 })
      expect(await idem.run(key, { amount: 42 }, fn)).toEqual({ charged: 42, run: 1 })
      expect(fn.runs).toBe(1)
    })

    it('keeps results JSON cannot hold exactly (BigInt, Date, Map, Set, undefined, NaN, Buffer, a cycle) and bytes and undefined', async () => {
      const idem = open()
      const rich: Record<string, unknown> = { id: 9007199254740993n, at: new Date('2026-01-02T03:04:05.678Z'), tags: new Set(['a']), map: new Map([[1, { x: 1 }]]), none: undefined, nan: NaN, pdf: Buffer.from('%PDF') }
      rich.self = rich
      for (const value of [rich, Buffer.from([0, 1, 2, 255]), undefined, 'text', 0, null, [1, 'two']]) {
        const key = newKey('value')
        const fn = counted(() => value)
        await idem.run(key, { of: 'value' }, fn)
        const replayed = await idem.run(key, { of: 'value' }, fn)
        expect(fn.runs).toBe(1)
        expect(replayed).toEqual(value)
        if (value === rich) {
          const back = replayed as typeof rich
          expect(back.self).toBe(back)
          expect(Buffer.isBuffer(back.pdf)).toBe(true)
          expect('none' in back).toBe(true)
        }
        if (Buffer.isBuffer(value)) expect(Buffer.isBuffer(replayed)).toBe(true)
      }
    })

    it('treats inputs with the same data, members in any order, as one operation, and refuses another input under the key', async () => {
      const idem = open()
      const key = newKey('input')
      const fn = counted(() => 'done')
      await idem.run(key, { a: 1, b: [1, 2] }, fn)
      expect(await idem.run(key, { b: [1, 2], a: 1 }, fn)).toBe('done')
      await expect(idem.run(key, { a: 2, b: [1, 2] }, fn)).rejects.toBeInstanceOf(IdempotencyFingerprintMismatchError)
      await expect(idem.run(key, Buffer.from('a'), fn)).rejects.toBeInstanceOf(IdempotencyFingerprintMismatchError)
      expect(fn.runs).toBe(1)
    })

    it('refuses a duplicate while the first runs, or with wait, gives it the first one\'s result', async () => {
      const idem = open()
      const waiting = open({ wait: true, waitTimeout: '10s' })
      const key = newKey('dup')
      const gate = new Gate()
      const fn = counted(async () => { await gate.hold(); return 'first' })
      const first = idem.run(key, 1, fn)
      await gate.entered
      await expect(idem.run(key, 1, fn)).rejects.toBeInstanceOf(IdempotencyRequestInProgressError)
      const waiters = [waiting.run(key, 1, fn), waiting.run(key, 1, fn)]
      gate.open()
      expect(await Promise.all([first, ...waiters])).toEqual(['first', 'first', 'first'])
      expect(fn.runs).toBe(1)
    })

    it('keeps nothing when the function throws: the next call runs it again', async () => {
      const idem = open()
      const key = newKey('throws')
      const fn = counted((run) => { if (run === 1) throw new Error('broker down'); return 'ok' })
      await expect(idem.run(key, {}, fn)).rejects.toThrow('broker down')
      expect(await idem.run(key, {}, fn)).toBe('ok')
      expect(fn.runs).toBe(2)
    })

    it('a result that cannot be kept is recorded as lost: the call that ran the function returns it, later calls are refused, and it never runs again', async () => {
      const idem = open({ maxResponseBytes: 64 })
      class Charge { constructor (readonly id: string) {} }
      for (const [label, value] of [['an instance of a class', new Charge('ch_1')], ['too large', 'x'.repeat(100)]] as const) {
        const key = newKey('lost')
        const fn = counted(() => value)
        expect(await idem.run(key, {}, fn), label).toBe(value)
        for (const attempt of [1, 2]) {
          const later = await idem.run(key, {}, fn).catch((error: unknown) => error)
          expect(later, `${label}, later call ${attempt}`).toBeInstanceOf(IdempotencyResultNotRecordedError)
          expect((later as IdempotencyResultNotRecordedError).statusCode).toBe(409)
          expect((later as IdempotencyResultNotRecordedError).reason).toMatch(label === 'too large' ? /maxResponseBytes \(64\)/ : /cannot be kept/)
        }
        expect(fn.runs, label).toBe(1)
      }
    })

    it('keeps a result the caller\'s own codec writes', async () => {
      const idem = open()
      class Money { constructor (readonly cents: bigint, readonly currency: string) {} }
      const codec = { serialize: (m: Money) => `${m.cents} ${m.currency}`, deserialize: (data: Buffer) => { const [cents, currency] = data.toString().split(' '); return new Money(BigInt(cents!), currency!) } }
      const key = newKey('codec')
      const fn = counted(() => new Money(1999n, 'EUR'))
      await idem.run(key, {}, fn, { codec })
      const back = await idem.run(key, {}, fn, { codec })
      expect(back).toBeInstanceOf(Money)
      expect(back).toEqual(new Money(1999n, 'EUR'))
      expect(fn.runs).toBe(1)
    })

    it('keeps a recovery point\'s result with the codec given to context.step, and tells a duplicate in flight when to come back in ms', async () => {
      const idem = open()
      class Card { constructor (readonly last4: string) {} }
      const codec = { serialize: (card: Card) => card.last4, deserialize: (data: Buffer) => new Card(data.toString()) }
      const key = newKey('step-codec')
      let tokenized = 0
      let runs = 0
      const fn = async ({ step }: RunContext) => {
        const card = await step('tokenize', () => { tokenized++; return new Card('4242') }, codec)
        if (++runs === 1) throw new Error('after tokenizing')
        return { card: card instanceof Card ? card.last4 : 'not a Card' }
      }
      await expect(idem.run(key, {}, fn)).rejects.toThrow('after tokenizing')
      expect(await idem.run(key, {}, fn)).toEqual({ card: '4242' })
      expect(tokenized).toBe(1)
      const gate = new Gate()
      const held = newKey('retry-ms')
      const first = idem.run(held, {}, async () => { await gate.hold(); return 1 })
      await gate.entered
      const refused = await idem.run(held, {}, () => 2).catch((error: unknown) => error) as IdempotencyRequestInProgressError
      expect(refused).toBeInstanceOf(IdempotencyRequestInProgressError)
      expect(refused.retryAfterMs).toBeGreaterThanOrEqual(100)
      expect(refused.retryAfter).toBe(Math.max(1, Math.ceil(refused.retryAfterMs / 1000)))
      gate.open()
      await first
    })

    it('keeps scopes apart: one key in two scopes is two operations', async () => {
      const idem = open()
      const key = newKey('scoped')
      const fn = counted((run) => run)
      expect(await idem.run(key, {}, fn, { scope: 'tenant-a' })).toBe(1)
      expect(await idem.run(key, {}, fn, { scope: 'tenant-b' })).toBe(2)
      expect(await idem.run(key, {}, fn)).toBe(3)
      expect(await idem.run(key, {}, fn, { scope: 'tenant-a' })).toBe(1)
    })

    it('forgets a result once it expires, and runs the function again', async () => {
      const idem = open()
      const key = newKey('expiry')
      const fn = counted((run) => run)
      expect(await idem.run(key, {}, fn, { expiration: 300 })).toBe(1)
      expect(await idem.run(key, {}, fn, { expiration: 300 })).toBe(1)
      await sleep(700)
      expect(await idem.run(key, {}, fn, { expiration: 300 })).toBe(2)
    })

    it('keeps the recovery points of a run that failed: the next run replays them and goes on', async () => {
      const idem = open()
      const key = newKey('steps')
      let charges = 0
      let runs = 0
      const fn = async ({ step }: RunContext) => {
        const charge = await step('charge', () => ({ id: `ch_${++charges}` }))
        if (++runs === 1) throw new Error('crashed after the charge')
        return { charge }
      }
      await expect(idem.run(key, { order: 7 }, fn)).rejects.toThrow('crashed after the charge')
      expect(await idem.run(key, { order: 7 }, fn)).toEqual({ charge: { id: 'ch_1' } })
      expect(charges).toBe(1)
      expect(runs).toBe(2)
    })

    it('with encryption, keeps nothing readable in the store and reads its results back', async () => {
      const idem = open({ encryption: { keys: [KEY_1], keyHashSecret: HASH_SECRET } })
      const key = newKey('sealed')
      const fn = counted(() => ({ secret: 'sk_live_never_in_clear' }))
      await idem.run(key, { card: '4242' }, fn)
      expect(await idem.run(key, { card: '4242' }, fn)).toEqual({ secret: 'sk_live_never_in_clear' })
      expect(fn.runs).toBe(1)
      const dump = await store.dump?.() ?? ''
      expect(dump).not.toContain('sk_live_never_in_clear')
      expect(dump).not.toContain(key)
    })

    it('is seen and forgotten by the operations, in the namespace of run with its scope', async () => {
      const idem = open()
      const key = newKey('ops')
      const fn = counted((run) => run)
      await idem.run(key, {}, fn, { scope: 'queue:orders' })
      expect((await idem.inspect(key, { scope: runScope('queue:orders') })).state).toBe('stored')
      expect((await idem.inspect(key, { scope: 'queue:orders' })).state).toBe('absent')
      expect((await idem.inspect(key)).state).toBe('absent')
      expect((await idem.forget(key, { scope: 'run():queue:orders' })).outcome).toBe('forgotten')
      expect(await idem.run(key, {}, fn, { scope: 'queue:orders' })).toBe(2)
    })

    it.skipIf(store.knex === undefined || store.name === 'sqlite')('in transaction mode, commits the function\'s writes with its result, and rolls them back when it throws', async () => {
      const knex = store.knex!()
      const table = `run_effects_${process.pid}_${Date.now()}`
      await knex.schema.createTable(table, (t) => { t.string('ref', 100) })
      try {
        const idem = open({ transaction: true })
        const write = (ref: string, fail: boolean) => async (context: RunContext) => {
          await transactionOf(context)(table).insert({ ref })
          if (fail) throw new Error('after the write')
          return ref
        }
        const kept = newKey('tx')
        expect(await idem.run(kept, {}, write('kept', false))).toBe('kept')
        expect(await idem.run(kept, {}, write('kept-again', false))).toBe('kept')
        await expect(idem.run(newKey('tx'), {}, write('rolled-back', true))).rejects.toThrow('after the write')
        expect((await knex(table).select('ref')).map((row: { ref: string }) => row.ref)).toEqual(['kept'])
      } finally {
        await knex.schema.dropTable(table)
      }
    })
  })
}

describe('run() through the plugin', () => {
  it('runs on the registration\'s store, and app.close() waits for a run in flight to keep its result', async () => {
    const storage = new MemoryStorage()
    const app = Fastify()
    await app.register(idempotency, { storage })
    await app.ready()
    const gate = new Gate()
    const key = newKey('app')
    const running = app.idempotency.run(key, { id: 1 }, async () => { await gate.hold(); return 'kept' })
    await gate.entered
    const closed = app.close()
    gate.open()
    expect(await running).toBe('kept')
    await closed
    const after = createIdempotency({ storage, logger: silent })
    expect(await after.run(key, { id: 1 }, () => 'ran again')).toBe('kept')
    await after.close()
  })

  it('fails closed when the store is down (or runs the function unprotected with failOpen)', async () => {
    const down: IdempotencyStorage = {
      begin: async () => { throw new Error('connection refused') },
      complete: async () => false,
      release: async () => false,
      renew: async () => false
    }
    const closed = createIdempotency({ storage: down, logger: silent })
    const fn = counted(() => 'ran')
    await expect(closed.run(newKey(), {}, fn)).rejects.toBeInstanceOf(IdempotencyStoreUnavailableError)
    expect(fn.runs).toBe(0)
    const open = createIdempotency({ storage: down, logger: silent, failOpen: true })
    expect(await open.run(newKey(), {}, fn)).toBe('ran')
    await Promise.all([closed.close(), open.close()])
  })

  it('refuses a key that is not 1 to maxKeyLength printable ASCII characters, and a scope that is not a string', async () => {
    const idem = createIdempotency({ logger: silent, maxKeyLength: 8 })
    for (const key of ['', 'x'.repeat(9), 'tab\there', 'é']) await expect(idem.run(key, {}, () => 1)).rejects.toThrow(/printable ASCII/)
    await expect(idem.run('ok', {}, () => 1, { scope: 42 as unknown as string })).rejects.toThrow(/scope/)
    await idem.close()
  })
})
