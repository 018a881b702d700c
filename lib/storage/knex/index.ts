/**
 * KnexStorage: an IdempotencyStorage on PostgreSQL, MySQL/MariaDB or SQLite through knex.
 *
 * One row per key, the key as primary key. `begin` is a single conditional upsert that takes the
 * row when it is absent, expired or its lease lapsed, so two requests can never both hold a key;
 * `complete`, `release` and `renew` are single statements conditioned on the fencing token. What
 * differs per database is in its dialect module (postgres.ts, mysql.ts, sqlite.ts), chosen once
 * here; waiting on PostgreSQL is pg-listener.ts. All times are epoch milliseconds from the
 * database's clock, read when a statement writes (see Clock in dialect.ts).
 */
import { setImmediate, setTimeout as sleep } from 'node:timers/promises'
import type { Knex } from 'knex'
import { duration } from '../durations.js'
import { StoreContentionError } from '../errors.js'
import { TokenGenerator } from '../tokens.js'
import type { BeginResult, StorageForgetOptions, StorageForgetResult, LeaseListing, StorageTransaction, StoredResponse, StoredState, TransactionalStorage } from '../types.js'
import type { Dialect } from './dialect.js'
import { MysqlDialect } from './mysql.js'
import { forgetRow, inspectRow, listLeaseRows, type TableView } from './operations.js'
import { PgListener } from './pg-listener.js'
import { PostgresDialect } from './postgres.js'
import { encodeKey, outcomeUnknown, toBuffer, trimmed } from './rows.js'
import { createIdempotencyTable, DEFAULT_TABLE_NAME, sqlDialect, type SqlDialect } from './schema.js'
import { SqliteDialect } from './sqlite.js'

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
   * The longest one statement may run, in ms; past it the server cancels it (PostgreSQL,
   * MySQL/MariaDB), so a row locked by another transaction (a migration, a long batch job) never
   * keeps a pooled connection busy. Keep it below the plugin's `storeTimeout`. 0 disables it.
   * Default 4000.
   */
  statementTimeout?: number
  /**
   * PostgreSQL: send the store's statements as named prepared statements, parsed and planned once
   * per connection. Default `true`. Set `false` behind a pooler that cannot keep them (PgBouncer
   * in transaction mode before 1.21).
   */
  preparedStatements?: boolean
}

export interface PurgeExpiredOptions {
  /** Rows deleted per statement, so a large purge never holds long locks. Default 1000. */
  batchSize?: number
}

/**
 * How often `begin` starts over when the row it lost to changed before it could be read (a purge,
 * a release, an expiry in between). Each round needs a concurrent change to fail, so a few suffice.
 */
const BEGIN_ROUNDS = 10
/** Retries of a statement chosen as a deadlock victim (it was rolled back whole, so it can rerun). */
const DEADLOCK_RETRIES = 5

/** Below the plugin's default storeTimeout (5 s), so the store cancels before the plugin gives up. */
const DEFAULT_STATEMENT_TIMEOUT = 4000

function pickDialect (knex: Knex, table: string, statementTimeout: number, now: (() => number) | undefined, prepared: boolean): Dialect {
  const name = sqlDialect(knex)
  if (name === 'postgres') return new PostgresDialect(table, statementTimeout, now, prepared)
  if (name === 'mysql') return new MysqlDialect(table, statementTimeout, now)
  return new SqliteDialect(table, now)
}

export class KnexStorage implements TransactionalStorage {
  readonly #knex: Knex
  readonly #table: string
  readonly #dialect: Dialect
  readonly #createTable: boolean
  readonly #tokens = new TokenGenerator()
  /** The clock tokens are dated with (see tokens.ts). */
  readonly #now: () => number
  /** What the operations (inspect, forget, listInFlight) see of this storage. */
  readonly #view: TableView
  #ready: Promise<void> | undefined
  #prepared = false
  readonly #listener: PgListener | undefined

  /**
   * PostgreSQL only (the property is absent on MySQL/MariaDB and SQLite, where the plugin polls
   * `begin` instead): resolve once the lease on `key` was completed or released (woken by
   * LISTEN/NOTIFY, from any process), or lapsed, or after `timeout` ms. See pg-listener.ts.
   */
  declare readonly waitFor?: (key: string, timeout: number) => Promise<void>

