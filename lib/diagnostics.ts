/**
 * Every outcome of a guarded request, published on `node:diagnostics_channel` so operators can
 * count and time them (Prometheus, OpenTelemetry) without the plugin depending on either.
 * Publishing costs one property read when nobody subscribes.
 */
import diagnostics from 'node:diagnostics_channel'

/** What happened to a guarded request: one diagnostics channel each. */
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
   * What is stored under the key could not be read or compared: with encryption on, an entry that
   * does not open (altered, sealed with a key no longer configured, or not sealed); an entry or a
   * fingerprint of another version's format. Refused with 409, the handler not run.
   */
  | 'unreadable'
  /** A recovery point's function ran and its result was recorded; `step` names it. */
  | 'step-run'
  /** A recovery point returned the result recorded by an earlier run, without running; `step` names it. */
  | 'step-replay'

/** What a channel of `channels` publishes for one guarded request. */
export interface IdempotencyEvent {
  /** What happened. */
  outcome: IdempotencyOutcome
  /** The client's key (unscoped). */
  idempotencyKey: string
  /** The HTTP method, or `RUN` for `run(key, input, fn)`. */
  method: string
  /** The route pattern, e.g. `/orders/:id`. */
  route: string
  /** The storage class, e.g. `RedisStorage`. */
  store: string
  /** Milliseconds since the plugin started on this request (first store call). */
  durationMs: number
  /** The response's status code, when there is one. */
  statusCode?: number
  /** execute: whether the response was stored. */
  stored?: boolean
  /** Stored without its body (too large, a hijacked reply): the outcome only. */
  bodyOmitted?: boolean
  /** Why an executed request's response was not stored; `declined`: the route's `storeIf` returned false. */
  reason?: 'failed' | 'not-cacheable' | 'declined' | 'too-large' | 'interrupted' | 'hijacked' | 'lease-lost' | 'store-error'
  /** wait: how long the duplicate waited, ms. */
  waitedMs?: number
  /**
   * Where it happened; `max-hold`: renewal stopped because the request held its key for
   * `maxLockHold`; `close`: the app closed before the request's response was stored.
   */
  phase?: 'begin' | 'complete' | 'release' | 'renew' | 'max-hold' | 'close'
  /** store-error: whether the handler ran anyway (`failOpen`). */
  failOpen?: boolean
  /** The error, when one caused the outcome. */
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

/** An operation on stored keys, through `fastify.idempotency` or the `fastify-idempotency` command (docs/operations.md). */
export type IdempotencyOperation = 'inspect' | 'forget' | 'in-flight' | 'purge'

/** What an operation reports, for an audit: who did what to which key, and how it ended. */
export interface IdempotencyOperationEvent {
  /** Which operation. */
  operation: IdempotencyOperation
  /** Who asked: the call's `actor` option, or the command's user; `null` when nobody said. */
  actor: string | null
  /** Where from: `'app'` (`fastify.idempotency`) or `'command'`. */
  via: 'app' | 'command'
  /** The storage class, e.g. `RedisStorage`. */
  store: string
  /** inspect, forget: the client's key, as the operator gave it (unquoted). */
  idempotencyKey?: string
  /** inspect, forget: the scope given, or `null`. */
  scope?: string | null
  /** inspect: what was found; `body`: whether the body was read. */
  state?: 'absent' | 'in-flight' | 'stored'
  /** inspect: whether the body was read. */
  body?: boolean
  /** forget: whether a key in flight was to be removed too. */
  force?: boolean
  /** forget: `forgotten` or `refused`; what was under the key; how many recovery-point records went. */
  outcome?: 'forgotten' | 'refused'
  /** forget: what was under the key. */
  previous?: 'absent' | 'in-flight' | 'stored'
  /** forget: how many recovery-point records went. */
  recoveryPoints?: number
  /** in-flight: how many leases were listed, and whether that is all of them. */
  listed?: number
  /** in-flight: whether the leases listed are all of them. */
  complete?: boolean
  /** purge: how many expired entries went. */
  purged?: number
  /** The operation failed (the store is down, say), or the store does not offer it. */
  error?: unknown
  /** How long the operation took, ms. */
  durationMs: number
}

const operations: readonly IdempotencyOperation[] = ['inspect', 'forget', 'in-flight', 'purge']

/** One channel per operation: `fastify-idempotency:operation:<operation>`. */
export const operationChannels = Object.fromEntries(
  operations.map((operation) => [operation, diagnostics.channel(`${CHANNEL_PREFIX}operation:${operation}`)])
) as Record<IdempotencyOperation, diagnostics.Channel>

/**
 * One check of a store's start-up proof, as the plugin reports it when the app starts (and the
 * `doctor` command when it runs): what was checked, its outcome, what it found, and the cure.
 */
export interface IdempotencyStoreCheckEvent {
  /** The storage class, e.g. `RedisStorage`. */
  store: string
  /** What was checked: `'eviction policy'`, `'EVALSHA'`, `'DELETE'`… */
  check: string
  /** `passed`, `failed` (the app does not start), or `warning` (it starts, and says so). */
  outcome: 'passed' | 'failed' | 'warning'
  /** What the check found: on a failure, the server's own words. */
  found: string
  /** What to do about it, when it did not pass. */
  cure?: string
  /** Where from: `'app'` (the plugin, as the app starts) or `'command'` (`doctor`). */
  via: 'app' | 'command'
}

/** `fastify-idempotency:store-check`: each check of a store's start-up proof. */
export const storeCheckChannel = diagnostics.channel(`${CHANNEL_PREFIX}store-check`)
