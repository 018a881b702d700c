/**
 * The end of a request that held the lease: store its response (`complete`) or give the key back
 * (`release`); in transaction mode, commit the handler's writes with the stored response or roll
 * both back. Never throws: the store's failures are reported, and the outcome says whether the
 * client may still receive the response it is about to get.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { IdempotencyEvent } from '../diagnostics.js'
import type { StorageTransaction, StoredResponse } from '../storage/types.js'
import type { RequestState } from './request-state.js'
import { callOnCopy, storeIfKeeps, type ResponseCallbacks } from './route-callbacks.js'
import { isPromise, type MaybePromise } from './maybe-promise.js'
import type { RouteEngine } from './route-engine.js'
import { inFlightStep } from './in-flight.js'

/** Why an executed request's response was not stored. */
export type NotStoredReason = NonNullable<IdempotencyEvent['reason']>

export interface Settlement {
  /** The response is stored: a retry replays it. */
  stored: boolean
  /** Why not, when it is not. */
  reason?: NotStoredReason
  /**
   * Whether the client may receive the response as a success. Only transaction mode says no: a
   * response that was to be kept and was not (lease lost, commit failed) had its writes rolled back.
   */
  deliverable: boolean
  /**
   * Storing failed and goes on in the background while the lease is held and renewed, so that
   * duplicates get 409 rather than a second run until it is stored (or `maxLockHold` has passed).
   */
  retrying?: boolean
  /** With `retrying`: the settlement storing in the background comes to (`run` waits for it). */
  background?: Promise<Settlement>
}

/**
 * How the adapter ends a request that ran: the one input of `settle`.
 *
 * - `store`: keep `response` (the answer as sent, or only its outcome when its body cannot be
 *   kept), unless the route's `storeIf` declines it.
 * - `give-back`: keep nothing and free the key, for `reason`.
 *
 * `statusCode` is the status the client gets, for events. `text`: the body is this string, as the
 * handler sent it, and `response.body` is left empty. The adapter gives one only when nothing on
 * the way reads the body (no `storeIf`, `redact` or transaction), and the store keeps text
 * (StoreDoor.keepsText) or the response is sealed (the seal writes the text into its plaintext):
 * a first request then makes no Buffer of its body.
 */
export type Ending =
  | { kind: 'store', statusCode: number, response: StoredResponse, text?: string }
  | { kind: 'give-back', statusCode: number, reason: NotStoredReason }

const STORED: Settlement = { stored: true, deliverable: true }

/**
 * Settle a request the adapter moved to `settling` (`state.startSettling()`, done as soon as the
 * response is known, so that a second send cannot settle it again): store the response or give
 * the key back, as `ending` says. The request ends in `ended`, or in `storing` while storing is
 * retried in the background.
 */
export function settle (engine: RouteEngine, state: RequestState, ending: Ending): MaybePromise<Settlement> {
  return inFlightStep(engine, state, ending, settling, left)
}

/** The lease stops being renewed, and the response is stored or the key given back. */
function settling (engine: RouteEngine, state: RequestState, ending: Ending): MaybePromise<Settlement> {
  engine.renewal.drop(state)
  // How long the key was held, on the wall clock the lease was taken by: a Retry-After hint needs
  // no finer grain, and reading it costs a fifth of performance.now() (a clock set back reads 0).
  engine.durations.record(Math.max(0, Date.now() - state.acquiredAt))
  const decided = decide(engine, state, ending)
  return isPromise(decided) ? decided.then((what) => keep(engine, state, ending, what)) : keep(engine, state, ending, decided)
}

/** The request leaves the in-flight registry, unless storing goes on in the background: it leaves when that ends. */
function left (engine: RouteEngine, state: RequestState, settlement: Settlement): Settlement {
  if (settlement.retrying !== true) engine.inFlight.leave(state)
  return settlement
}

