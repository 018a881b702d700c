/**
 * KnexStorage's options, and how they are checked before a dialect is built from them.
 */
import type { Knex } from 'knex'
import type { StoragePurgeOptions } from '../types.js'
import type { DialectOptions } from './dialect.js'
import { DEFAULT_TABLE_NAME } from './schema.js'

/** Options of `new KnexStorage()` (docs/stores/knex.md). */
export interface KnexStorageOptions {
  /** A knex instance (pg, mysql2/mysql, better-sqlite3/sqlite3). Never destroyed by the storage. */
  knex: Knex
  /** Table holding keys, leases and responses; may be schema-qualified. Default `'idempotency_keys'`. */
  tableName?: string
  /** Create the table and its index on first use if missing (`CREATE TABLE IF NOT EXISTS`). Default `false`. */
  createTable?: boolean
  /**
   * Clock in epoch milliseconds, for tests that move time. By default leases and expiries are
   * measured by the database's clock when they are written, so no wait for a pool connection or
   * a row lock can shorten them.
   */
  now?: () => number
  /**
   * The longest one statement may run, in ms (PostgreSQL, MySQL/MariaDB), so a row locked by
   * another transaction (a migration, a long batch job) never keeps a pooled connection busy. On
   * PostgreSQL the server gives up a lock wait past it (`lock_timeout`, set in the statement's own
   * transaction, so it works through a pooler), and on a direct connection the statement is also
   * cancelled past it. Keep it below the plugin's `storeTimeout`. 0 disables it. Default 4000.
   */
  statementTimeout?: number
  /**
   * PostgreSQL: send the store's statements as named prepared statements, parsed and planned once
   * per connection. By default yes on a direct connection, no behind a pooler (PgBouncer), which
   * the store recognizes. `true` behind a pooler that keeps them (PgBouncer 1.21+ with
   * `max_prepared_statements`); `false` never.
   */
  preparedStatements?: boolean
}

/**
 * Options of `KnexStorage.purgeExpired()`: `batchSize` (rows deleted per statement, so a large
 * purge never holds long locks; default 1000), `onProgress` and `signal`.
 */
export type PurgeExpiredOptions = StoragePurgeOptions

/** Below the plugin's default storeTimeout (5 s), so the store cancels before the plugin gives up. */
const DEFAULT_STATEMENT_TIMEOUT = 4000

/** The options, checked, as a dialect is built from them. */
export function dialectOptions (options: KnexStorageOptions): DialectOptions {
  if (options === null || typeof options !== 'object') throw new TypeError('KnexStorage: options { knex } are required')
  const table = options.tableName ?? DEFAULT_TABLE_NAME
  if (typeof table !== 'string' || table.length === 0) throw new TypeError('KnexStorage: tableName must be a non-empty string')
  if (options.now !== undefined && typeof options.now !== 'function') throw new TypeError('KnexStorage: now must be a function')
  const statementTimeout = options.statementTimeout ?? DEFAULT_STATEMENT_TIMEOUT
  if (!Number.isSafeInteger(statementTimeout) || statementTimeout < 0) throw new TypeError('KnexStorage: statementTimeout must be a whole number of milliseconds, or 0')
  if (options.preparedStatements !== undefined && typeof options.preparedStatements !== 'boolean') throw new TypeError('KnexStorage: preparedStatements must be a boolean')
  return { knex: options.knex, table, statementTimeout, now: options.now, namedStatements: options.preparedStatements }
}
