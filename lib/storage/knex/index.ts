/**
 * KnexStorage: an IdempotencyStorage on PostgreSQL, MySQL/MariaDB or SQLite through knex.
 *
 * One row per key, the key as primary key. `begin` takes the lease with a single conditional
 * upsert that takes the row when it is absent, expired or its lease lapsed, so two requests can
 * never both hold a key; `complete`, `release` and `renew` are single statements conditioned on
 * the fencing token. This file is the storage contract; each step is its dialect's (dialect.ts:
 * takeLease, storeResponse, giveBack, renewLease, readEntry, purgeBatch), built once here for the
 * knex instance and the table (postgres.ts, mysql.ts, sqlite.ts); waiting on PostgreSQL is
 * pg-listener.ts. All times are epoch milliseconds from the database's clock, read when a
 * statement writes (see Clock in dialect.ts).
 */
import { setImmediate, setTimeout as sleep } from 'node:timers/promises'
import type { Knex } from 'knex'
import { duration } from '../durations.js'
import { StoreContentionError } from '../errors.js'
import { TokenGenerator } from '../tokens.js'
import { readyWhenProven } from '../proof.js'
import type { BeginResult, StorageForgetOptions, StorageForgetResult, LeaseListing, StoreCheck, StoreProofOptions, StorageTransaction, StoredResponse, StoredState, TransactionalStorage, TransactionOptions } from '../types.js'
import type { Completion, Dialect, DialectOptions } from './dialect.js'
import { MysqlDialect } from './mysql.js'
import { dialectOptions, type KnexStorageOptions, type PurgeExpiredOptions } from './storage-options.js'
import { forgetRow, inspectRow, listLeaseRows } from './operations.js'
import { PgListener } from './pg-listener.js'
import { proveKnex } from './proof.js'
import { PostgresDialect } from './postgres.js'
import { openTransaction, type OpenedTransaction } from './request-transaction.js'
import { RequestSlots, poolSize } from './request-slots.js'
import { encodeKey, outcomeUnknown, toBuffer, trimmed } from './rows.js'
import { ensureIdempotencyTable, sqlDialect, type SqlDialect } from './schema.js'
import { SqliteDialect } from './sqlite.js'

export type { KnexStorageOptions, PurgeExpiredOptions } from './storage-options.js'

/**
 * How often `begin` starts over when the row it lost to changed before it could be read (a purge,
 * a release, an expiry in between). Each round needs a concurrent change to fail, so a few suffice.
 */
const BEGIN_ROUNDS = 10
/** Retries of a statement chosen as a deadlock victim (it was rolled back whole, so it can rerun). */
const DEADLOCK_RETRIES = 5

/** The dialect of the knex instance's database, for the storage's table. */
function dialectFor (options: DialectOptions): Dialect {
  const name = sqlDialect(options.knex)
  if (name === 'postgres') return new PostgresDialect(options)
  if (name === 'mysql') return new MysqlDialect(options)
  return new SqliteDialect(options)
}

export class KnexStorage implements TransactionalStorage {
  readonly #dialect: Dialect
  readonly #createTable: boolean
  readonly #tokens = new TokenGenerator()
  /** The clock tokens are dated with (see tokens.ts). */
  readonly #now: () => number
  /** Set once the table exists (when asked to create it) and the server is probed: see `#start`. */
  #starting: Promise<void> | undefined
  #started = false
  /** The table was missing, and this storage's start made it (`createTable`): the proof says so once. */
  #tableCreated = false
  readonly #listener: PgListener | undefined
  /** Request transactions open at once (see request-slots.ts). */
  readonly #requestSlots: RequestSlots

  /**
   * PostgreSQL only (the property is absent on MySQL/MariaDB and SQLite, where the plugin polls
   * `begin` instead): resolve once the lease on `key` was completed or released (woken by
   * LISTEN/NOTIFY, from any process), or lapsed, or after `timeout` ms. See pg-listener.ts.
   */
  declare readonly waitFor?: (key: string, timeout: number) => Promise<void>