/** What is to become of the response, decided: store it (or give the key back), then say so. */
interface Decided {
  /** The response as kept, before sealing (for events); `null` when nothing is kept. */
  kept: StoredResponse | null
  /** The ending with what goes to the store. */
  final: Ending
}

function keep (engine: RouteEngine, state: RequestState, ending: Ending, { kept, final }: Decided): MaybePromise<Settlement> {
  const settled = state.transaction === null ? settleAlone(engine, state, final) : settleTransaction(engine, state, state.transaction, final)
  return isPromise(settled) ? settled.then((settlement) => reported(engine, state, ending, final, kept, settlement)) : reported(engine, state, ending, final, kept, settled)
}

/** Say what became of the request; storing that failed goes on in the background (`storing`). */
function reported (engine: RouteEngine, state: RequestState, ending: Ending, final: Ending, kept: StoredResponse | null, settlement: Settlement): Settlement {
  if (settlement.retrying === true && final.kind === 'store') {
    state.storeInBackground()
    settlement.background = keepStoring(engine, state, final, kept!)
  } else {
    reportExecuted(engine, state, ending.statusCode, settlement, kept)
    state.end()
  }
  return settlement
}

/**
 * What is to become of the response: the route's `storeIf` may decline it (the key is given back),
 * its `redact` takes out what must not be kept, and with encryption it is sealed. At once when the
 * route has neither `storeIf` nor `redact`.
 */
function decide ({ settings, door: { cipher } }: RouteEngine, state: RequestState, ending: Ending): MaybePromise<Decided> {
  if (ending.kind === 'give-back') return { kept: null, final: ending }
  const { storeIf, redact } = state.callbacks
  if (storeIf === null && redact === null) {
    return { kept: ending.response, final: cipher === null ? ending : { kind: 'store', statusCode: ending.statusCode, response: cipher.seal(state.storageKey, ending.response, ending.text) } }
  }
  return decideWithCallbacks(settings, cipher, state, ending)
}

async function decideWithCallbacks (settings: RouteEngine['settings'], cipher: RouteEngine['door']['cipher'], state: RequestState, ending: Extract<Ending, { kind: 'store' }>): Promise<Decided> {
  const { storeIf, redact } = state.callbacks
  // The route's storeIf sees the answer as sent, before redact takes anything out of it.
  if (storeIf !== null && !await storeIfKeeps(state, storeIf, ending.response, settings.storeTimeout)) {
    return { kept: null, final: { kind: 'give-back', statusCode: ending.statusCode, reason: 'declined' } }
  }
  const kept = redact === null ? ending.response : await redacted(state, redact, ending.response, settings.storeTimeout)
  return { kept, final: { kind: 'store', statusCode: ending.statusCode, response: cipher === null ? kept : cipher.seal(state.storageKey, kept) } }
}

/**
 * What the route's `redact` makes of a copy of `response`. Its status stays. When it throws,
 * returns something that is not a response or does not settle within `timeout`, only the status
 * is kept: nothing it was meant to take out is stored, and a retry still does not run the handler
 * again.
 */
async function redacted (state: RequestState, redact: NonNullable<ResponseCallbacks['redact']>, response: StoredResponse, timeout: number): Promise<StoredResponse> {
  try {
    const result = await callOnCopy('redact', redact, response, timeout)
    const omitted = result?.bodyOmitted === true
    if (result === null || typeof result !== 'object' || (!omitted && !Buffer.isBuffer(result.body)) ||
      (result.headers !== undefined && (result.headers === null || typeof result.headers !== 'object'))) {
      throw new TypeError('redact must return a StoredResponse (a Buffer body, or bodyOmitted: true)')
    }
    const kept: StoredResponse = { statusCode: response.statusCode, contentType: typeof result.contentType === 'string' ? result.contentType : null, headers: result.headers ?? {}, body: omitted ? Buffer.alloc(0) : result.body }
    if (omitted) kept.bodyOmitted = true
    return kept
  } catch (error) {
    state.log.error({ err: error, idempotencyKey: state.key }, 'idempotency redact failed: only the status of this response is stored')
    return { statusCode: response.statusCode, contentType: null, headers: {}, body: Buffer.alloc(0), bodyOmitted: true }
  }
}

