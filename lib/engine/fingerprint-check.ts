/**
 * Whether a request is the one an entry (or a lease in flight) was stored for. The stored
 * fingerprint is compared as text first, which settles every request whose options have not
 * changed since; only when that differs is the request fingerprinted again, by whoever set
 * the comparison the adapter handed to `acquire` (`state.fingerprinted`), under the option set the
 * entry was made with.
 */
import { IdempotencyFingerprintMismatchError, IdempotencyStoredResponseUnreadableError, type IdempotencyError } from '../errors.js'
import type { RequestState } from './request-state.js'
import type { RouteEngine } from './route-engine.js'

/**
 * How a stored fingerprint compares with a request: the same request, a different one, or an
 * Error saying why they cannot be compared (a fingerprint of an unknown version, say).
 */
export type FingerprintVerdict = 'same' | 'different' | Error

/** Compares a stored fingerprint that differs from the request's own as text. */
export interface FingerprintComparison {
  compare: (stored: string) => FingerprintVerdict
}

/** `null` when the request is the stored one; otherwise the refusal to answer it with. */
export function fingerprintRefusal ({ settings, reporter }: RouteEngine, state: RequestState, stored: string): IdempotencyError | null {
  if (stored === state.fingerprint) return null
  const verdict = state.fingerprinted === null ? 'different' : state.fingerprinted.compare(stored)
  if (verdict === 'same') return null
  if (verdict === 'different') {
    reporter.report(state, 'mismatch', {}, 'debug', 'idempotency key reused with another fingerprint')
    return new IdempotencyFingerprintMismatchError(state.key, settings.mismatchStatusCode)
  }
  reporter.report(state, 'unreadable', { error: verdict }, 'error', 'idempotency stored fingerprint cannot be compared with this request: refused with 409, the handler not run')
  return new IdempotencyStoredResponseUnreadableError(state.key, verdict)
}