  /**
   * The store's name in events, logs and errors, whatever a bundler calls the class; a subclass
   * goes by its own class's name.
   */
  get [Symbol.toStringTag] (): string {
    return this.constructor === KnexStorage ? 'KnexStorage' : this.constructor.name
  }

  constructor (options: KnexStorageOptions) {
    const dialect = this.#dialect = dialectFor(dialectOptions(options))
    this.#createTable = options.createTable === true
    this.#now = options.now ?? Date.now
    this.#requestSlots = new RequestSlots(dialect.knex)
    if (dialect instanceof PostgresDialect && PgListener.canListen(dialect.knex)) {
      const listener = this.#listener = new PgListener({ dialect, retrying: (statement) => this.#retrying(statement), started: () => this.#start() })
      this.waitFor = (key, timeout) => listener.waitFor(encodeKey(key), timeout)
    }
  }

  /** The table this storage uses. */
  get tableName (): string {
    return this.#dialect.table
  }

  /** SQLite (knex gives it one connection), or a pool of one: an open transaction holds it. */
  get singleConnection (): boolean {
    return this.#dialect.name === 'sqlite' || poolSize(this.#dialect.knex) === 1
  }

  /** The SQL family of the knex instance: `'postgres'`, `'mysql'` or `'sqlite'`. */
  get dialect (): SqlDialect {
    return this.#dialect.name
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    const id = encodeKey(key)
    const lease = duration('KnexStorage', 'lockTimeout', lockTimeout)
    if (typeof fingerprint !== 'string') throw new TypeError('KnexStorage: the fingerprint must be a string')
    if (!this.#started) await this.#start()
    const token = this.#tokens.next(this.#now())
    for (let round = 0; round < BEGIN_ROUNDS; round++) {
      const result = await this.#retrying(() => this.#dialect.takeLease({ id, token, fingerprint, lease })).catch((error: unknown) => {
        // The statement may have taken the lease though its answer was lost: give it back (fenced
        // by this call's token), rather than block the key until the lease lapses.
        if (this.#dialect.name !== 'sqlite' && outcomeUnknown(error)) this.#retrying(() => this.#dialect.giveBack({ id, token })).catch(() => {})
        throw error
      })
      if (result !== undefined) return result
    }
    throw new StoreContentionError(`KnexStorage: begin did not settle after ${BEGIN_ROUNDS} rounds of concurrent changes to one key`)
  }

  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    return await this.#storeResponse(this.#dialect.knex, completion(key, token, response, expiration))
  }

  /**
   * Transaction mode: a knex transaction for the handler's writes, in which `complete` writes the
   * stored response with the same fenced statement as above, so both commit or neither does.
   */
  async transaction (options: TransactionOptions = {}): Promise<StorageTransaction> {
    if (!this.#started) await this.#start()
    const release = options.request === true ? await this.#requestSlot(options.lease) : undefined
    let opened: OpenedTransaction
    try {
      opened = await openTransaction(this.#dialect, options, this.singleConnection)
    } catch (error) {
      release?.()
      throw error
    }
    const { trx, renew } = opened
    // A failed COMMIT rejects the transaction's own promise as well as commit()'s; the caller
    // handles the latter, so the former must not surface as an unhandled rejection. However it
    // ends, its slot is free again.
    trx.executionPromise.catch(() => {}).finally(() => release?.())
    return {
      handle: trx,
      complete: async (key, token, response, expiration) => await this.#storeResponse(trx, completion(key, token, response, expiration)),
      commit: async () => { await this.#commit(trx) },
      rollback: async () => { if (!trx.isCompleted()) await trx.rollback() },
      ...(renew === undefined ? {} : { renew })
    }
  }

  /**
   * A slot for a request's transaction (request-slots.ts), and the lease of its request (taken and
   * committed by `begin`) kept meanwhile. The plugin renews a lease once its transaction is open;
   * a request that waits here, for requests ahead of it to end theirs, would lose it after
   * `lockTimeout`, and a duplicate would take the key over and run the handler while this request
   * ran it too once its turn came (to be rolled back). So while it waits the store renews it,
   * every `lockTimeout / 8`, beside, and waits for the renewal in flight before the transaction
   * opens (a renewal committed after a REPEATABLE READ snapshot would make the transaction's lock
   * of the row fail). A lease found lost fails the call. Not on a single connection, which the
   * transaction ahead holds: nothing can be renewed there until it ends.
   */
  async #requestSlot (lease: TransactionOptions['lease']): Promise<() => void> {
    const free = this.#requestSlots.takeFree()
    if (free !== undefined) return free
    if (lease === undefined || this.singleConnection) return await this.#requestSlots.take()
    const { key, token, lockTimeout } = lease
    let held: Promise<boolean> = Promise.resolve(true)
    // A renewal that fails (rather than finding the lease gone) is not taken for a lost lease: the
    // next one, or the transaction's fenced write of the response, decides.
    const timer = setInterval(() => {
      held = held.then(async (kept) => kept && await this.renew(key, token, lockTimeout).catch(() => true))
    }, Math.max(1, Math.floor(lockTimeout / 8)))
    timer.unref()
    let release: () => void
    try {
      release = await this.#requestSlots.take()
    } finally {
      clearInterval(timer)
    }
    if (await held) return release
    release()
    throw new Error('KnexStorage: the lease was lost while its request waited for a transaction')
  }

  /**
   * A statement of one of its transactions (a handler's) failed because the transaction conflicted
   * with another: a serialization failure or deadlock (PostgreSQL), a deadlock, lock wait timeout or
   * snapshot conflict (MySQL/MariaDB), a busy database (SQLite).
   */
  isConflict (error: unknown): boolean {
    return this.#dialect.isConflict(error)
  }

  /**
   * COMMIT, failing when it fails. knex's `trx.commit()` resolves even when COMMIT fails (a
   * deferred constraint, a lost connection): the error only rejects the transaction's own promise,
   * which is awaited here, so a failed or unknown COMMIT is never taken for a kept response.
   *
   * SQLite leaves the transaction open when COMMIT fails (a deferred foreign key, a busy database),
   * and knex would hand its one connection back to the pool inside it: the next store call would
   * run in that transaction. So on SQLite COMMIT is sent as a statement of the transaction, and
   * knex's ROLLBACK then ends it either way (after a COMMIT that went through there is nothing left
   * to roll back, and SQLite only says so).
   *
   * Elsewhere the connection whose COMMIT failed is not used again, unless the server refused it as
   * a serialization failure: a connection killed during COMMIT went back to knex's pool before its
   * driver noticed, and the very next statement (the lease given back) took it and failed too,
   * which left the key locked until `lockTimeout`.
   */
  async #commit (trx: Knex.Transaction): Promise<void> {
    if (this.#dialect.name === 'sqlite') {
      let failure: unknown
      await trx.raw('COMMIT').catch((error: unknown) => { failure = error })
      await trx.rollback().catch(() => {})
      if (failure !== undefined) throw trimmed(failure)
      return
    }
    // A transaction's client hands out the transaction's own connection.
    const connection = await (trx.client as { acquireConnection: () => Promise<{ __knex__disposed?: unknown }> }).acquireConnection()
    await trx.commit()
    await trx.executionPromise.catch((error: unknown) => {
      // knex's pool checks this before it hands a connection out, and destroys it instead. A
      // serialization failure is the server's answer on a sound connection: that one is kept
      // (at SERIALIZABLE they are routine, and each would cost a new connection and knex's warning).
      if (!this.#dialect.isConflict(error)) connection.__knex__disposed ??= error
      throw trimmed(error)
    })
  }

  async release (key: string, token: string): Promise<boolean> {
    const id = encodeKey(key)
    if (!this.#started) await this.#start()
    return await this.#retrying(() => this.#dialect.giveBack({ id, token })) === 1
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const id = encodeKey(key)
    const lease = duration('KnexStorage', 'lockTimeout', lockTimeout)
    if (!this.#started) await this.#start()
    return await this.#retrying(() => this.#dialect.renewLease({ id, token, lease })) === 1
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
    if (!this.#started) await this.#start()
    let total = 0
    for (;;) {
      options.signal?.throwIfAborted()
      const { chosen, deleted } = await this.#retrying(() => this.#dialect.purgeBatch(batchSize))
      total += deleted
      options.onProgress?.(total)
      // A short batch means nothing expired is left (or another purge is taking it).
      if (chosen < batchSize) return total
      // Let requests in between batches: better-sqlite3 answers synchronously, so without this a
      // purge of a million rows held the event loop for its whole length (no request answered).
      await setImmediate()
    }
  }

  async inspect (key: string): Promise<StoredState> {
    if (!this.#started) await this.#start()
    return await this.#retrying(() => inspectRow(this.#dialect, key))
  }

  /** The related keys are a range of the primary key: one indexed DELETE. */
  async forget (key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
    if (!this.#started) await this.#start()
    return await this.#retrying(() => forgetRow(this.#dialect, key, options))
  }

  /**
   * Through the in-flight index (`createInFlightIndex`); on a table created before it, by reading
   * the whole table.
   */
  async listInFlight (options: { limit: number }): Promise<LeaseListing> {
    if (!this.#started) await this.#start()
    return await this.#retrying(() => listLeaseRows(this.#dialect, options.limit))
  }

  /**
   * The start-up proof (proof.ts): the database reached, the table there (made with `createTable`),
   * read, and written, updated and deleted in a transaction rolled back.
   */
  async prove (options: StoreProofOptions): Promise<StoreCheck[]> {
    return await proveKnex({
      dialect: this.#dialect,
      start: async () => {
        await this.#start()
        // Said once: a later proof finds the table there.
        const created = this.#tableCreated
        this.#tableCreated = false
        return created
      }
    }, options)
  }

  /** The start-up proof, failing with one line that says why (and how to cure it) when a check failed. */
  async ready (options: Partial<StoreProofOptions> = {}): Promise<void> {
    await readyWhenProven('KnexStorage', (proof) => this.prove(proof), options)
  }

  /**
   * End the listening connection, if a wait opened one; pending waits resolve (their callers ask
   * `begin` again). The knex instance belongs to the caller, who destroys it. The storage stays
   * usable: a later wait opens a new connection.
   */
  async close (): Promise<void> {
    await this.#listener?.close()
  }

  /** `complete`, on the pool or in a transaction (`db`). */
  async #storeResponse (db: Knex | Knex.Transaction, done: Completion): Promise<boolean> {
    if (!this.#started) await this.#start()
    const statement = (): Promise<number> => this.#dialect.storeResponse(db, done)
    // Inside a transaction a deadlock aborts the whole transaction: retrying one statement of it
    // would be wrong, so only the stand-alone statement is retried.
    const changed = db.isTransaction === true ? await statement().catch((error: unknown) => { throw trimmed(error) }) : await this.#retrying(statement)
    return changed === 1
  }

  /** Before the first statement: the table (with `createTable`), and what the server can do. */
  #start (): Promise<void> {
    this.#starting ??= this.#createAndProbe().then(() => { this.#started = true }, (error: unknown) => {
      // A failed start (server down, no privileges) must not poison every later call.
      this.#starting = undefined
      throw error
    })
    return this.#starting
  }

  async #createAndProbe (): Promise<void> {
    await this.#dialect.probeServer()
    if (this.#createTable) this.#tableCreated = await ensureIdempotencyTable(this.#dialect.knex, this.#dialect.table)
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

/** A response to store, as the dialects write it; its values are checked before any statement. */
function completion (key: string, token: string, response: StoredResponse, expiration: number): Completion {
  return {
    id: encodeKey(key),
    token,
    ttl: duration('KnexStorage', 'expiration', expiration),
    // `null` says the body was not kept: an empty body is stored as an empty value.
    body: response.bodyOmitted === true ? null : toBuffer(response.body),
    headers: JSON.stringify(response.headers ?? {}),
    statusCode: response.statusCode,
    contentType: response.contentType ?? null
  }
}