/** Store the response (or give the key back) outside a transaction: at once on a store that answers at once. */
function settleAlone (engine: RouteEngine, state: RequestState, ending: Ending): MaybePromise<Settlement> {
  if (ending.kind === 'give-back') {
    const gaveBack: Settlement = { stored: false, reason: ending.reason, deliverable: true }
    let released: MaybePromise<boolean>
    try {
      released = engine.door.release(state.storageKey, state.token)
    } catch (error) {
      return releaseFailed(engine, state, gaveBack, error)
    }
    return isPromise(released) ? released.then(() => gaveBack, (error: unknown) => releaseFailed(engine, state, gaveBack, error)) : gaveBack
  }
  let stored: MaybePromise<boolean>
  try {
    stored = complete(engine, state, ending.response, ending.text)
  } catch (error) {
    return completeFailed(engine, state, error)
  }
  return isPromise(stored) ? stored.then((held) => completed(engine, state, held), (error: unknown) => completeFailed(engine, state, error)) : completed(engine, state, stored)
}

function releaseFailed ({ reporter }: RouteEngine, state: RequestState, gaveBack: Settlement, error: unknown): Settlement {
  reporter.report(state, 'store-error', { phase: 'release', error }, 'error', 'idempotency store failed after the handler ran: the response was sent but the key stays locked until its lease lapses')
  return gaveBack
}

/** `complete` answered: stored, or the lease was lost. */
function completed ({ reporter }: RouteEngine, state: RequestState, held: boolean): Settlement {
  if (held) return STORED
  reporter.report(state, 'lease-lost', { phase: 'complete' }, 'warn', 'idempotency lease was lost before the response was stored: this response was not stored')
  return { stored: false, reason: 'lease-lost', deliverable: true }
}

function completeFailed ({ reporter }: RouteEngine, state: RequestState, error: unknown): Settlement {
  reporter.report(state, 'store-error', { phase: 'complete', error }, 'error', 'idempotency store failed to store the response after the handler ran: the response was sent, and storing is retried while the lease is held')
  return { stored: false, reason: 'store-error', deliverable: true, retrying: true }
}

/** Store `response`, within storeTimeout; a call given up that still succeeds marks the state. */
function complete ({ door }: RouteEngine, state: RequestState, response: StoredResponse, text?: string): MaybePromise<boolean> {
  return door.complete(state.storageKey, state.token, response, (stored) => {
    if (stored) state.storedLate = true
  }, text)
}

/** First and longest pause between two attempts to store a response. */
const FIRST_STORE_RETRY_MS = 50
const LAST_STORE_RETRY_MS = 2000

/**
 * Store the response after a failed attempt: renew the lease meanwhile, and try again with a
 * back-off until the store takes it, the lease is lost, or `maxLockHold` has passed since the lease
 * was acquired (then the lease lapses, and a retry of the request runs the handler again: said
 * loudly, in the log and on the diagnostics channels). Closing the app waits for it up to
 * `closeTimeout`; past that it gives up, as the store is about to be closed.
 */
