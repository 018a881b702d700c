/**
 * What differs from one database to another, behind one interface, chosen once when a
 * KnexStorage is built: the statement that takes a key, the ones that end a lease, the purge,
 * and which errors are deadlocks. The statements the dialects share are here too.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import type { SqlDialect } from './schema.js'

/** The lease `begin` tries to take. Times are epoch ms. */
export interface LeaseRequest {
  id: Buffer
  fingerprint: string
  token: string
  now: number
  leaseEnd: number
}

/** A response to store, fenced by `token`. */
export interface Completion {
  id: Buffer
  token: string
  statusCode: number
  contentType: string | null
  /** The headers as JSON text. */
  headers: string
  /** `null` when the body was not kept (see StoredResponse.bodyOmitted). */
  body: Buffer | null
  now: number
  expiresAt: number
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
  release: (knex: Knex, table: string, id: Buffer, token: string, now: number) => Promise<number>
  /** Extend the lease to `leaseEnd` if `token` holds it; how many rows changed. */
  renew: (knex: Knex, table: string, id: Buffer, token: string, now: number, leaseEnd: number) => Promise<number>
  /** Delete up to `batchSize` rows expired at `now`: how many it chose, and how many went. */
  purgeBatch: (knex: Knex, table: string, now: number, batchSize: number) => Promise<{ chosen: number, deleted: number }>
  /** The server chose this statement as a deadlock victim: it was rolled back whole and may run again. */
  isDeadlock: (error: unknown) => boolean
}

/** Makes a statement bounded in time (see `bounded`); the identity when nothing is bounded. */
export type Bound = <Q extends Knex.QueryBuilder | Knex.Raw>(query: Q) => Q

/**
 * Past `ms` the server cancels the statement (pg_cancel_backend, KILL QUERY, through a connection
 * of its own), so a row locked by another session never keeps a pooled connection busy, nor the
 * requests for other keys waiting for one. 0 bounds nothing.
 */
export function bounded (ms: number): Bound {
  if (ms === 0) return (query) => query
  return (query) => query.timeout(ms, { cancel: true }) as typeof query
}

/** The fenced row of a held lease. */
function heldLease (db: Knex | Knex.Transaction, table: string, id: Buffer, token: string, now: number): Knex.QueryBuilder {
  return db(table).where({ idempotency_key: id, token, state: 'in_flight' }).andWhere('lease_end', '>', now)
}

/** `complete` as a plain fenced UPDATE (MySQL, MariaDB, SQLite). */
export async function updateCompleted (db: Knex | Knex.Transaction, table: string, c: Completion, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(db, table, c.id, c.token, c.now).update({
    state: 'completed',
    token: null,
    lease_end: null,
    status_code: c.statusCode,
    content_type: c.contentType,
    headers: c.headers,
    body: c.body,
    expires_at: c.expiresAt
  })))
}

/** `release` as a plain fenced DELETE (MySQL, MariaDB, SQLite). */
export async function deleteLease (knex: Knex, table: string, id: Buffer, token: string, now: number, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(knex, table, id, token, now).del()))
}

/** `renew` on every dialect: the lease end is also when the row stops mattering. */
export async function extendLease (knex: Knex, table: string, id: Buffer, token: string, now: number, leaseEnd: number, bound: Bound): Promise<number> {
  return Number(await bound(heldLease(knex, table, id, token, now).update({ lease_end: leaseEnd, expires_at: leaseEnd })))
}

/**
 * A purge batch chosen by a subquery and deleted in the same statement (PostgreSQL, SQLite). The
 * outer condition is checked again on the row as it is when deleted, so a row that a `begin` took
 * over after the batch was chosen survives.
 */
export async function purgeBySubquery (knex: Knex, table: string, now: number, batchSize: number, skipLocked: boolean, bound: Bound): Promise<{ chosen: number, deleted: number }> {
  const batch = knex(table).select('idempotency_key').where('expires_at', '<=', now).limit(batchSize)
  // Concurrent purges take disjoint batches instead of waiting on each other.
  if (skipLocked) batch.forUpdate().skipLocked()
  const deleted = Number(await bound(knex(table).whereIn('idempotency_key', batch).andWhere('expires_at', '<=', now).del()))
  return { chosen: deleted, deleted }
}