  constructor (options: KnexStorageOptions) {
    if (options === null || typeof options !== 'object') throw new TypeError('KnexStorage: options { knex } are required')
    const tableName = options.tableName ?? DEFAULT_TABLE_NAME
    if (typeof tableName !== 'string' || tableName.length === 0) throw new TypeError('KnexStorage: tableName must be a non-empty string')
    if (options.now !== undefined && typeof options.now !== 'function') throw new TypeError('KnexStorage: now must be a function')
    const statementTimeout = options.statementTimeout ?? DEFAULT_STATEMENT_TIMEOUT
    if (!Number.isSafeInteger(statementTimeout) || statementTimeout < 0) throw new TypeError('KnexStorage: statementTimeout must be a whole number of milliseconds, or 0')
    if (options.preparedStatements !== undefined && typeof options.preparedStatements !== 'boolean') throw new TypeError('KnexStorage: preparedStatements must be a boolean')
    this.#dialect = pickDialect(options.knex, tableName, statementTimeout, options.now, options.preparedStatements ?? true)
    this.#knex = options.knex
    this.#table = tableName
    this.#createTable = options.createTable === true
    this.#now = options.now ?? Date.now
    const dialect = this.#dialect
    this.#view = { knex: options.knex, table: tableName, clock: dialect.clock, bound: dialect.bound }
    if (dialect instanceof PostgresDialect) {
      this.#view.wake = async (id) => { await dialect.bound(options.knex.raw('SELECT pg_notify(?, ?)', [dialect.channel, id.toString('base64')])) }
    }
    if (this.#dialect instanceof PostgresDialect && PgListener.canListen(options.knex)) {
      const listener = new PgListener({
        knex: options.knex,
        table: tableName,
        channel: this.#dialect.channel,
        bound: this.#dialect.bound,
        clock: this.#dialect.clock,
        retrying: (statement) => this.#retrying(statement),
        prepare: () => this.#prepare()
      })
      this.#listener = listener
      this.waitFor = (key, timeout) => listener.waitFor(encodeKey(key), timeout)
    }
  }

  /** The table this storage uses. */
  get tableName (): string {
    return this.#table
  }

  /** SQLite: knex gives it one connection, which an open transaction holds. */
  get singleConnection (): boolean {
    return this.#dialect.name === 'sqlite'
  }

