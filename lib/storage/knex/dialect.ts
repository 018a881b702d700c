/**
 * What KnexStorage asks of a database, as one interface: the steps of a key's life (take a lease,
 * store a response, give a lease back, renew it, read an entry, purge), named for what they do.
 * Each database's dialect (postgres.ts, mysql.ts, sqlite.ts) is built once per storage, for its
 * knex and its table, and writes those steps in its own SQL; base-dialect.ts holds the steps
 * they write the same way.
 */
import type { Knex } from 'knex'
import type { BeginResult, IsolationLevel } from '../types.js'
import type { SqlDialect } from './schema.js'

/**
 * "Now" in a statement, in epoch ms. By default the database's own clock, read when the statement
 * writes (after any wait for a pool connection or a row lock), so a lease or an expiry is always
 * measured from when it is written: no wait on the client's side can shorten it, as Redis's `PX`
 * is measured by Redis. With the `now` option (tests), the application's clock, bound as a value.
 */
export interface Clock {
  /** SQL for the time as the statement reaches this expression: after its row locks. */
  readonly now: string
  /**
   * SQL for the time the statement started, for scans: an index can serve a comparison with it,
   * which a clock read per row (PostgreSQL's clock_timestamp, MySQL's SYSDATE) rules out.
   */
  readonly scan: string
  /** How an integer parameter is written (PostgreSQL wants its type beside the placeholder). */
  readonly int: string
  /** The value for one `now` or `scan` placeholder: none with the database's clock. */
  values: () => number[]
}

/** The database's clock (its SQL for `now` and `scan`), or the application's `now` when given. */
export function clockOf (sql: { now: string, scan: string, int: string }, now: (() => number) | undefined): Clock {
  if (now === undefined) return { ...sql, values: () => [] }
  return { now: sql.int, scan: sql.int, int: sql.int, values: () => [now()] }
}

/** Makes a statement bounded in time (see `bounded`); the identity when nothing is bounded. */
export type Bound = <Q extends Knex.QueryBuilder | Knex.Raw>(query: Q) => Q

/**
 * Past `ms` the statement is cancelled (pg_cancel_backend, KILL QUERY, through a connection of
 * its own), so a row locked by another transaction never keeps a pooled connection busy, nor the
 * requests for other keys waiting for one. 0 bounds nothing. (PostgreSQL also bounds its lock
 * waits on the server, which works through a pooler: see postgres.ts.)
 */
export function bounded (ms: number): Bound {
  if (ms === 0) return (query) => query
  return (query) => query.timeout(ms, { cancel: true }) as typeof query
}

/** How a storage builds its dialect: its knex, its table, and the store's options that shape SQL. */
export interface DialectOptions {
  knex: Knex
  /** The table as the caller named it (schema-qualified or not), unquoted. */
  table: string
  /** The longest one statement may run, in ms (0: unbounded). */
  statementTimeout: number
  /** The application's clock (tests); the database's when absent. */
  now: (() => number) | undefined
  /**
   * PostgreSQL: send the hot statements as named prepared statements; by default (`undefined`),
   * unless a pooler stands in front.
   */
  namedStatements: boolean | undefined
}

/** A lease a caller holds: the key's row, fenced by the token that took it. */
export interface HeldLease {
  id: Buffer
  token: string
}

/** The lease `takeLease` tries to take, `lease` ms long. */
export interface LeaseRequest extends HeldLease {
  fingerprint: string
  lease: number
}

/** A held lease to extend to `lease` ms from now. */
export interface LeaseRenewal extends HeldLease {
  lease: number
}

/** A response to store for `ttl` ms, fenced by `token`. */
export interface Completion extends HeldLease {
  statusCode: number
  contentType: string | null
  /** The headers as JSON text. */
  headers: string
  /** `null` when the body was not kept (see StoredResponse.bodyOmitted). */
  body: Buffer | null
  ttl: number
}

/** What one purge statement did: the rows it chose, and the rows that went. */
export interface PurgedBatch {
  chosen: number
  deleted: number
}

