/**
 * The decision for a request with a key: replay, refuse, wait, or run. One atomic `begin` on the
 * store answers it; with `wait`, a duplicate of a request in flight waits for it to end and asks
 * again.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import {
  IdempotencyRequestInProgressError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError,
  type IdempotencyError
} from '../errors.js'
import type { BeginInFlight, StoredResponse } from '../storage/types.js'
import { UnreadableEntryError } from '../storage/unreadable-entry.js'
import { fingerprintRefusal, type FingerprintComparison } from './fingerprint-check.js'
import { checkConnectionFree } from './held-connection.js'
import type { RequestState } from './request-state.js'
import { isPromise, type MaybePromise } from './maybe-promise.js'
import type { RouteEngine } from './route-engine.js'
import { inFlightStep } from './in-flight.js'
import type { TakenLease } from './store-door.js'

export type Acquisition =
  /** The request holds the lease: run the handler. */
  | { outcome: 'run' }
  /** Answer with this stored response; the handler does not run. */
  | { outcome: 'replay', response: StoredResponse }
  /** Answer with this error; the handler does not run. */
  | { outcome: 'refuse', error: IdempotencyError }
  /** The store is unreachable and the route fails open: run the handler without protection. */
  | { outcome: 'unprotected' }

const RUN: Acquisition = { outcome: 'run' }
const UNPROTECTED: Acquisition = { outcome: 'unprotected' }

/**
 * Ask the store about a request in phase `keyed`, known by `storageKey` and `fingerprint`
 * (`fingerprinted` compares a stored fingerprint that differs as text; see fingerprint-check.ts).
 * The answer moves the request to its next phase (request-state.ts): `running`, `replayed`,
 * `refused` or `unprotected`. It comes at once when the store answers at once and nothing is to
 * be waited for (maybe-promise.ts); otherwise in a promise.
 *
 * The request is in flight from here until it is settled (engine/in-flight.ts); once the app is
 * closing, a request that has not reached the store yet is refused instead.
 */
export function acquire (engine: RouteEngine, state: RequestState, storageKey: string, fingerprint: string, fingerprinted: FingerprintComparison | null = null): MaybePromise<Acquisition> {
  checkConnectionFree(engine, state.key)
  state.startAcquiring(storageKey, fingerprint, fingerprinted)
  if (!engine.inFlight.enter(state, engine.reporter)) return advance(state, { outcome: 'refuse', error: new IdempotencyServerClosingError(state.key) })
  return inFlightStep(engine, state, undefined, ask, answered)
}

/** The request moves to the phase its answer leads to; only one that runs its handler stays in flight (settling it ends it). */
function answered (engine: RouteEngine, state: RequestState, acquisition: Acquisition): Acquisition {
  try {
    return advance(state, acquisition)
  } finally {
    if (acquisition.outcome !== 'run') engine.inFlight.leave(state)
  }
}

/** Move the request to the phase `acquisition` leads to (`running` was entered when the lease was held). */
function advance (state: RequestState, acquisition: Acquisition): Acquisition {
  switch (acquisition.outcome) {
    case 'replay': state.replay(acquisition.response); break
    case 'refuse': state.refuse(); break
    case 'unprotected': state.runUnprotected(); break
    case 'run': break
  }
  return acquisition
}

/** The store is asked again: a duplicate in flight, to be waited for (wait mode). */
const WAIT = Symbol('wait')

/** The store's first answer, and what it leads to; waiting, when there is a duplicate to wait for, in `keepAsking`. */
function ask (engine: RouteEngine, state: RequestState): MaybePromise<Acquisition> {
  const waitUntil = engine.settings.waitTimeout > 0 ? Date.now() + engine.settings.waitTimeout : 0
  let taken: MaybePromise<TakenLease>
  try {
    taken = engine.door.begin(state.storageKey, state.fingerprint, engine.renewal)
  } catch (error) {
    return beginFailed(engine, state, error)
  }
  if (isPromise(taken)) return taken.then((first) => answerOrWait(engine, state, first, waitUntil), (error: unknown) => beginFailed(engine, state, error))
  return answerOrWait(engine, state, taken, waitUntil)
}

function answerOrWait (engine: RouteEngine, state: RequestState, taken: TakenLease, waitUntil: number): MaybePromise<Acquisition> {
  const decided = decide(engine, state, taken, 0, waitUntil)
  return decided === WAIT ? keepAsking(engine, state, taken.result as BeginInFlight, waitUntil) : decided
}

