/**
 * The engine on its own, without Fastify: a route engine over MemoryStorage (or a store that fails,
 * hangs or loses leases on demand), driven the way the HTTP adapter drives it. What it decides
 * (run, replay, refuse, run unprotected; store, give back, retry in the background) and the phases
 * it moves a request through (lib/engine/request-state.ts).
 */
import diagnostics from 'node:diagnostics_channel'
import { afterEach, describe, expect, it } from 'vitest'
import { acquire, type Acquisition } from '../lib/engine/acquire.js'
import { InFlight } from '../lib/engine/in-flight.js'
import { PHASE_MOVES, RequestState, type Phase } from '../lib/engine/request-state.js'
import type { ResponseCallbacks } from '../lib/engine/route-callbacks.js'
import { createRouteEngine, type RouteEngine } from '../lib/engine/route-engine.js'
import { settle, type Ending } from '../lib/engine/settle.js'
import { runStep } from '../lib/engine/steps.js'
import {
  IdempotencyFingerprintMismatchError,
  IdempotencyRequestInProgressError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError
} from '../lib/errors.js'
import type { IdempotencyEvent } from '../lib/diagnostics.js'
import { normalizeOptions, type RouteSettings } from '../lib/options.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import type { IdempotencyStorage, StorageTransaction, StoredResponse, TransactionalStorage } from '../lib/storage/types.js'

type Level = 'debug' | 'warn' | 'error'

/** A logger that keeps what it is told. */
function recordingLog () {
  const lines: Array<{ level: Level, message: string }> = []
  const at = (level: Level) => (_object: object, message: string) => { lines.push({ level, message }) }
  return { lines, log: { debug: at('debug'), warn: at('warn'), error: at('error') } }
}

/** A route engine over `storage` with the default route settings, and `overrides`. */
function engineOver (storage: IdempotencyStorage, overrides: Partial<RouteSettings> = {}, inFlight = new InFlight()): RouteEngine {
  const settings = { ...normalizeOptions({}, storage).defaults, ...overrides }
  return createRouteEngine(storage, settings, '/orders', null, inFlight)
}

let keys = 0
function request (key = `key-${++keys}`, callbacks?: ResponseCallbacks) {
  const { lines, log } = recordingLog()
  return { state: new RequestState(key, 'POST', log, callbacks), lines }
}

const answer = (body: string, statusCode = 201): StoredResponse => ({ statusCode, contentType: 'application/json', headers: { 'x-order': '1' }, body: Buffer.from(body) })

/** `acquire` under the key as its own storage key, with fingerprint `fingerprint`. */
async function ask (engine: RouteEngine, state: RequestState, fingerprint = 'fp'): Promise<Acquisition> {
  return await acquire(engine, state, state.key, fingerprint)
}

/** What the adapter does once the response is known. */
async function end (engine: RouteEngine, state: RequestState, ending: Ending) {
  state.startSettling()
  return await settle(engine, state, ending)
}

/** Events published while the test runs. */
const events: IdempotencyEvent[] = []
const listen = (message: unknown): void => { events.push(message as IdempotencyEvent) }
const outcomes = ['execute', 'replay', 'mismatch', 'in-progress', 'lease-lost', 'store-error'] as const
for (const outcome of outcomes) diagnostics.subscribe(`fastify-idempotency:${outcome}`, listen)
afterEach(() => { events.length = 0 })

type Method = 'begin' | 'complete' | 'release' | 'renew'

/** A MemoryStorage whose chosen methods fail (`down`) or never answer (`hung`). */
function faulty () {
  const inner = new MemoryStorage()
  const down = new Set<Method>()
  const hung = new Set<Method>()
  const calls: Method[] = []
  const guard = <T>(method: Method, call: () => Promise<T>): Promise<T> => {
    calls.push(method)
    if (hung.has(method)) return new Promise<T>(() => {})
    return down.has(method) ? Promise.reject(new Error(`connect ECONNREFUSED (${method})`)) : call()
  }
  const storage: IdempotencyStorage = {
    begin: (k, f, l) => guard('begin', () => inner.begin(k, f, l)),
    complete: (k, t, r, e) => guard('complete', () => inner.complete(k, t, r, e)),
    release: (k, t) => guard('release', () => inner.release(k, t)),
    renew: (k, t, l) => guard('renew', () => inner.renew(k, t, l)),
    inspect: (k) => inner.inspect(k)
  }
  return { storage, inner, down, hung, calls }
}

