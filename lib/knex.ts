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
 * The knex transaction of a request on a route in transaction mode (`transaction: true`), typed.
 * Throws when the request has none (the route is not in transaction mode, or has no key).
 */
export function transactionOf (request: FastifyRequest): Knex.Transaction {
  const transaction = (request as FastifyRequest & { idempotency?: { transaction?: unknown } | null }).idempotency?.transaction
  if (transaction === undefined || transaction === null) {
    throw new Error('fastify-idempotency: this request has no transaction (is the route in transaction mode, with KnexStorage, and did the request carry an Idempotency-Key?)')
  }
  return transaction as Knex.Transaction
}
