/**
 * One call of `run(key, input, fn)`: the second adapter of the engine, beside the HTTP hooks. The
 * same protocol drives it (acquire, then settle, with steps between), only its inputs and outcomes
 * are a function's: the input is fingerprinted as a body is, the first call runs `fn` and keeps
 * what it returns, a duplicate gets what was kept without `fn` running, a different input under
 * the key is refused, a duplicate while the first runs waits or is refused, as configured.
 *
 *   acquire ──replay──────> the kept result, decoded               (fn does not run)
 *           ──refuse──────> the error thrown: mismatch, in progress, store unavailable, unreadable
 *           ──unprotected─> fn runs without a lease                (the store is down, failOpen)
 *           ──run─────────> fn runs, holding the lease (renewed); then settle:
 *                             fn returned: its result kept (`store`) and returned
 *                             fn threw:    the key given back (`give-back`), the error rethrown
 */
import { acquire } from '../engine/acquire.js'
import { holdingConnection } from '../engine/held-connection.js'
import { RequestState } from '../engine/request-state.js'
import type { Logger } from '../engine/report.js'
import type { RouteEngine } from '../engine/route-engine.js'
import { settle } from '../engine/settle.js'
import { runStep, type StepFunction } from '../engine/steps.js'
import { checkKey, storageKey } from '../engine/storage-key.js'
import { decodeValue, isResultRecord, recordOrLost, ValueLostError, type ValueCodec } from '../engine/value-codec.js'
import {
  IdempotencyLeaseLostError,
  IdempotencyResultNotRecordedError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError
} from '../errors.js'
import type { StoredResponse } from '../storage/types.js'
import { inputComparison, inputFingerprint } from './input-fingerprint.js'
import { markFailedAttempt } from './retry-decision.js'

/** Where a run's key is stored: the scope it is stored under, and whether requests share it (`sharedWithRequests`). */
export interface RunPlace {
  scope: string | null
  shared: boolean
}

/** What `fn` receives. */
export interface RunContext {
  /** The key it runs under. */
  readonly key: string
  /**
   * Transaction mode (KnexStorage): the database transaction to write through, committed with
   * the kept result. `undefined` otherwise.
   */
  readonly transaction: unknown
  /** A recovery point, as `request.idempotency.step` (docs/recovery-points.md). */
  step: <T>(name: string, fn: StepFunction<T>, codec?: ValueCodec<T>) => Promise<T>
}

/**
 * The work `run(key, input, fn)` guards: it runs once per key and input, and its result is kept for
 * retries (docs/jobs.md).
 */
export type RunFunction<T> = (context: RunContext) => T | Promise<T>

/** The method name in events and logs: a function run is not an HTTP request. */
const RUN_METHOD = 'RUN'

/**
 * Run `fn` once for `key` (in `scope`) and `input` on `engine`, or return what its first run kept.
 * `codec` is the caller's own way to keep results, if any.
 */
export async function runFunction<T> (engine: RouteEngine, log: Logger, key: string, { scope, shared }: RunPlace, input: unknown, fn: RunFunction<T>, maxKeyLength: number, codec?: ValueCodec<T>): Promise<T> {
  checkKey(key, maxKeyLength, 'A key')
  if (typeof fn !== 'function') throw new TypeError('fastify-idempotency: run needs a function')
  const state = new RequestState(key, RUN_METHOD, log)
  const fingerprint = inputFingerprint(key, input)
  const acquisition = await acquire(engine, state, storageKey(key, scope, engine.door.cipher), fingerprint, shared ? inputComparison(fingerprint) : null)
  switch (acquisition.outcome) {
    case 'replay': return shared && !isResultRecord(acquisition.response) ? requestAnswer(state, acquisition.response) as T : kept(engine, state, acquisition.response, codec)
    case 'refuse': throw acquisition.error
    case 'unprotected': return await attempt(engine, state, fn)
    case 'run': return await runHolding(engine, state, fn, codec)
  }
}

/** `fn` called; what it throws is marked as its own failure, whatever its class (retry-decision.ts). */
async function attempt<T> (engine: RouteEngine, state: RequestState, fn: RunFunction<T>): Promise<T> {
  try {
    return await fn(contextOf(engine, state))
  } catch (error) {
    markFailedAttempt(error)
    throw error
  }
}

