/**
 * Every outcome of a guarded request, published on `node:diagnostics_channel` so operators can
 * count and time them (Prometheus, OpenTelemetry) without the plugin depending on either.
 * Publishing costs one property read when nobody subscribes.
 */
import diagnostics from 'node:diagnostics_channel'

export type IdempotencyOutcome =
  /** The request took the lease and its handler ran; `stored` says whether its response was kept. */
  | 'execute'
  /** A stored response was replayed. */
  | 'replay'
  /** The key was reused with another fingerprint. */
  | 'mismatch'
  /** A duplicate arrived while the first request was in flight, and was answered 409. */
  | 'in-progress'
  /** A duplicate waited for the first request (wait mode); `waitedMs` says how long. */
  | 'wait'
  /** The lease was lost before the response could be stored (a lapsed lease taken over). */
  | 'lease-lost'
  /** The store failed; `phase` says where, `failOpen` whether the handler ran anyway. */
  | 'store-error'
  /**
   * With encryption on, a stored entry could not be opened (altered, sealed with a key no longer
   * configured, or not sealed): refused with 409, the handler not run.
   */
  | 'unreadable'
  /** A recovery point's function ran and its result was recorded; `step` names it. */
  | 'step-run'
  /** A recovery point returned the result recorded by an earlier run, without running; `step` names it. */
  | 'step-replay'

export interface IdempotencyEvent {
  outcome: IdempotencyOutcome
  /** The client's key (unscoped). */
  idempotencyKey: string
  method: string
  /** The route pattern, e.g. `/orders/:id`. */
  route: string
  /** The storage class, e.g. `RedisStorage`. */
  store: string
  /** Milliseconds since the plugin started on this request (first store call). */
  durationMs: number
  statusCode?: number
  stored?: boolean
  /** Stored without its body (too large, a hijacked reply): the outcome only. */
  bodyOmitted?: boolean
  /** Why an executed request's response was not stored. */
  reason?: 'failed' | 'not-cacheable' | 'too-large' | 'interrupted' | 'hijacked' | 'lease-lost' | 'store-error'
  waitedMs?: number
  /** Where it happened; `max-hold`: renewal stopped because the request held its key for `maxLockHold`. */
  phase?: 'begin' | 'complete' | 'release' | 'renew' | 'max-hold'
  failOpen?: boolean
  error?: unknown
  /** The recovery point's name (step-run, step-replay). */
  step?: string
}

/** Channel names: `fastify-idempotency:<outcome>`. */
export const CHANNEL_PREFIX = 'fastify-idempotency:'

const outcomes: readonly IdempotencyOutcome[] = ['execute', 'replay', 'mismatch', 'in-progress', 'wait', 'lease-lost', 'store-error', 'unreadable', 'step-run', 'step-replay']

/** One channel per outcome, so a subscriber listens to exactly what it counts. */
export const channels = Object.fromEntries(
  outcomes.map((outcome) => [outcome, diagnostics.channel(`${CHANNEL_PREFIX}${outcome}`)])
) as Record<IdempotencyOutcome, diagnostics.Channel>
