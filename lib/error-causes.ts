/**
 * Errors an application meets as the `cause` of one of the plugin's errors (or, for
 * BodyTooLargeError, in its own error handler), each with a type guard: what `isIdempotencyError`
 * is for the plugin's own errors. docs/errors.md#causes says when each occurs.
 */
import { BodyNestedTooDeeplyError } from './fingerprint/canonical-value.js'
import { StoreTimeoutError } from './engine/store-deadline.js'
import { BodyTooLargeError } from './http/raw-body.js'
import { StoreContentionError } from './storage/errors.js'
import { UnreadableEntryError } from './storage/unreadable-entry.js'

export { BodyNestedTooDeeplyError, BodyTooLargeError, StoreContentionError, StoreTimeoutError }

/** A store call that did not answer within `storeTimeout` (the cause of a 503). */
export function isStoreTimeoutError (error: unknown): error is StoreTimeoutError {
  return error instanceof StoreTimeoutError
}

/** A key that `begin` could not settle under concurrent changes (the cause of a 503). */
export function isStoreContentionError (error: unknown): error is StoreContentionError {
  return error instanceof StoreContentionError
}

/** A stored entry that cannot be opened or read (the cause of "stored response unreadable"). */
export function isUnreadableEntryError (error: unknown): error is UnreadableEntryError {
  return error instanceof UnreadableEntryError
}

/** A body nested too deeply to fingerprint (the cause of "fingerprint failed"). */
export function isBodyNestedTooDeeplyError (error: unknown): error is BodyNestedTooDeeplyError {
  return error instanceof BodyNestedTooDeeplyError
}

/** A body over the route's limit, met while the plugin read it for its fingerprint (a 413). */
export function isBodyTooLargeError (error: unknown): error is BodyTooLargeError {
  return error instanceof BodyTooLargeError
}