/**
 * Where the lease of a request is kept while its transaction is open:
 * - `outside`: renewed by the store's `renew`, on another connection, committed at once, so that
 *   every process sees it; the transaction touches the key's row only to store the response.
 * - `locked`: held by the transaction, which writes the key's row as soon as it opens, and so locks
 *   it until it ends. A transaction whose snapshot is older than a change to a row cannot change
 *   that row (PostgreSQL's REPEATABLE READ and SERIALIZABLE, MariaDB with
 *   innodb_snapshot_isolation), so a renewal committed beside it would make storing the response
 *   fail; and a pool of one has no other connection to renew on. The row lock keeps every other
 *   writer of the row out (a waiter's mark, a purge, a takeover) until the transaction ends, as the
 *   lease would; a process that dies ends its transaction, and the row lock with it.
 * - `inside`: held by the transaction from the lease's first renewal on, which writes the key's row
 *   through it (SQLite: the transaction then holds the database's one write lock, which a DEFERRED
 *   transaction takes no earlier; nothing else can renew meanwhile, on its one connection).
 */
export type LeaseHolding = 'outside' | 'inside' | 'locked'

/** Whether a transaction at `level` (as the server names it: `read committed`, `REPEATABLE-READ`) reads what others committed after it began. */
export function readsCommitted (level: string): boolean {
  return /^read[ -](committed|uncommitted)$/i.test(level.trim())
}

export interface Dialect {
  readonly name: SqlDialect
  /** The knex instance the storage was given: the pool every step runs on. */
  readonly knex: Knex
  /** The table, as the caller named it. */
  readonly table: string
  /** How this dialect reads the time. */
  readonly clock: Clock
  /** How this dialect bounds a statement built with knex (see `bounded`). */
  readonly bound: Bound
  /** Once, before the first statement: what the server can do (MariaDB: INSERT ... RETURNING). */
  probeServer: () => Promise<void>
  /**
   * One attempt to take the key's lease: `acquired`, or the live entry that holds the key, or
   * `undefined` when the row it lost to changed before it could be read (the caller tries again).
   */
  takeLease: (request: LeaseRequest) => Promise<BeginResult | undefined>
  /** Store the response if the lease is still held, on `db` (the pool, or a transaction); rows changed (0 or 1). */
  storeResponse: (db: Knex | Knex.Transaction, completion: Completion) => Promise<number>
  /** Drop the row if the lease is still held; rows changed (0 or 1). */
  giveBack: (lease: HeldLease) => Promise<number>
  /** Extend the lease if it is still held, on `db` (the pool, or the request's transaction); rows changed (0 or 1). */
  renewLease: (renewal: LeaseRenewal, db?: Knex | Knex.Transaction) => Promise<number>
  /** Open a transaction at `level`, before its first statement (the session's default when absent). */
  beginTransaction: (level: IsolationLevel | undefined) => Promise<Knex.Transaction>
  /**
   * Where the lease of a request whose transaction `trx` was opened at `level` is renewed while it
   * is open. May read, through `trx` and once per store, what the server's sessions default to.
   */
  leaseHolding: (trx: Knex.Transaction, level: IsolationLevel | undefined) => Promise<LeaseHolding>
  /**
   * A statement of a transaction failed because it conflicted with another transaction, and the
   * transaction may succeed when run again (serialization failure, deadlock, busy database).
   */
  isConflict: (error: unknown) => boolean
  /** The key's live entry (in flight or completed), or `undefined` when there is none. */
  readEntry: (id: Buffer) => Promise<BeginResult | undefined>
  /** Delete up to `batchSize` expired rows. */
  purgeBatch: (batchSize: number) => Promise<PurgedBatch>
  /** Wake the requests waiting for the key's lease, which was removed (PostgreSQL's NOTIFY); absent where waiters poll. */
  wakeWaiters?: (id: Buffer) => Promise<void>
  /** The server chose this statement as a deadlock victim: it was rolled back whole and may run again. */
  isDeadlock: (error: unknown) => boolean
}
