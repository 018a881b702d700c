/**
 * What the engine knows about one guarded request that carries a key, and its phase. Every phase
 * is named, and every move between two of them is in PHASE_MOVES below; a move that is not there
 * throws, so a request can never be settled twice, replayed after it ran, or run after a refusal.
 *
 *   keyed ──startAcquiring──> acquiring ──┬──replay──────────> replayed
 *                                         ├──refuse──────────> refused
 *                                         ├──runUnprotected──> unprotected   (store down, failOpen)
 *                                         └──hold────────────> running       (the lease is ours, and
 *                                                                 │           in transaction mode
 *                                                                 │           its transaction open)
 *                                                                 │
 *                                                                 │ startSettling (onSend, or 'close'
 *                                                                 v  of a hijacked reply)
 *                                                              settling ──end──> ended
 *                                                                 │                ^
 *                     (storing failed: retried in the background  │ storeIn-       │
 *                     while the lease is held, see settle.ts)     v Background     │
 *                                                              storing ──end───────┘
 *
 * `replayed`, `refused`, `unprotected` and `ended` are final. A request is in flight (closing the
 * app waits for it, engine/in-flight.ts) while `acquiring`, `running`, `settling` or `storing`.
 *
 * Only what the engine decides with is kept here; what the HTTP adapter needs for itself (the
 * body as it arrived, the raw body's hash, whether the handler failed, the hand-on of the
 * response) lives in the adapter's own per-request context (http/request-context.ts).
 */
// Node's global `performance` is a getter that loads it on first use, and is called on every
// read: the module's own binding is not.
import { performance } from 'node:perf_hooks'
import type { StorageTransaction, StoredResponse } from '../storage/types.js'
import type { FingerprintComparison } from './fingerprint-check.js'
import type { RenewedLease } from './lease-renewal.js'
import type { Logger } from './report.js'
import { NO_RESPONSE_CALLBACKS, type ResponseCallbacks } from './route-callbacks.js'

export type Phase =
  /** The key was read; the store has not been asked yet. */
  | 'keyed'
  /** Asking the store (`begin`), and waiting for a duplicate in flight with `waitTimeout`. */
  | 'acquiring'
  /** Answered with a stored response; the handler does not run. */
  | 'replayed'
  /** Answered with an error (mismatch, in progress, store down, closing, unreadable); the handler does not run. */
  | 'refused'
  /** The store could not be reached and the route fails open: the handler runs without a lease. */
  | 'unprotected'
  /** The lease is held (and renewed), in transaction mode its transaction open: the handler runs. */
  | 'running'
  /** The response is being stored, or the key given back. */
  | 'settling'
  /** Storing failed and is retried in the background while the lease is held; the client has its answer. */
  | 'storing'
  /** Settled: stored, given back, or given up on. */
  | 'ended'

/** Every legal move: from a phase (key) to the phases listed. */
export const PHASE_MOVES: { readonly [From in Phase]: readonly Phase[] } = {
  keyed: ['acquiring'],
  acquiring: ['replayed', 'refused', 'unprotected', 'running'],
  running: ['settling'],
  settling: ['storing', 'ended'],
  storing: ['ended'],
  replayed: [],
  refused: [],
  unprotected: [],
  ended: []
}

/**
 * How a request keeps its phase: as a number, the phase's index in PHASES, with the moves each
 * allows as bits of those numbers (ALLOWED_MOVES, made from PHASE_MOVES). A move is then one bit
 * test. Kept as a name, each move looked the table up by a name that varies from call to call,
 * which V8 answers through its slowest lookup, about 200 instructions a move, four moves a request.
 */
const PHASES = Object.keys(PHASE_MOVES) as readonly Phase[]
const PHASE: { readonly [Name in Phase]: number } = Object.freeze(Object.fromEntries(PHASES.map((phase, index) => [phase, index])) as Record<Phase, number>)
const ALLOWED_MOVES: readonly number[] = PHASES.map((from) => PHASE_MOVES[from].reduce((bits, to) => bits | (1 << PHASE[to]), 0))

export class RequestState implements RenewedLease {
  /** The request's Idempotency-Key (unquoted). */
  readonly key: string
  /** The request's HTTP method, for events. */
  readonly method: string
  readonly log: Logger
  /** The route's `storeIf` and `redact`, bound to this request by the adapter. */
  readonly callbacks: ResponseCallbacks
  /** The phase's number (PHASE). */
  #phase = PHASE.keyed
  /** performance.now() when the plugin first went to the store for this request. */
  started = 0
  /** The key as the store sees it (see storage-key.ts); set by `startAcquiring`. */
  storageKey = ''
  /** The request's fingerprint; set by `startAcquiring`. */
  fingerprint = ''
  /** Compares a stored fingerprint that differs from `fingerprint` as text (see fingerprint-check.ts). */
  fingerprinted: FingerprintComparison | null = null
  /** The fencing token of the lease; set by `hold`. */
  token = ''
  /** Transaction mode: the transaction the handler writes through, committed with the stored response. */
  transaction: StorageTransaction | null = null
  /** The stored response this request is answered with; set by `replay`. */
  replayed: StoredResponse | null = null
  /** Names of the steps this run has reached (engine/steps.ts); `null` until the first. */
  steps: Set<string> | null = null
  /** A `complete` given up on at storeTimeout went through after all. */
  storedLate = false
  /** When the lease was acquired (epoch ms); renewal stops `maxLockHold` later. */
  acquiredAt = 0
  // Kept by LeaseRenewal while the lease is renewed.
  renewing = false
  renewedAt = 0
  previousHeld: RenewedLease | null = null
  nextHeld: RenewedLease | null = null

  constructor (key: string, method: string, log: Logger, callbacks: ResponseCallbacks = NO_RESPONSE_CALLBACKS) {
    this.key = key
    this.method = method
    this.log = log
    this.callbacks = callbacks
  }

  get phase (): Phase {
    return PHASES[this.#phase]!
  }

  /** The store is asked about this request, which is known by `storageKey` and `fingerprint`. */
  startAcquiring (storageKey: string, fingerprint: string, fingerprinted: FingerprintComparison | null): void {
    this.#move(PHASE.acquiring)
    this.started = performance.now()
    this.storageKey = storageKey
    this.fingerprint = fingerprint
    this.fingerprinted = fingerprinted
  }

  /** A stored response answers this request. */
  replay (response: StoredResponse): void {
    this.#move(PHASE.replayed)
    this.replayed = response
  }

  /** An error answers this request (before its handler ran, or instead of running it). */
  refuse (): void {
    this.#move(PHASE.refused)
  }

  /** The handler runs without a lease (failOpen). */
  runUnprotected (): void {
    this.#move(PHASE.unprotected)
  }

  /** The lease, taken at `acquiredAt` (epoch ms), is ours: the handler may run. */
  hold (token: string, acquiredAt = Date.now()): void {
    this.#move(PHASE.running)
    this.token = token
    this.acquiredAt = acquiredAt
  }

  /** The handler's response is known: store it or give the key back (settle.ts). */
  startSettling (): void {
    this.#move(PHASE.settling)
  }

  /** Storing failed: it goes on in the background, the lease held. */
  storeInBackground (): void {
    this.#move(PHASE.storing)
  }

  /** Settled. */
  end (): void {
    this.#move(PHASE.ended)
  }

  #move (to: number): void {
    if ((ALLOWED_MOVES[this.#phase]! & (1 << to)) === 0) throw new Error(`fastify-idempotency: a request in phase ${PHASES[this.#phase]} cannot move to ${PHASES[to]}`)
    this.#phase = to
  }
}