/** Wait for the holder of the lease, ask again, and again, until the answer is not "wait". */
async function keepAsking (engine: RouteEngine, state: RequestState, holder: BeginInFlight, waitUntil: number): Promise<Acquisition> {
  for (let attempt = 0; ; attempt++) {
    const now = Date.now()
    await waitForLease(engine, state.storageKey, holder.lockExpiresAt - now, waitUntil - now, attempt)
    if (engine.inFlight.closed) return { outcome: 'refuse', error: new IdempotencyServerClosingError(state.key) }
    let taken
    try {
      taken = await engine.door.begin(state.storageKey, state.fingerprint, engine.renewal)
    } catch (error) {
      return beginFailed(engine, state, error)
    }
    const decided = decide(engine, state, taken, attempt + 1, waitUntil)
    if (decided !== WAIT) return await decided
    holder = taken.result as BeginInFlight
  }
}

/** A `begin` that failed: the store cannot be read (409), is down (503), or the route fails open. */
function beginFailed (engine: RouteEngine, state: RequestState, error: unknown): Acquisition {
  const { settings, reporter } = engine
  // A value the store cannot read records an operation that may have happened: never run again.
  if (error instanceof UnreadableEntryError) return unreadable(engine, state, error)
  // Closing has stopped waiting (and the call with it), and the app closes the store next: the
  // request is refused as closing, never run unprotected, and the store is not said to be down.
  if (engine.inFlight.closed) return { outcome: 'refuse', error: new IdempotencyServerClosingError(state.key) }
  if (settings.failOpen) {
    reporter.report(state, 'store-error', { phase: 'begin', failOpen: true, error }, 'warn', 'idempotency store unavailable: running the handler without protection (failOpen)')
    return UNPROTECTED
  }
  reporter.report(state, 'store-error', { phase: 'begin', failOpen: false, error }, 'error', 'idempotency store unavailable: answering 503')
  return { outcome: 'refuse', error: new IdempotencyStoreUnavailableError(state.key, error) }
}

/** What one answer of the store leads to (the `attempt`th, counting from 0); WAIT for a duplicate in flight to wait for. */
function decide (engine: RouteEngine, state: RequestState, taken: TakenLease, attempt: number, waitUntil: number): MaybePromise<Acquisition> | typeof WAIT {
  const { settings, reporter } = engine
  const { result } = taken
  if (attempt > 0) reporter.report(state, 'wait', { waitedMs: performance.now() - state.started })
  if (result.state === 'acquired') {
    if (engine.inFlight.closed) return closedMeanwhile(engine, state, result.token)
    const acquiredAt = Date.now()
    if (!settings.transaction) return hold(engine, state, result.token, acquiredAt, taken.since)
    return openTransaction(engine, state, result.token).then((refused) => refused ?? hold(engine, state, result.token, acquiredAt, taken.since))
  }
  // A different request under this key is refused whether the first one finished or not.
  const refusal = fingerprintRefusal(engine, state, result.fingerprint)
  if (refusal !== null) return { outcome: 'refuse', error: refusal }
  if (result.state === 'completed') return replay(engine, state, result.response)
  const now = Date.now()
  if (now < waitUntil) return WAIT
  reporter.report(state, 'in-progress', {}, 'debug', 'idempotency key in progress')
  const untilLeaseEnds = result.lockExpiresAt - now
  return { outcome: 'refuse', error: new IdempotencyRequestInProgressError(state.key, retryAfter(engine, untilLeaseEnds) / 1000, leaseEndsIn(engine, untilLeaseEnds)) }
}

/** The lease is the request's, taken at `acquiredAt` and measured by the store from `since`: it runs, and the lease is renewed. */
function hold ({ renewal }: RouteEngine, state: RequestState, token: string, acquiredAt: number, since: number): Acquisition {
  state.hold(token, acquiredAt)
  renewal.hold(state, since)
  return RUN
}

/**
 * A lease granted after closing stopped waiting: the store is about to be closed, so the handler
 * must not start. The lease is given back at once.
 */
async function closedMeanwhile ({ door }: RouteEngine, state: RequestState, token: string): Promise<Acquisition> {
  await door.giveBack(state.storageKey, token)
  return { outcome: 'refuse', error: new IdempotencyServerClosingError(state.key) }
}

/** Answer with the stored response, opened first when it is sealed (encryption). */
function replay (engine: RouteEngine, state: RequestState, stored: StoredResponse): Acquisition {
  const { door: { cipher }, reporter } = engine
  let response = stored
  if (cipher !== null) {
    try {
      response = cipher.open(state.storageKey, stored)
    } catch (error) {
      return unreadable(engine, state, error)
    }
  }
  reporter.report(state, 'replay', { statusCode: response.statusCode }, 'debug', 'idempotency replay')
  return { outcome: 'replay', response }
}