  /** The SQL family of the knex instance: `'postgres'`, `'mysql'` or `'sqlite'`. */
  get dialect (): SqlDialect {
    return this.#dialect.name
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    const id = encodeKey(key)
    const lease = duration('KnexStorage', 'lockTimeout', lockTimeout)
    if (typeof fingerprint !== 'string') throw new TypeError('KnexStorage: the fingerprint must be a string')
    if (!this.#prepared) await this.#prepare()
    const token = this.#tokens.next(this.#now())
    for (let round = 0; round < BEGIN_ROUNDS; round++) {
      const result = await this.#retrying(() => this.#dialect.begin(this.#knex, this.#table, { id, fingerprint, token, lease })).catch((error: unknown) => {
        // The statement may have taken the lease though its answer was lost: give it back (fenced
        // by this call's token), rather than block the key until the lease lapses.
        if (this.#dialect.name !== 'sqlite' && outcomeUnknown(error)) this.#retrying(() => this.#dialect.release(this.#knex, this.#table, id, token)).catch(() => {})
        throw error
      })
      if (result !== undefined) return result
    }
    throw new StoreContentionError(`KnexStorage: begin did not settle after ${BEGIN_ROUNDS} rounds of concurrent changes to one key`)
  }

  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    return await this.#complete(this.#knex, key, token, response, expiration)
  }

  /**
   * Transaction mode: a knex transaction for the handler's writes, in which `complete` writes the
   * stored response with the same fenced statement as above, so both commit or neither does.
   */
  async transaction (): Promise<StorageTransaction> {
    if (!this.#prepared) await this.#prepare()
    const trx = await this.#knex.transaction()
    // A failed COMMIT rejects the transaction's own promise as well as commit()'s; the caller
    // handles the latter, so the former must not surface as an unhandled rejection.
    trx.executionPromise.catch(() => {})
    return {
      handle: trx,
      complete: (key, token, response, expiration) => this.#complete(trx, key, token, response, expiration),
      commit: async () => { await trx.commit() },
      rollback: async () => { if (!trx.isCompleted()) await trx.rollback() }
    }
  }

  async release (key: string, token: string): Promise<boolean> {
    const id = encodeKey(key)
    if (!this.#prepared) await this.#prepare()
    return await this.#retrying(() => this.#dialect.release(this.#knex, this.#table, id, token)) === 1
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const id = encodeKey(key)
    const lease = duration('KnexStorage', 'lockTimeout', lockTimeout)
    if (!this.#prepared) await this.#prepare()
    return await this.#retrying(() => this.#dialect.renew(this.#knex, this.#table, id, token, lease)) === 1
  }

  /**
   * Delete expired responses and lapsed leases, `batchSize` rows per statement, and return how
   * many rows went. Rows that expire while the purge runs are left for the next run. Nothing
   * depends on it for correctness (`begin` never replays an expired row); it only bounds the
   * table's size.
   */
  async purgeExpired (options: PurgeExpiredOptions = {}): Promise<number> {
    const batchSize = options.batchSize ?? 1000
    if (!Number.isSafeInteger(batchSize) || batchSize < 1) throw new TypeError('KnexStorage: batchSize must be a positive integer')
    if (!this.#prepared) await this.#prepare()
    let total = 0
    for (;;) {
      const { chosen, deleted } = await this.#retrying(() => this.#dialect.purgeBatch(this.#knex, this.#table, batchSize))
      total += deleted
      // A short batch means nothing expired is left (or another purge is taking it).
      if (chosen < batchSize) return total
      // Let requests in between batches: better-sqlite3 answers synchronously, so without this a
      // purge of a million rows held the event loop for its whole length (no request answered).
      await setImmediate()
    }
  }

  async inspect (key: string): Promise<StoredState> {
    if (!this.#prepared) await this.#prepare()
    return await this.#retrying(() => inspectRow(this.#view, key))
  }

  /** The related keys are a range of the primary key: one indexed DELETE. */
  async forget (key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
    if (!this.#prepared) await this.#prepare()
    return await this.#retrying(() => forgetRow(this.#view, key, options))
  }

  /**
   * Through the in-flight index (`createInFlightIndex`); on a table created before it, by reading
   * the whole table.
   */
  async listInFlight (options: { limit: number }): Promise<LeaseListing> {
    if (!this.#prepared) await this.#prepare()
    return await this.#retrying(() => listLeaseRows(this.#view, options.limit))
  }

  /**
   * End the listening connection, if a wait opened one; pending waits resolve (their callers ask
   * `begin` again). The knex instance belongs to the caller, who destroys it. The storage stays
   * usable: a later wait opens a new connection.
   */
  async close (): Promise<void> {
    await this.#listener?.close()
  }

  async #complete (db: Knex | Knex.Transaction, key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    const id = encodeKey(key)
    const ttl = duration('KnexStorage', 'expiration', expiration)
    const body = response.bodyOmitted === true ? null : toBuffer(response.body)
    const headers = JSON.stringify(response.headers ?? {})
    if (!this.#prepared) await this.#prepare()
    const completion = { id, token, statusCode: response.statusCode, contentType: response.contentType ?? null, headers, body, ttl }
    const statement = (): Promise<number> => this.#dialect.complete(db, this.#table, completion)
    // Inside a transaction a deadlock aborts the whole transaction: retrying one statement of it
    // would be wrong, so only the stand-alone statement is retried.
    const changed = db === this.#knex ? await this.#retrying(statement) : await statement().catch((error: unknown) => { throw trimmed(error) })
    return changed === 1
  }

  #prepare (): Promise<void> {
    this.#ready ??= this.#init().then(() => { this.#prepared = true }, (error: unknown) => {
      // A failed start (server down, no privileges) must not poison every later call.
      this.#ready = undefined
      throw error
    })
    return this.#ready
  }

  async #init (): Promise<void> {
    if (this.#createTable) await createIdempotencyTable(this.#knex, this.#table)
    await this.#dialect.prepare(this.#knex)
  }

  /** Run one statement again when the server picked it as a deadlock victim. */
  async #retrying<T> (statement: () => PromiseLike<T>): Promise<T> {
    for (let attempt = 0; ; attempt++) {
      try {
        return await statement()
      } catch (error) {
        if (attempt >= DEADLOCK_RETRIES || !this.#dialect.isDeadlock(error)) throw trimmed(error)
        // A little jitter, so the two sides of the deadlock do not collide again in step.
        await sleep(Math.random() * 5 * (attempt + 1))
      }
    }
  }
}