function contextOf (engine: RouteEngine, state: RequestState): RunContext {
  return {
    key: state.key,
    transaction: state.transaction?.handle,
    step: async <S>(name: string, step: StepFunction<S>, codec?: ValueCodec<S>) => await runStep(engine, state, name, step, codec)
  }
}

/** The lease is held: run `fn`, then keep its result (or give the key back when it threw). */
async function runHolding<T> (engine: RouteEngine, state: RequestState, fn: RunFunction<T>, codec?: ValueCodec<T>): Promise<T> {
  let value: T
  try {
    value = await holdingConnection(engine, state, async () => await attempt(engine, state, fn))
  } catch (error) {
    state.startSettling()
    // Nothing is kept: the next call runs fn again (its recovery points keep what they did).
    await settle(engine, state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
    throw error
  }
  state.startSettling()
  let settlement = await settle(engine, state, { kind: 'store', statusCode: 200, response: keptOf(state, value, engine.settings.maxResponseBytes, codec) })
  // Transaction mode: the result was to be kept with fn's writes, and neither was. A failed
  // attempt: the next one runs fn again, as often as the caller's policy allows.
  if (!settlement.deliverable) {
    const error = new IdempotencyStoreUnavailableError(state.key, new Error(`the result was not kept (${settlement.reason ?? 'store-error'}): the transaction was rolled back`))
    markFailedAttempt(error)
    throw error
  }
  // The store failed: storing goes on while the lease is held, and the caller waits for it, since
  // it acknowledges its message once run returns.
  if (settlement.background !== undefined) settlement = await settlement.background
  // Not kept, and nothing says fn ran: a later call may run it again. Never return as if kept.
  if (!settlement.stored) throw new IdempotencyLeaseLostError(state.key, settlement.reason ?? 'lease-lost')
  return value
}

/**
 * What is kept of fn's result: its record, or that fn ran with its result lost. This call goes on
 * with the result it has; a later one gets IdempotencyResultNotRecordedError.
 */
function keptOf<T> (state: RequestState, value: T, limit: number, codec: ValueCodec<T> | undefined): StoredResponse {
  return recordOrLost(value, 'the function returned', limit, codec as ValueCodec | undefined, (error) => {
    state.log.error({ idempotencyKey: state.key }, `idempotency ${error.message}. The function ran: this call returns its result, and a later call with this key is refused (IdempotencyResultNotRecordedError) rather than running it again. Return plain data, or give run a codec (docs/jobs.md)`)
  })
}

/** What an earlier run kept, opened (the engine opened a sealed one) and decoded. */
function kept<T> ({ reporter }: RouteEngine, state: RequestState, response: StoredResponse, codec?: ValueCodec<T>): T {
  try {
    return decodeValue(response, codec as ValueCodec | undefined) as T
  } catch (error) {
    if (error instanceof ValueLostError) throw new IdempotencyResultNotRecordedError(state.key, error.reason, error)
    reporter.report(state, 'unreadable', { error }, 'error', 'idempotency kept result cannot be read: refused, the function not run')
    throw new IdempotencyStoredResponseUnreadableError(state.key, error)
  }
}

/** A JSON media type: `application/json`, or any `+json` suffix, with or without parameters. */
const JSON_MEDIA_TYPE = /^application\/(?:[\w.+-]*\+)?json\s*(?:;|$)/i

/**
 * A request's kept answer met by a run that shares its keys with requests: its body is the
 * result (parsed when JSON, as bytes otherwise; a redirect's too, Post/Redirect/Get's success). A
 * failure the request kept (a 4xx or 5xx its route stores) is no result: the operation is not run
 * again, and the call is not told it succeeded.
 */
function requestAnswer (state: RequestState, response: StoredResponse): unknown {
  if (response.statusCode >= 400) {
    throw new IdempotencyResultNotRecordedError(state.key, `a request with this key was answered ${response.statusCode}, which is not a result`)
  }
  if (response.bodyOmitted === true) return undefined
  const body = Buffer.from(response.body)
  return response.contentType !== null && JSON_MEDIA_TYPE.test(response.contentType) ? JSON.parse(body.toString('utf8')) : body
}
