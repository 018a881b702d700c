/**
 * What the plugin knows about one guarded request that carries a key, and the legal moves of its
 * phase:
 *
 *   idle ──hold()──> held ──settle()──> settling
 *     └───replay()──> replayed
 *
 * `idle` covers a request that was refused (mismatch, in progress, store down) too: nothing
 * happens to it after that. Only a request that holds the lease is ever settled, and only once.
 */
import type { ArrivedBody } from '../fingerprint/fingerprint.js'
import type { StorageTransaction, StoredResponse } from '../storage/types.js'
import type { FingerprintVerdict } from './fingerprint-check.js'
import type { RenewedLease } from './lease-renewal.js'
import type { Logger } from './report.js'

export type Phase = 'idle' | 'held' | 'settling' | 'replayed'

export class RequestState implements RenewedLease {
  /** The request's Idempotency-Key (unquoted). */
  readonly key: string
  /** The request's HTTP method, for events. */
  readonly method: string
  readonly log: Logger
  #phase: Phase = 'idle'
  /** performance.now() when the plugin first went to the store for this request. */
  started = 0
  /** The key as the store sees it (see storage-key.ts); set when the plugin first goes to the store. */
  storageKey = ''
  /** The fencing token of the lease; set by `hold`. */
  token = ''
  /** The handler (or a hook after ours) failed: whatever status the error handler picks, nothing is stored. */
  failed = false
  /** Transaction mode: the transaction the handler writes through, committed with the stored response. */
  transaction: StorageTransaction | null = null
  /** The stored response this request is answered with; set by `replay`. */
  replayed: StoredResponse | null = null

  /** The body as it arrived, taken before validation (for the hooks). */
  arrivedBody: ArrivedBody | null = null
  /** With `fingerprint: { body: 'raw' }`: the hash of the raw body, as it is read (for the hooks). */
  rawBody: { digest: (limit: number) => Promise<string> } | null = null
  /** Resolves once this request's response has been handed on to Fastify after settling (for the hooks). */
  handedOn: Promise<void> | null = null
  /** The request's fingerprint; set with `storageKey`. */
  fingerprint = ''
  /** Compares a stored fingerprint that differs from `fingerprint` as text (set by the hooks; see fingerprint-check.ts). */
  fingerprinted: { compare: (stored: string) => FingerprintVerdict } | null = null
  /** Names of the steps this run has reached (engine/steps.ts); `null` until the first. */
  steps: Set<string> | null = null
  /** The route's `storeIf`, bound to this request; `null` when the route has none. */
  storeIf: ((response: StoredResponse) => boolean | Promise<boolean>) | null = null
  /** The route's `redact`, bound to this request; `null` when the route has none. */
  redact: ((response: StoredResponse) => StoredResponse | Promise<StoredResponse>) | null = null
  /** A `complete` given up on at storeTimeout went through after all. */
  storedLate = false
  /** When the lease was acquired (epoch ms); renewal stops `maxLockHold` later. */
  acquiredAt = 0
  // Kept by LeaseRenewal while the lease is renewed.
  renewing = false
  renewedAt = 0
  previousHeld: RenewedLease | null = null
  nextHeld: RenewedLease | null = null

  constructor (key: string, method: string, log: Logger) {
    this.key = key
    this.method = method
    this.log = log
  }

  get phase (): Phase {
    return this.#phase
  }

  /** The lease is ours: the handler may run. */
  hold (token: string): void {
    this.#expect('idle', 'hold')
    this.#phase = 'held'
    this.token = token
    this.acquiredAt = Date.now()
  }

  /** A stored response answers this request. */
  replay (response: StoredResponse): void {
    this.#expect('idle', 'replay')
    this.#phase = 'replayed'
    this.replayed = response
  }

  /** Begin storing or releasing; `false` when that has begun already (or there is no lease). */
  settle (): boolean {
    if (this.#phase !== 'held') return false
    this.#phase = 'settling'
    return true
  }

  #expect (phase: Phase, move: string): void {
    if (this.#phase !== phase) throw new Error(`fastify-idempotency: cannot ${move} a request in phase ${this.#phase}`)
  }
}
