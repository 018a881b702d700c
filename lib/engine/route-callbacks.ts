/**
 * The route's own functions that look at a response about to be stored (`storeIf`, `redact`). They
 * run while the client waits for its answer, so each gets a copy it cannot spoil the stored
 * response through, and a time limit: a function that never settles must not hold the answer (or
 * the key) for ever.
 */
import type { StoredResponse } from '../storage/types.js'
import type { RequestState } from './request-state.js'
import { withinTime } from './time-limit.js'

/** The route's own functions of a response to store, bound to one request by the adapter. */
export interface ResponseCallbacks {
  /** The route's `storeIf`; `null` when the route has none. */
  readonly storeIf: ((response: StoredResponse) => boolean | Promise<boolean>) | null
  /** The route's `redact`; `null` when the route has none. */
  readonly redact: ((response: StoredResponse) => StoredResponse | Promise<StoredResponse>) | null
}

export const NO_RESPONSE_CALLBACKS: ResponseCallbacks = { storeIf: null, redact: null }

/** A route function that did not settle within its time limit. */
export class RouteCallbackTimeoutError extends Error {
  constructor (name: string, timeout: number) {
    super(`fastify-idempotency: ${name} did not settle within ${timeout} ms (storeTimeout)`)
    this.name = 'RouteCallbackTimeoutError'
  }
}

/**
 * `fn` called on a copy of `response`, its promise (if it returns one) bounded by `timeout` ms. A
 * synchronous answer costs no timer. A promise that settles after the limit is ignored, and its
 * rejection is handled (by the race), so it never becomes an unhandled rejection.
 */
export async function callOnCopy<T> (name: string, fn: (response: StoredResponse) => T | Promise<T>, response: StoredResponse, timeout: number): Promise<T> {
  const result = fn({ ...response, headers: { ...response.headers }, body: Buffer.from(response.body) })
  if (!isThenable(result)) return result as T
  return await withinTime(result as PromiseLike<T>, timeout, () => new RouteCallbackTimeoutError(name, timeout))
}

/**
 * Whether the route's `storeIf` keeps `response`. Only a boolean decides. When it throws, rejects,
 * answers anything else or does not settle within `timeout`, the response is kept: the handler
 * ran and its operation may have taken effect, so a retry is answered with what it did rather
 * than run it a second time. The failure is logged at error level, with the key.
 */
export async function storeIfKeeps (state: RequestState, storeIf: NonNullable<ResponseCallbacks['storeIf']>, response: StoredResponse, timeout: number): Promise<boolean> {
  try {
    const decision: unknown = await callOnCopy('storeIf', storeIf, response, timeout)
    if (typeof decision === 'boolean') return decision
    throw new TypeError(`fastify-idempotency: storeIf must return a boolean or a promise of one (it returned ${describe(decision)})`)
  } catch (error) {
    state.log.error({ err: error, idempotencyKey: state.key }, 'idempotency storeIf failed: the response is stored as if it had returned true, so a retry replays it instead of running the handler again')
    return true
  }
}

function isThenable (value: unknown): value is PromiseLike<unknown> {
  return value !== null && (typeof value === 'object' || typeof value === 'function') && typeof (value as PromiseLike<unknown>).then === 'function'
}

/** What a wrong answer was, for the log: never the whole of it. */
function describe (value: unknown): string {
  if (value === null || value === undefined) return String(value)
  if (typeof value === 'string') return `the string ${JSON.stringify(value.slice(0, 40))}`
  if (typeof value === 'object') return 'an object'
  if (typeof value === 'function') return 'a function'
  return `${typeof value} ${String(value)}`
}
