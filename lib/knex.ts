/**
 * `fastify-idempotency/knex`: KnexStorage (PostgreSQL, MySQL/MariaDB, SQLite), its table's
 * schema functions for migrations, and `transactionOf` for handlers in transaction mode.
 *
 * @module fastify-idempotency/knex
 */
import type { FastifyRequest } from 'fastify'
import type { Knex } from 'knex'

export { KnexStorage, type KnexStorageOptions, type PurgeExpiredOptions } from './storage/knex/index.js'
export {
  createIdempotencyTable,
  createInFlightIndex,
  dropIdempotencyTable,
  DEFAULT_TABLE_NAME,
  MAX_KEY_BYTES,
  type SqlDialect
} from './storage/knex/schema.js'

/**
 * The knex transaction of a request on a route in transaction mode (`transaction: true`), or of a
 * function run with `run` in transaction mode (its context), typed. Throws when there is none (not
 * in transaction mode, or a request without a key).
 */
export function transactionOf (requestOrContext: FastifyRequest | { readonly transaction: unknown }): Knex.Transaction {
  // A request has its raw message; a run's context has none.
  const transaction = 'raw' in requestOrContext
    ? (requestOrContext as FastifyRequest & { idempotency?: { transaction?: unknown } | null }).idempotency?.transaction
    : requestOrContext.transaction
  if (transaction === undefined || transaction === null) {
    throw new Error('fastify-idempotency: there is no transaction here (is it in transaction mode, with KnexStorage, and did the request carry an Idempotency-Key?)')
  }
  return transaction as Knex.Transaction
}