/** What is stored cannot be read (a sealed entry that does not open, another version's layout): 409. */
function unreadable ({ reporter }: RouteEngine, state: RequestState, error: unknown): Acquisition {
  reporter.report(state, 'unreadable', { error }, 'error', 'idempotency stored entry cannot be read (sealed with a key no longer configured, altered, not sealed, or of another version\'s layout): refused with 409, the handler not run')
  return { outcome: 'refuse', error: new IdempotencyStoredResponseUnreadableError(state.key, error) }
}

/** Before a route has any history, a duplicate is told to come back after this many ms. */
const FIRST_RETRY_AFTER_MS = 1000
/** Never sooner: a retry that comes back at once only meets the same 409. */
const MIN_RETRY_AFTER_MS = 100

/**
 * When a duplicate's retry is likely to find the response stored: the route's recent 90th
 * percentile of time holding a key (the holder started some time ago, so usually sooner), never
 * past the end of the holder's lease, when the key is free in any case.
 */
function retryAfter ({ durations }: RouteEngine, untilLeaseEnds: number): number {
  return Math.max(MIN_RETRY_AFTER_MS, Math.min(untilLeaseEnds, durations.p90(FIRST_RETRY_AFTER_MS)))
}

/**
 * When the holder's lease ends unless renewed, as far as this process can tell, for a job that
 * must wait out a dead holder without coming back before (each return costs a broker's delivery).
 * The lease's end is the store's clock (or the holder's): never more than `lockTimeout` away, which
 * no lease outlasts without a renewal; and when this process's clock says it has passed already
 * while the store still holds it (the clocks disagree, or it just ended), an eighth of
 * `lockTimeout`, so that at most eight returns are spent on a lease whatever the clocks say.
 */
function leaseEndsIn ({ settings: { lockTimeout } }: RouteEngine, untilLeaseEnds: number): number {
  if (untilLeaseEnds > lockTimeout) return lockTimeout
  return untilLeaseEnds > 0 ? untilLeaseEnds : Math.ceil(lockTimeout / 8)
}

/** The first pause between two asks of a waiting duplicate, doubled on each ask up to 16 times it. */
const FIRST_PAUSE_MS = 25

/**
 * Wait for the lease holder to finish, at most until the wait's own end: on the store's own
 * signal where it has one, otherwise by polling with a pause that grows with each ask (25 ms
 * doubling to 400 ms), which keeps the store's load bounded.
 *
 * With a signal, one round lasts until the holder's lease ends as far as this process can tell,
 * but never less than the pause nor more than `lockTimeout`. The lease's end is the store's clock,
 * and this process's clock may disagree with it by any amount: ahead, every lease looks lapsed
 * already, and asking again at once would poll the store in a tight loop (with a synchronous
 * driver, starving this process's event loop, and with it the renewal of its own leases); behind,
 * a lease looks far from its end, and the lapse of a holder that died (which nobody signals) would
 * be noticed late. The pause bounds the first; `lockTimeout`, which no holder that stopped
 * renewing can outlast, bounds the second.
 */
async function waitForLease ({ door, settings }: RouteEngine, storageKey: string, untilLeaseEnds: number, untilWaitEnds: number, attempt: number): Promise<void> {
  const pause = Math.min(FIRST_PAUSE_MS * 2 ** Math.min(attempt, 4), untilWaitEnds)
  if (door.signals) {
    const timeout = Math.min(Math.max(untilLeaseEnds, pause), settings.lockTimeout, untilWaitEnds)
    try {
      await door.waitFor(storageKey, timeout)
      return
    } catch {
      // The store cannot wait right now (say, its subscriber connection is down): poll instead.
    }
  }
  await sleep(pause)
}

/**
 * Transaction mode: the lease is already committed on its own (so duplicates see the request in
 * flight); the handler's writes and the stored response go into this transaction. `null` when it
 * is open, the refusal when it could not be opened (the lease, `token`, is given back: the handler
 * never runs under it).
 */
async function openTransaction ({ door, reporter, settings }: RouteEngine, state: RequestState, token: string): Promise<Acquisition | null> {
  try {
    state.transaction = await door.openTransaction({ ...settings.transaction, request: true, lease: { key: state.storageKey, token, lockTimeout: settings.lockTimeout } })
    return null
  } catch (error) {
    reporter.report(state, 'store-error', { phase: 'begin', failOpen: false, error }, 'error', 'idempotency transaction could not be opened: answering 503')
    await door.giveBack(state.storageKey, token)
    return { outcome: 'refuse', error: new IdempotencyStoreUnavailableError(state.key, error) }
  }
}