async function keepStoring (engine: RouteEngine, state: RequestState, { statusCode, response, text }: Extract<Ending, { kind: 'store' }>, kept: StoredResponse): Promise<Settlement> {
  const { settings, reporter, renewal, inFlight } = engine
  // From the last renewal sent, not from now: the failed attempt took time the lease did not wait for.
  renewal.hold(state, state.renewedAt)
  let settlement: Settlement = { stored: false, reason: 'store-error', deliverable: true }
  for (let pause = FIRST_STORE_RETRY_MS; ; pause = Math.min(pause * 2, LAST_STORE_RETRY_MS)) {
    // The last attempt is made at maxLockHold, not one back-off pause (up to 2 s) past it: renewal
    // stops there, and the lease may lapse and a retry run the handler before a later attempt,
    // and before the plugin has said that it gave up.
    const left = settings.maxLockHold - (Date.now() - state.acquiredAt)
    if (left <= 0) break
    // Unreferenced: a pending retry never keeps the process alive on its own.
    await sleep(Math.min(pause, left), undefined, { ref: false })
    if (inFlight.closed) break
    try {
      // An attempt given up on may have gone through after all: the lease is then gone because
      // the response is stored, not because it was lost.
      if (state.storedLate || await complete(engine, state, response, text) || state.storedLate) {
        settlement = STORED
      } else {
        reporter.report(state, 'lease-lost', { phase: 'complete' }, 'warn', 'idempotency lease was lost before the response could be stored: this response was not stored')
        settlement = { stored: false, reason: 'lease-lost', deliverable: true }
      }
      break
    } catch {
      // Still failing: the first failure was reported; the last one is, below.
    }
  }
  renewal.drop(state)
  // Given up at close: closing the app said so already, for every request it stopped waiting for.
  if (!settlement.stored && settlement.reason === 'store-error' && !inFlight.closed) {
    reporter.report(state, 'store-error', { phase: 'complete' }, 'error', 'idempotency store refused the response until maxLockHold: gave up storing it; the lease lapses and a retry runs the handler again')
  }
  reportExecuted(engine, state, statusCode, settlement, kept)
  state.end()
  inFlight.leave(state)
  return settlement
}

/** Commit the handler's writes with the stored response, or roll both back and free the key. */
async function settleTransaction ({ door, reporter }: RouteEngine, state: RequestState, transaction: StorageTransaction, ending: Ending): Promise<Settlement> {
  const response = ending.kind === 'store' ? ending.response : null
  let reason: NotStoredReason | undefined = ending.kind === 'give-back' ? ending.reason : undefined
  try {
    if (response !== null && await door.completeIn(transaction, state.storageKey, state.token, response)) {
      await door.commit(transaction)
    } else {
      if (response !== null) {
        reason = 'lease-lost'
        reporter.report(state, 'lease-lost', { phase: 'complete' }, 'warn', 'idempotency lease was lost before commit: the transaction was rolled back')
      }
      await door.rollback(transaction)
    }
  } catch (error) {
    reason = ending.kind === 'give-back' ? ending.reason : 'store-error'
    reporter.report(state, 'store-error', { phase: 'complete', error }, 'error', 'idempotency transaction failed: rolled back')
    await door.rollback(transaction).catch(() => {})
  }
  if (reason === undefined) return STORED
  try {
    await door.release(state.storageKey, state.token)
  } catch (error) {
    reporter.report(state, 'store-error', { phase: 'release', error }, 'error', 'idempotency lease could not be released: the key stays locked until its lease lapses')
  }
  // An error answer rolled back is what the client expects, and so is one its route's storeIf
  // declined (a retry runs it again, so its writes must not stay); a success whose writes were
  // rolled back (lease lost, commit failed, or a body that cannot be stored) is not.
  const deliverable = reason === 'not-cacheable' || reason === 'declined' || reason === 'failed' || reason === 'hijacked'
  return { stored: false, reason, deliverable }
}

/** The handler ran: say whether its response was stored, and if not, why. */
function reportExecuted ({ reporter }: RouteEngine, state: RequestState, statusCode: number, settlement: Settlement, response: StoredResponse | null): void {
  if (!settlement.stored) reporter.report(state, 'execute', { statusCode, stored: false, reason: settlement.reason })
  else reporter.report(state, 'execute', response?.bodyOmitted === true ? { statusCode, stored: true, bodyOmitted: true } : { statusCode, stored: true })
}