/** A MemoryStorage with transactions: what a transaction completes is kept once it commits. */
function transactional (options: { open?: () => Promise<void>, complete?: boolean } = {}) {
  const inner = new MemoryStorage()
  const log: string[] = []
  const storage: TransactionalStorage = {
    begin: (k, f, l) => inner.begin(k, f, l),
    complete: (k, t, r, e) => inner.complete(k, t, r, e),
    release: (k, t) => inner.release(k, t),
    renew: (k, t, l) => inner.renew(k, t, l),
    inspect: (k) => inner.inspect(k),
    async transaction (): Promise<StorageTransaction> {
      await options.open?.()
      let pending: (() => Promise<boolean>) | null = null
      return {
        handle: { writes: log },
        complete: async (k, t, r, e) => {
          if (options.complete === false) return false
          pending = () => inner.complete(k, t, r, e)
          return true
        },
        commit: async () => { log.push('commit'); await pending?.() },
        rollback: async () => { log.push('rollback') }
      }
    }
  }
  return { storage, inner, log }
}

describe('acquire', () => {
  it('runs a new key: the lease is held and renewed, and the request is in flight', async () => {
    const storage = new MemoryStorage()
    const engine = engineOver(storage)
    const { state } = request()
    expect(state.phase).toBe('keyed')
    expect(await ask(engine, state)).toEqual({ outcome: 'run' })
    expect(state.phase).toBe('running')
    expect(state.token).not.toBe('')
    expect(state.renewing).toBe(true)
    expect(engine.inFlight.size).toBe(1)
    expect((await storage.inspect(state.key)).state).toBe('in-flight')
    await end(engine, state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
  })

  it('replays a stored response, opened as stored, and leaves nothing in flight', async () => {
    const engine = engineOver(new MemoryStorage())
    const first = request()
    await ask(engine, first.state)
    await end(engine, first.state, { kind: 'store', statusCode: 201, response: answer('{"id":1}') })
    const retry = request(first.state.key)
    const acquisition = await ask(engine, retry.state)
    expect(acquisition.outcome).toBe('replay')
    expect(acquisition.outcome === 'replay' && acquisition.response.body.toString()).toBe('{"id":1}')
    expect(retry.state.phase).toBe('replayed')
    expect(retry.state.replayed?.headers).toEqual({ 'x-order': '1' })
    expect(engine.inFlight.size).toBe(0)
    expect(events.map((event) => event.outcome)).toEqual(['execute', 'replay'])
  })

  it('refuses a duplicate of a request in flight with 409 and a Retry-After', async () => {
    const engine = engineOver(new MemoryStorage())
    const first = request()
    await ask(engine, first.state)
    const duplicate = request(first.state.key)
    const acquisition = await ask(engine, duplicate.state)
    expect(acquisition.outcome).toBe('refuse')
    const error = (acquisition as Extract<Acquisition, { outcome: 'refuse' }>).error
    expect(error).toBeInstanceOf(IdempotencyRequestInProgressError)
    expect(error.statusCode).toBe(409)
    expect(Number(error.headers['retry-after'])).toBeGreaterThanOrEqual(1)
    expect(duplicate.state.phase).toBe('refused')
    expect(duplicate.lines).toEqual([{ level: 'debug', message: 'idempotency key in progress' }])
    // The refused duplicate is not in flight; the first still is.
    expect(engine.inFlight.size).toBe(1)
    await end(engine, first.state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
  })

  it('refuses a different request under the same key, unless the comparison finds it the same', async () => {
    const engine = engineOver(new MemoryStorage(), { mismatchStatusCode: 422 })
    const first = request()
    await ask(engine, first.state, 'fp-a')
    await end(engine, first.state, { kind: 'store', statusCode: 201, response: answer('{}') })

    const other = request(first.state.key)
    const refused = await ask(engine, other.state, 'fp-b')
    expect(refused.outcome).toBe('refuse')
    const error = (refused as Extract<Acquisition, { outcome: 'refuse' }>).error
    expect(error).toBeInstanceOf(IdempotencyFingerprintMismatchError)
    expect(error.statusCode).toBe(422)
    expect(other.state.phase).toBe('refused')

    // The same request fingerprinted under other options: the comparison says so, and it replays.
    const compared: string[] = []
    const same = request(first.state.key)
    const acquisition = await acquire(engine, same.state, same.state.key, 'fp-b', { compare: (stored) => { compared.push(stored); return 'same' } })
    expect(acquisition.outcome).toBe('replay')
    expect(compared).toEqual(['fp-a'])
  })

  it('with failOpen, runs unprotected when the store is down: no lease, not in flight, a warning', async () => {
    const { storage, down } = faulty()
    down.add('begin')
    const engine = engineOver(storage, { failOpen: true })
    const { state, lines } = request()
    expect(await ask(engine, state)).toEqual({ outcome: 'unprotected' })
    expect(state.phase).toBe('unprotected')
    expect(state.token).toBe('')
    expect(engine.inFlight.size).toBe(0)
    expect(lines).toEqual([{ level: 'warn', message: 'idempotency store unavailable: running the handler without protection (failOpen)' }])
    expect(events).toMatchObject([{ outcome: 'store-error', phase: 'begin', failOpen: true }])
  })

  it('without failOpen, refuses with 503 when the store is down', async () => {
    const { storage, down } = faulty()
    down.add('begin')
    const engine = engineOver(storage)
    const { state, lines } = request()
    const acquisition = await ask(engine, state)
    expect(acquisition.outcome).toBe('refuse')
    const error = (acquisition as Extract<Acquisition, { outcome: 'refuse' }>).error
    expect(error).toBeInstanceOf(IdempotencyStoreUnavailableError)
    expect(error.statusCode).toBe(503)
    expect(state.phase).toBe('refused')
    expect(lines).toEqual([{ level: 'error', message: 'idempotency store unavailable: answering 503' }])
  })

  it('refuses with 503 when the store does not answer within storeTimeout', async () => {
    const { storage, hung } = faulty()
    hung.add('begin')
    const engine = engineOver(storage, { storeTimeout: 40 })
    const { state } = request()
    const started = Date.now()
    const acquisition = await ask(engine, state)
    engine.door.stop()
    expect(acquisition.outcome).toBe('refuse')
    expect((acquisition as Extract<Acquisition, { outcome: 'refuse' }>).error).toBeInstanceOf(IdempotencyStoreUnavailableError)
    expect(Date.now() - started).toBeGreaterThanOrEqual(35)
    expect(state.phase).toBe('refused')
  })

  it('refuses a request once the app is closing, without asking the store', async () => {
    const { storage, calls } = faulty()
    const engine = engineOver(storage)
    await engine.inFlight.drain(10)
    const { state } = request()
    const acquisition = await ask(engine, state)
    expect(acquisition.outcome).toBe('refuse')
    expect((acquisition as Extract<Acquisition, { outcome: 'refuse' }>).error).toBeInstanceOf(IdempotencyServerClosingError)
    expect(state.phase).toBe('refused')
    expect(calls).toEqual([])
    expect(engine.inFlight.size).toBe(0)
  })

  it('transaction mode: a transaction that cannot be opened gives the lease back and refuses with 503', async () => {
    const { storage, inner } = transactional({ open: async () => { throw new Error('pool exhausted') } })
    const engine = engineOver(storage, { transaction: {} })
    const { state, lines } = request()
    const acquisition = await ask(engine, state)
    expect(acquisition.outcome).toBe('refuse')
    expect((acquisition as Extract<Acquisition, { outcome: 'refuse' }>).error).toBeInstanceOf(IdempotencyStoreUnavailableError)
    expect(state.phase).toBe('refused')
    expect(state.renewing).toBe(false)
    expect((await inner.inspect(state.key)).state).toBe('absent')
    expect(lines).toEqual([{ level: 'error', message: 'idempotency transaction could not be opened: answering 503' }])
  })
})

describe('settle', () => {
  it('stores the response: a retry replays it, and the request has ended', async () => {
    const engine = engineOver(new MemoryStorage())
    const { state } = request()
    await ask(engine, state)
    const settlement = await end(engine, state, { kind: 'store', statusCode: 201, response: answer('{"id":7}') })
    expect(settlement).toEqual({ stored: true, deliverable: true })
    expect(state.phase).toBe('ended')
    expect(state.renewing).toBe(false)
    expect(engine.inFlight.size).toBe(0)
    expect(events).toMatchObject([{ outcome: 'execute', statusCode: 201, stored: true }])
    const retry = request(state.key)
    expect((await ask(engine, retry.state)).outcome).toBe('replay')
  })

  it('gives the key back for its reason: a retry runs again', async () => {
    const engine = engineOver(new MemoryStorage())
    const { state } = request()
    await ask(engine, state)
    const settlement = await end(engine, state, { kind: 'give-back', statusCode: 400, reason: 'not-cacheable' })
    expect(settlement).toEqual({ stored: false, reason: 'not-cacheable', deliverable: true })
    expect(state.phase).toBe('ended')
    expect(events).toMatchObject([{ outcome: 'execute', statusCode: 400, stored: false, reason: 'not-cacheable' }])
    expect((await ask(engine, request(state.key).state)).outcome).toBe('run')
  })

  it('gives the key back when the route\'s storeIf declines, which sees a copy of the answer', async () => {
    const engine = engineOver(new MemoryStorage())
    const seen: StoredResponse[] = []
    const { state } = request(undefined, { storeIf: (response) => { seen.push(response); response.body.write('X'); return false }, redact: null })
    await ask(engine, state)
    const response = answer('{"id":1}')
    const settlement = await end(engine, state, { kind: 'store', statusCode: 201, response })
    expect(settlement).toEqual({ stored: false, reason: 'declined', deliverable: true })
    expect(seen).toHaveLength(1)
    expect(response.body.toString()).toBe('{"id":1}')
    expect((await ask(engine, request(state.key).state)).outcome).toBe('run')
  })

  it('stores what the route\'s redact keeps, with the status of the answer', async () => {
    const storage = new MemoryStorage()
    const engine = engineOver(storage)
    const redact = (response: StoredResponse): StoredResponse => ({ ...response, statusCode: 299, headers: {}, body: Buffer.from('{"card":"****"}') })
    const { state } = request(undefined, { storeIf: null, redact })
    await ask(engine, state)
    await end(engine, state, { kind: 'store', statusCode: 201, response: answer('{"card":"4242"}') })
    const retry = request(state.key)
    const acquisition = await ask(engine, retry.state)
    expect(acquisition.outcome === 'replay' && acquisition.response).toMatchObject({ statusCode: 201, headers: {}, body: Buffer.from('{"card":"****"}') })
  })

  it('says a lost lease: the response is not stored, and a warning is logged', async () => {
    const storage = new MemoryStorage()
    const engine = engineOver(storage)
    const { state, lines } = request()
    await ask(engine, state)
    // The lease lapses and another request takes the key over.
    await storage.release(state.storageKey, state.token)
    const other = request(state.key)
    await ask(engine, other.state)
    const settlement = await end(engine, state, { kind: 'store', statusCode: 201, response: answer('{}') })
    expect(settlement).toEqual({ stored: false, reason: 'lease-lost', deliverable: true })
    expect(state.phase).toBe('ended')
    expect(lines).toEqual([{ level: 'warn', message: 'idempotency lease was lost before the response was stored: this response was not stored' }])
    await end(engine, other.state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
  })

  it('retries storing in the background when the store fails, in flight and renewed until it is stored', async () => {
    const { storage, down } = faulty()
    const engine = engineOver(storage)
    const { state, lines } = request()
    await ask(engine, state)
    down.add('complete')
    const settlement = await end(engine, state, { kind: 'store', statusCode: 201, response: answer('{"id":3}') })
    expect(settlement).toEqual({ stored: false, reason: 'store-error', deliverable: true, retrying: true, background: expect.any(Promise) })
    expect(state.phase).toBe('storing')
    expect(state.renewing).toBe(true)
    expect(engine.inFlight.size).toBe(1)
    expect(lines.map((line) => line.level)).toEqual(['error'])
    // A duplicate meanwhile is refused, not run a second time.
    expect((await ask(engine, request(state.key).state)).outcome).toBe('refuse')
    down.delete('complete')
    await expect.poll(() => state.phase, { timeout: 2000, interval: 10 }).toBe('ended')
    expect(state.renewing).toBe(false)
    expect(engine.inFlight.size).toBe(0)
    expect(events.filter((event) => event.outcome === 'execute')).toMatchObject([{ statusCode: 201, stored: true }])
    expect((await ask(engine, request(state.key).state)).outcome).toBe('replay')
    // What storing in the background came to, for run(), which waits for it.
    expect(await settlement.background).toEqual({ stored: true, deliverable: true })
  })

  it('transaction mode: commits the handler\'s writes with the response', async () => {
    const { storage, log } = transactional()
    const engine = engineOver(storage, { transaction: {} })
    const { state } = request()
    await ask(engine, state)
    expect(state.transaction?.handle).toEqual({ writes: log })
    const settlement = await end(engine, state, { kind: 'store', statusCode: 201, response: answer('{}') })
    expect(settlement).toEqual({ stored: true, deliverable: true })
    expect(log).toEqual(['commit'])
    expect((await ask(engine, request(state.key).state)).outcome).toBe('replay')
  })

  it('transaction mode: a success rolled back must not be delivered; an error rolled back may', async () => {
    const { storage, log } = transactional({ complete: false })
    const engine = engineOver(storage, { transaction: {} })
    const lost = request()
    await ask(engine, lost.state)
    expect(await end(engine, lost.state, { kind: 'store', statusCode: 201, response: answer('{}') })).toEqual({ stored: false, reason: 'lease-lost', deliverable: false })
    const tooLarge = request()
    await ask(engine, tooLarge.state)
    expect(await end(engine, tooLarge.state, { kind: 'give-back', statusCode: 201, reason: 'too-large' })).toEqual({ stored: false, reason: 'too-large', deliverable: false })
    const failed = request()
    await ask(engine, failed.state)
    expect(await end(engine, failed.state, { kind: 'give-back', statusCode: 500, reason: 'failed' })).toEqual({ stored: false, reason: 'failed', deliverable: true })
    expect(log).toEqual(['rollback', 'rollback', 'rollback'])
  })
})

describe('steps', () => {
  it('runs a step once per key: a later run gets its recorded result', async () => {
    const engine = engineOver(new MemoryStorage())
    let calls = 0
    const first = request()
    await ask(engine, first.state)
    const keys: string[] = []
    const charge = async ({ key }: { key: string }) => { keys.push(key); return { id: `ch_${++calls}` } }
    expect(await runStep(engine, first.state, 'charge', charge)).toEqual({ id: 'ch_1' })
    // The first run fails: nothing is stored, the key is given back.
    await end(engine, first.state, { kind: 'give-back', statusCode: 500, reason: 'failed' })

    const second = request(first.state.key)
    expect((await ask(engine, second.state)).outcome).toBe('run')
    expect(await runStep(engine, second.state, 'charge', charge)).toEqual({ id: 'ch_1' })
    expect(calls).toBe(1)
    expect(keys[0]).toMatch(/^idem_[\w-]{43}$/)
    expect([...second.state.steps!]).toEqual(['charge'])
  })

  it('runs a step unrecorded when the handler runs unprotected', async () => {
    const { storage, down, calls } = faulty()
    down.add('begin')
    const engine = engineOver(storage, { failOpen: true })
    const { state } = request()
    await ask(engine, state)
    let runs = 0
    expect(await runStep(engine, state, 'charge', () => ++runs)).toBe(1)
    expect(await runStep(engine, state, 'charge', () => ++runs)).toBe(2)
    expect(calls).toEqual(['begin'])
  })

  it('refuses a step once the response is sent, or after a refusal, and a step without a name', async () => {
    const engine = engineOver(new MemoryStorage())
    const { state } = request()
    await ask(engine, state)
    await expect(runStep(engine, state, '', () => 1)).rejects.toThrow(TypeError)
    state.startSettling()
    await expect(runStep(engine, state, 'late', () => 1)).rejects.toThrow(/step 'late' was called after the response was sent/)
    await settle(engine, state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
    const duplicate = request()
    const holder = request(duplicate.state.key)
    await ask(engine, holder.state)
    await ask(engine, duplicate.state)
    expect(duplicate.state.phase).toBe('refused')
    await expect(runStep(engine, duplicate.state, 's', () => 1)).rejects.toThrow(/after the response was sent/)
  })

  it('refuses a step in flight in another run of the same key with 409', async () => {
    const engine = engineOver(new MemoryStorage())
    const { state } = request()
    await ask(engine, state)
    let release!: () => void
    const running = runStep(engine, state, 'slow', () => new Promise<number>((resolve) => { release = () => { resolve(1) } }))
    await expect.poll(() => release !== undefined).toBe(true)
    await expect(runStep(engine, state, 'slow', () => 2)).rejects.toBeInstanceOf(IdempotencyRequestInProgressError)
    release()
    expect(await running).toBe(1)
  })
})

describe('phases', () => {
  const response = answer('{}')
  /** The move to each phase, as the engine makes it. */
  const moveTo: Record<Exclude<Phase, 'keyed'>, (state: RequestState) => void> = {
    acquiring: (state) => { state.startAcquiring('key', 'fp', null) },
    replayed: (state) => { state.replay(response) },
    refused: (state) => { state.refuse() },
    unprotected: (state) => { state.runUnprotected() },
    running: (state) => { state.hold('token') },
    settling: (state) => { state.startSettling() },
    storing: (state) => { state.storeInBackground() },
    ended: (state) => { state.end() }
  }
  /** A way to reach each phase from `keyed`. */
  const pathTo: Record<Phase, Array<Exclude<Phase, 'keyed'>>> = {
    keyed: [],
    acquiring: ['acquiring'],
    replayed: ['acquiring', 'replayed'],
    refused: ['acquiring', 'refused'],
    unprotected: ['acquiring', 'unprotected'],
    running: ['acquiring', 'running'],
    settling: ['acquiring', 'running', 'settling'],
    storing: ['acquiring', 'running', 'settling', 'storing'],
    ended: ['acquiring', 'running', 'settling', 'ended']
  }
  const phases = Object.keys(pathTo) as Phase[]
  const at = (phase: Phase): RequestState => {
    const state = new RequestState('key', 'POST', recordingLog().log)
    for (const step of pathTo[phase]) moveTo[step](state)
    expect(state.phase).toBe(phase)
    return state
  }

  it('are the lifecycle drawn in request-state.ts', () => {
    const moves = phases.flatMap((from) => PHASE_MOVES[from].map((to) => `${from} -> ${to}`))
    expect(moves.sort()).toEqual([
      'acquiring -> refused',
      'acquiring -> replayed',
      'acquiring -> running',
      'acquiring -> unprotected',
      'keyed -> acquiring',
      'running -> settling',
      'settling -> ended',
      'settling -> storing',
      'storing -> ended'
    ])
    expect(new RequestState('key', 'POST', recordingLog().log).phase).toBe('keyed')
  })

  for (const from of phases) {
    for (const to of phases) {
      if (to === 'keyed') continue
      const legal = PHASE_MOVES[from].includes(to)
      it(`${legal ? 'move' : 'throw on'} ${from} -> ${to}`, () => {
        const state = at(from)
        if (legal) {
          moveTo[to](state)
          expect(state.phase).toBe(to)
        } else {
          expect(() => { moveTo[to](state) }).toThrow(`fastify-idempotency: a request in phase ${from} cannot move to ${to}`)
          expect(state.phase).toBe(from)
        }
      })
    }
  }

  it('keep what each move carries', () => {
    const state = at('acquiring')
    expect(state.storageKey).toBe('key')
    expect(state.fingerprint).toBe('fp')
    expect(state.started).toBeGreaterThan(0)
    const before = Date.now()
    state.hold('t1')
    expect(state.token).toBe('t1')
    expect(state.acquiredAt).toBeGreaterThanOrEqual(before)
    const replayed = at('acquiring')
    replayed.replay(response)
    expect(replayed.replayed).toBe(response)
  })

  it('a request cannot be settled twice', async () => {
    const engine = engineOver(new MemoryStorage())
    const { state } = request()
    await ask(engine, state)
    await end(engine, state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
    expect(() => { state.startSettling() }).toThrow(/phase ended cannot move to settling/)
  })
})
