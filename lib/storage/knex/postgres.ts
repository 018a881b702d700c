/**
 * PostgreSQL: one statement for every outcome of `begin`, and a NOTIFY from `complete` and
 * `release` only when a waiter asked for one (see pg-listener.ts).
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, extendLease, purgeBySubquery, type Bound, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { COLUMNS, toResult, type Row } from './rows.js'
import { notificationChannel } from './schema.js'

// `live` reads the row as of the statement's snapshot; only when it shows nothing live does
// `taken` try to insert, and ON CONFLICT then decides on the newest row version, under its row
// lock, whether the row is free to take over. A replay is thus a plain read (no row lock, no
// write). When the insert lost to a row committed after our snapshot, both parts come back empty
// and the caller runs the statement again with a fresh snapshot.
const BEGIN = `WITH live AS (
  SELECT ${COLUMNS} FROM ?? WHERE idempotency_key = ? AND expires_at > ?
), taken AS (
  INSERT INTO ?? AS cur (idempotency_key, fingerprint, state, token, lease_end, expires_at)
  SELECT ?::bytea, ?::text, 'in_flight', ?::text, ?::bigint, ?::bigint
  WHERE NOT EXISTS (SELECT 1 FROM live)
  ON CONFLICT (idempotency_key) DO UPDATE SET
    fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
    lease_end = excluded.lease_end, expires_at = excluded.expires_at,
    status_code = NULL, content_type = NULL, headers = NULL, body = NULL, waiting = false
  WHERE cur.expires_at <= ?::bigint
  RETURNING 1
)
SELECT (SELECT count(*) FROM taken)::integer AS taken, live.* FROM (VALUES (1)) AS one LEFT JOIN live ON true`

// The fenced change, and a NOTIFY for the waiters only when one of them marked the row
// (`waiting`), in the same statement. NOTIFY is not free: at commit it takes a lock global to the
// server, so the commits of all notifying transactions take turns; a complete or release nobody
// waits for skips it. CASE is the construct whose order of evaluation PostgreSQL guarantees, so
// pg_notify runs only for a marked row. RETURNING gives `waiting` as the newest row version has
// it: a mark that committed while the statement waited for the row lock is seen.
const COMPLETE = `WITH done AS (
  UPDATE ?? SET state = 'completed', token = NULL, lease_end = NULL, status_code = ?, content_type = ?,
    headers = ?, body = ?, expires_at = ?
  WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ?
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`
const RELEASE = `WITH done AS (
  DELETE FROM ?? WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ?
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`

/** 40001 only arises when the server's default isolation is stricter than READ COMMITTED. */
const DEADLOCK_CODES = new Set(['40P01', '40001'])

export class PostgresDialect implements Dialect {
  readonly name = 'postgres' as const
  /** The table's NOTIFY channel (see pg-listener.ts). */
  readonly channel: string
  readonly bound: Bound

  constructor (table: string, statementTimeout: number) {
    this.channel = notificationChannel(table)
    this.bound = bounded(statementTimeout)
  }

  async prepare (): Promise<void> {}

  async begin (knex: Knex, table: string, { id, fingerprint, token, now, leaseEnd }: LeaseRequest): Promise<BeginResult | undefined> {
    const { rows } = await this.bound(knex.raw(BEGIN, [table, id, now, table, id, fingerprint, token, leaseEnd, leaseEnd, now]))
    const row = rows[0] as (Row & { taken: number }) | undefined
    if (row !== undefined && Number(row.taken) === 1) return { state: 'acquired', token }
    if (row === undefined || row.state === null) return undefined
    return toResult(row)
  }

  async complete (db: Knex | Knex.Transaction, table: string, c: Completion): Promise<number> {
    return await this.#notifying(db, COMPLETE, c.id, [table, c.statusCode, c.contentType, c.headers, c.body, c.expiresAt, c.id, c.token, c.now])
  }

  async release (knex: Knex, table: string, id: Buffer, token: string, now: number): Promise<number> {
    return await this.#notifying(knex, RELEASE, id, [table, id, token, now])
  }

  async renew (knex: Knex, table: string, id: Buffer, token: string, now: number, leaseEnd: number): Promise<number> {
    return await extendLease(knex, table, id, token, now, leaseEnd, this.bound)
  }

  async purgeBatch (knex: Knex, table: string, now: number, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    return await purgeBySubquery(knex, table, now, batchSize, true, this.bound)
  }

  isDeadlock (error: unknown): boolean {
    return DEADLOCK_CODES.has(String((error as { code?: unknown } | null)?.code))
  }

  /** A `complete` or `release`: how many rows it changed. Notifications carry the key's bytes in base64. */
  async #notifying (db: Knex | Knex.Transaction, sql: string, id: Buffer, bindings: Knex.RawBinding[]): Promise<number> {
    const { rows } = await this.bound(db.raw(sql, [...bindings, this.channel, id.toString('base64')]))
    return Number((rows[0] as { changed: unknown }).changed)
  }
}
