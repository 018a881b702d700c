/**
 * What differs from one database to another, behind one interface, chosen once when a
 * KnexStorage is built: the statement that takes a key, the ones that end a lease, the purge,
 * and which errors are deadlocks. The statements the dialects share are here too.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
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

/** The lease `begin` tries to take, `lease` ms long. */
export interface LeaseRequest {
  id: Buffer
  fingerprint: string
  token: string
  lease: number
}

/** A response to store for `ttl` ms, fenced by `token`. */
export interface Completion {
  id: Buffer
  token: string
  statusCode: number
  contentType: string | null
  /** The headers as JSON text. */
  headers: string
  /** `null` when the body was not kept (see StoredResponse.bodyOmitted). */
  body: Buffer | null
  ttl: number
}

export interface Dialect {
  readonly name: SqlDialect
  /** Once, before the first statement (MariaDB: whether the server has INSERT ... RETURNING). */
  prepare: (knex: Knex) => Promise<void>
  /** One attempt: the result, or `undefined` when the row it lost to changed before it could be read. */
  begin: (knex: Knex, table: string, lease: LeaseRequest) => Promise<BeginResult | undefined>
  /** Store the response if `token` holds the lease; how many rows changed (0 or 1). */
  complete: (db: Knex | Knex.Transaction, table: string, completion: Completion) => Promise<number>
  /** Drop the lease if `token` holds it; how many rows changed. */
  release: (knex: Knex, table: string, id: Buffer, token: string) => Promise<number>
  /** Extend the lease to `lease` ms from now if `token` holds it; how many rows changed. */
  renew: (knex: Knex, table: string, id: Buffer, token: string, lease: number) => Promise<number>
  /** Delete up to `batchSize` expired rows: how many it chose, and how many went. */
  purgeBatch: (knex: Knex, table: string, batchSize: number) => Promise<{ chosen: number, deleted: number }>
  /** How this dialect reads the time. */
  readonly clock: Clock
  /** How this dialect bounds a statement built with knex (see `bounded`). */
  readonly bound: Bound
  /** The server chose this statement as a deadlock victim: it was rolled back whole and may run again. */
  isDeadlock: (error: unknown) => boolean
}

/** Makes a statement bounded in time (see `bounded`); the identity when nothing is bounded. */
export type Bound = <Q extends Knex.QueryBuilder | Knex.Raw>(query: Q) => Q

/**
 * Past `ms` the server cancels the statement (pg_cancel_backend, KILL QUERY, through a connection
 * of its own), so a row locked by another transaction never keeps a pooled connection busy, nor the
 * requests for other keys waiting for one. 0 bounds nothing.
 */
export function bounded (ms: number): Bound {
  if (ms === 0) return (query) => query
  return (query) => query.timeout(ms, { cancel: true }) as typeof query
}

/** What the direct path needs of knex's client (see `onConnection`). */
interface PoolClient<C> {
  driverName?: string
  acquireConnection: () => Promise<C>
  releaseConnection: (connection: C) => Promise<unknown>
  cancelQuery: (connection: C) => Promise<unknown>
}

/** The driver knex runs `db` on: `'pg'`, `'mysql2'`, `'better-sqlite3'`, ... */
export function driverOf (db: Knex | Knex.Transaction): string | undefined {
  return (db.client as { driverName?: string }).driverName
}

/**
 * Run `query` on a connection of `db` (a pooled one, or a transaction's own), past knex's query
 * building: for the statements of the hot path, whose values knex would format and renumber on
 * every call. Bounded like `bounded`: past `ms` the server cancels the statement.
 */
export async function onConnection<C, T> (db: Knex | Knex.Transaction, ms: number, query: (connection: C) => Promise<T>): Promise<T> {
  const client = db.client as PoolClient<C>
  const connection = await client.acquireConnection()
  let cancelling: Promise<unknown> | undefined
  const timer = ms === 0 ? undefined : setTimeout(() => { cancelling = client.cancelQuery(connection) }, ms)
  try {
    return await query(connection)
  } finally {
    clearTimeout(timer)
    // A cancel that lands after its statement ended would stop the next statement sent on this
    // connection: it goes back to the pool once the cancel is done, or is thrown away (as knex does).
    await cancelling?.catch((error: unknown) => { (connection as { __knex__disposed?: unknown }).__knex__disposed = error })
    await client.releaseConnection(connection)
  }
}

/**
 * `complete` as one statement text with `?` placeholders (the clock's values, status, content
 * type, headers, body, the clock's values, ttl, key, token, the clock's values), for the dialects
 * that prepare it themselves (MariaDB, SQLite); the same fenced UPDATE as `updateCompleted`.
 * `table` is quoted already, `N` the clock. `lease_end` keeps when the lease ended: when the
 * response was stored.
 */
export function completeSql (table: string, N: string): string {
  return `UPDATE ${table} SET state = 'completed', token = NULL, lease_end = ${N}, status_code = ?, content_type = ?, headers = ?, body = ?, expires_at = ${N} + ?
WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ${N}`
}

/** The fenced row of a held lease. */
function heldLease (db: Knex | Knex.Transaction, table: string, id: Buffer, token: string, clock: Clock): Knex.QueryBuilder {
  return db(table).where({ idempotency_key: id, token, state: 'in_flight' }).andWhereRaw(`lease_end > ${clock.now}`, clock.values())
}

/** `ms` from now, as a value to write. */
function fromNow (db: Knex | Knex.Transaction, clock: Clock, ms: number): Knex.Raw {
  return db.raw(`${clock.now} + ${clock.int}`, [...clock.values(), ms])
}

/** `complete` as a plain fenced UPDATE (MySQL, MariaDB, SQLite). */
export async function updateCompleted (db: Knex | Knex.Transaction, table: string, c: Completion, clock: Clock, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(db, table, c.id, c.token, clock).update({
    state: 'completed',
    token: null,
    // When the lease ended, which is when the response was stored (`inspect` reports it).
    lease_end: db.raw(clock.now, clock.values()),
    status_code: c.statusCode,
    content_type: c.contentType,
    headers: c.headers,
    body: c.body,
    expires_at: fromNow(db, clock, c.ttl)
  })))
}

/** `release` as a plain fenced DELETE (MySQL, MariaDB, SQLite). */
export async function deleteLease (knex: Knex, table: string, id: Buffer, token: string, clock: Clock, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(knex, table, id, token, clock).del()))
}

/** `renew` on every dialect: the lease end is also when the row stops mattering. */
export async function extendLease (knex: Knex, table: string, id: Buffer, token: string, lease: number, clock: Clock, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(knex, table, id, token, clock).update({ lease_end: fromNow(knex, clock, lease), expires_at: fromNow(knex, clock, lease) })))
}

/**
 * A purge batch chosen by a subquery and deleted in the same statement (PostgreSQL, SQLite). The
 * outer condition is checked again on the row as it is when deleted, so a row that a `begin` took
 * over after the batch was chosen survives.
 */
export async function purgeBySubquery (knex: Knex, table: string, batchSize: number, skipLocked: boolean, clock: Clock, bound: Bound): Promise<{ chosen: number, deleted: number }> {
  const values = clock.values()
  const batch = knex(table).select('idempotency_key').whereRaw(`expires_at <= ${clock.scan}`, values).limit(batchSize)
  // Concurrent purges take disjoint batches instead of waiting on each other.
  if (skipLocked) batch.forUpdate().skipLocked()
  const deleted = Number(await bound(knex(table).whereIn('idempotency_key', batch).andWhereRaw(`expires_at <= ${clock.scan}`, values).del()))
  return { chosen: deleted, deleted }
}
