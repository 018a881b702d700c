import { shareIdentity } from './error-identity.js'

/**
 * An error the stores raise themselves (beyond their drivers' own). The plugin meets it as the
 * `cause` of a 503 (`IdempotencyStoreUnavailableError`): the request is refused, the handler does
 * not run, and the cause is there for the logs. Custom stores may raise it too.
 */

/**
 * `begin` could not settle one key: each round found the row changed again by other requests
 * (takeovers racing expiry). A retry normally succeeds.
 */
export class StoreContentionError extends Error {
  /** Fastify's error code. */
  readonly code = 'FST_IDEMPOTENCY_STORE_CONTENTION'
  constructor (message: string) {
    super(message)
    this.name = 'StoreContentionError'
  }
}
shareIdentity(StoreContentionError, 'StoreContentionError')
