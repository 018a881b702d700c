/**
 * What a consumer does with an error `run` threw: one classification, so that no consumer of a
 * broker or a job queue inspects error classes (docs/jobs.md#what-a-failure-means). Every error
 * `run` can throw falls in one of five kinds, each with the one thing a delivery can do about it:
 *
 *   retry      nothing ran: run it again after `delayMs` (the key's holder is done by then, or its
 *              lease lapsed; the store may be back), in this process or by a delayed redelivery
 *   release    this process is closing: hand the message back at once, for another consumer
 *   done       the work ran, and its result is not to be had: acknowledge it, do not run it again
 *   give-up    no delivery of this message can succeed: dead-letter it, with `why`
 *   failed     an attempt failed: the work threw, or its writes were rolled back with its result;
 *              the caller's policy decides (a broker's delivery limit, a queue's attempts)
 */
import {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyLeaseLostError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError
} from '../errors.js'

/** What to do with a message (a job, a delivery) whose `run` threw `error`. */
export type RetryDecision =
  /**
   * Nothing ran: run it again after `delayMs`. `'in-progress'`: another delivery holds the key;
   * by then it is done (a duplicate gets its result) or its lease lapsed (its holder died: this one
   * runs it). `'store-unavailable'`: the store could not be reached.
   */
  | {
    /** What to do. */ kind: 'retry'
    /** Why, in one word. */ reason: 'in-progress' | 'store-unavailable'
    /** How long to wait before running it again, in milliseconds. */ delayMs: number
    /** The error `run` threw. */ error: IdempotencyError
  }
  /** `run` was closing (`close()`, `app.close()`): nothing ran; hand the message back for another consumer. */
  | {
    /** What to do. */ kind: 'release'
    /** Why, in one word. */ reason: 'closing'
    /** The error `run` threw. */ error: IdempotencyError
  }
  /**
   * The work ran, and its result is not to be had: acknowledge the message. `'result-not-recorded'`:
   * it ran before, and its result could not be kept; `'lease-lost'`: it ran now, and its lease
   * ended before its result was kept.
   */
  | {
    /** What to do. */ kind: 'done'
    /** Why, in one word. */ reason: 'result-not-recorded' | 'lease-lost'
    /** The error `run` threw. */ error: IdempotencyError
  }
  /**
   * No delivery of this message can succeed: dead-letter it. `why` says so in words, for the
   * dead-letter's headers or a log line.
   */
  | {
    /** What to do. */ kind: 'give-up'
    /** Why, in one word. */ reason: 'fingerprint-mismatch' | 'key-invalid' | 'input-unusable' | 'entry-unreadable'
    /** Why, in words, for a dead-letter's headers or a log line. */ why: string
    /** The error `run` threw. */ error: IdempotencyError
  }
  /**
   * An attempt failed: the work threw (`error` is its own error, whatever its class), or its
   * writes were rolled back with its result (transaction mode). Nothing is kept: the caller's
   * policy decides how often to try again.
   */
  | {
    /** What to do. */ kind: 'failed'
    /** What the work threw, whatever its class, or the refusal of a rolled-back commit. */ error: unknown
  }

/** How long to wait before asking again when the store could not be reached. */
const STORE_RETRY_MS = 1000

/**
 * The errors of attempts that ran the work and failed: what the work threw, and the refusal of a
 * result rolled back with the work's writes. Kept in the global registry, so that a copy of this
 * module in another bundle of the package (the standalone entry and the plugin's) knows them too.
 */
const failedAttempts: WeakSet<object> = (globalThis as Record<symbol, WeakSet<object> | undefined>)[Symbol.for('fastify-idempotency.failedAttempts')] ??= new WeakSet()

/** Mark `error` as the failure of an attempt that ran the work (an error object; other values are failures anyway). */
export function markFailedAttempt (error: unknown): void {
  if (typeof error === 'object' && error !== null) failedAttempts.add(error)
}

/**
 * What to do with a message whose `run` threw `error`: retry after a pause, release, done,
 * give up, or the attempt's own failure (the caller's policy). See docs/jobs.md.
 */
export function retryDecision (error: unknown): RetryDecision {
  if (!(error instanceof IdempotencyError) || failedAttempts.has(error)) return { kind: 'failed', error }
  if (error instanceof IdempotencyRequestInProgressError) return { kind: 'retry', reason: 'in-progress', delayMs: afterLeaseEnds(error.leaseEndsInMs), error }
  if (error instanceof IdempotencyStoreUnavailableError) return { kind: 'retry', reason: 'store-unavailable', delayMs: STORE_RETRY_MS, error }
  if (error instanceof IdempotencyServerClosingError) return { kind: 'release', reason: 'closing', error }
  if (error instanceof IdempotencyResultNotRecordedError) return { kind: 'done', reason: 'result-not-recorded', error }
  if (error instanceof IdempotencyLeaseLostError) return { kind: 'done', reason: 'lease-lost', error }
  // Those of requests alone (a missing key, an unresolved scope) come from the caller's own code.
  return giveUp(error) ?? { kind: 'failed', error }
}

/** The refusals no delivery can turn into a success; `null` for any other error. */
function giveUp (error: IdempotencyError): RetryDecision | null {
  if (error instanceof IdempotencyFingerprintMismatchError) return { kind: 'give-up', reason: 'fingerprint-mismatch', why: 'another input was run under this key', error }
  if (error instanceof IdempotencyKeyInvalidError) return { kind: 'give-up', reason: 'key-invalid', why: `the key is not usable: ${error.message}`, error }
  if (error instanceof IdempotencyFingerprintError || error instanceof IdempotencyFingerprintUnsupportedError) {
    return { kind: 'give-up', reason: 'input-unusable', why: `the input cannot be fingerprinted: ${error.message}`, error }
  }
  if (error instanceof IdempotencyStoredResponseUnreadableError) return { kind: 'give-up', reason: 'entry-unreadable', why: 'what the store holds for this key cannot be read by this process', error }
  return null
}

/**
 * A little after the holder's lease ends: its end is read on one clock and lapses on another
 * (the store's), so coming back right at it may find it held still, and cost another return.
 */
function afterLeaseEnds (leaseEndsInMs: number): number {
  return leaseEndsInMs + Math.min(1000, Math.max(100, Math.round(leaseEndsInMs / 16)))
}
