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
import { decodeValue, recordOrLost, ValueLostError, type ValueCodec } from '../engine/value-codec.js'
import {
  IdempotencyResultNotRecordedError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError
} from '../errors.js'
import type { StoredResponse } from '../storage/types.js'
import { inputFingerprint } from './input-fingerprint.js'

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
export async function runFunction<T> (engine: RouteEngine, log: Logger, key: string, scope: string | null, input: unknown, fn: RunFunction<T>, maxKeyLength: number, codec?: ValueCodec<T>): Promise<T> {
  checkKey(key, maxKeyLength, 'A key')
  if (typeof fn !== 'function') throw new TypeError('fastify-idempotency: run needs a function')
  const state = new RequestState(key, RUN_METHOD, log)
  const acquisition = await acquire(engine, state, storageKey(key, scope, engine.door.cipher), inputFingerprint(key, input))
  switch (acquisition.outcome) {
    case 'replay': return kept(engine, state, acquisition.response, codec)
    case 'refuse': throw acquisition.error
    case 'unprotected': return await fn(contextOf(engine, state))
    case 'run': return await runHolding(engine, state, fn, codec)
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
    value = await holdingConnection(engine, state, () => fn(contextOf(engine, state)))
  } catch (error) {
    state.startSettling()
    // Nothing is kept: the next call runs fn again (its recovery points keep what they did).
    await settle(engine, state, { kind: 'give-back', statusCode: 500, reason: 'failed' })
    throw error
  }
  state.startSettling()
  const settlement = await settle(engine, state, { kind: 'store', statusCode: 200, response: keptOf(state, value, engine.settings.maxResponseBytes, codec) })
  // Transaction mode: the result was to be kept with fn's writes, and neither was.
  if (!settlement.deliverable) throw new IdempotencyStoreUnavailableError(state.key, new Error(`the result was not kept (${settlement.reason ?? 'store-error'}): the transaction was rolled back`))
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
