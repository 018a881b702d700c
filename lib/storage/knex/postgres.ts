/**
 * PostgreSQL: one statement for every outcome of `begin`, and a NOTIFY from `complete` and
 * `release` only when a waiter asked for one (see pg-listener.ts).
 */
import { hash } from 'node:crypto'
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, clockOf, extendLease, purgeBySubquery, type Bound, type Clock, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { COLUMNS, toResult, type Row } from './rows.js'
import { notificationChannel } from './schema.js'

// `live` reads the row as of the statement's snapshot; only when it shows nothing live does
// `taken` try to insert, and ON CONFLICT then decides on the newest row version, under its row
// lock, whether the row is free to take over. A replay is thus a plain read (no row lock, no
// write). When the insert lost to a row committed after our snapshot, both parts come back empty
// and the caller runs the statement again with a fresh snapshot. `N` is the clock: read after the
// row lock, so the lease taken over is measured from when it is written.
const begin = (N: string): string => `WITH live AS (
  SELECT ${COLUMNS} FROM ?? WHERE idempotency_key = ? AND expires_at > ${N}
), taken AS (
  INSERT INTO ?? AS cur (idempotency_key, fingerprint, state, token, lease_end, expires_at)
  SELECT ?::bytea, ?::text, 'in_flight', ?::text, ${N} + ?::bigint, ${N} + ?::bigint
  WHERE NOT EXISTS (SELECT 1 FROM live)
  ON CONFLICT (idempotency_key) DO UPDATE SET
    fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
    lease_end = ${N} + ?::bigint, expires_at = ${N} + ?::bigint,
    status_code = NULL, content_type = NULL, headers = NULL, body = NULL, waiting = false
  WHERE cur.expires_at <= ${N}
  RETURNING 1
)
SELECT (SELECT count(*) FROM taken)::integer AS taken, live.* FROM (VALUES (1)) AS one LEFT JOIN live ON true`

// `release`: the fenced change, and a NOTIFY for the waiters only when one of them marked the row
// (`waiting`), in the same statement. NOTIFY is not free: at commit it takes a lock global to the
// server, so the commits of all notifying transactions take turns; a release nobody waits for
// skips it. CASE is the construct whose order of evaluation PostgreSQL guarantees, so pg_notify
// runs only for a marked row. RETURNING gives `waiting` as the newest row version has it: a mark
// that committed while the statement waited for the row lock is seen.
const notifying = (change: string): string => `WITH done AS (
  ${change}
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`
// `complete`, the hot one, is a plain UPDATE: wrapped in the same CTE as `release` it cost a
// fifth of the first requests' throughput (measured). Its RETURNING says whether somebody waits;
// only then does a second statement send the NOTIFY (in transaction mode, within the
// transaction, so it is delivered at commit). A waiter that marked the row after the UPDATE finds
// the lease gone when it marks, and does not wait.
const complete = (N: string): string => `UPDATE ?? SET state = 'completed', token = NULL, lease_end = NULL, status_code = ?, content_type = ?,
    headers = ?, body = ?, expires_at = ${N} + ?::bigint
  WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ${N}
  RETURNING waiting`
const release = (N: string): string => notifying(`DELETE FROM ?? WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ${N}`)

/**
 * The server's clock in epoch ms: clock_timestamp() advances within a statement (read after a
 * row lock); statement_timestamp() is fixed for it, so an index scan can compare with it.
 */
const SERVER_CLOCK = {
  now: '(extract(epoch from clock_timestamp()) * 1000)::bigint',
  scan: '(extract(epoch from statement_timestamp()) * 1000)::bigint',
  int: '?::bigint'
}

/**
 * A statement's text, and its name when it is prepared: node-postgres then sends the text once per
 * connection (Parse) and after that only the values (Bind, Execute), and PostgreSQL plans it once
 * instead of on every call. The name is unique to the table and the text.
 */
interface Statement {
  sql: string
  name: string | null
}

function raw (db: Knex | Knex.Transaction, { sql, name }: Statement, bindings: Knex.RawBinding[]): Knex.Raw {
  const query = db.raw(sql, bindings)
  return name === null ? query : query.options({ name })
}

/** 40001 only arises when the server's default isolation is stricter than READ COMMITTED. */
const DEADLOCK_CODES = new Set(['40P01', '40001'])

export class PostgresDialect implements Dialect {
  readonly name = 'postgres' as const
  /** The table's NOTIFY channel (see pg-listener.ts). */
  readonly channel: string
  readonly bound: Bound
  readonly clock: Clock
  readonly #begin: Statement
  readonly #complete: Statement
  readonly #release: Statement

  /** `prepared`: name the hot statements, so each connection parses and plans them once. */
  constructor (table: string, statementTimeout: number, now: (() => number) | undefined, prepared: boolean) {
    this.channel = notificationChannel(table)
    this.bound = bounded(statementTimeout)
    this.clock = clockOf(SERVER_CLOCK, now)
    const statement = (sql: string): Statement => ({ sql, name: prepared ? `idempotency_${hash('sha256', `${table}\n${sql}`, 'hex').slice(0, 40)}` : null })
    this.#begin = statement(begin(this.clock.now))
    this.#complete = statement(complete(this.clock.now))
    this.#release = statement(release(this.clock.now))
  }

  async prepare (): Promise<void> {}

  async begin (knex: Knex, table: string, { id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const t = this.clock.values()
    const { rows } = await this.bound(raw(knex, this.#begin, [table, id, ...t, table, id, fingerprint, token,
      ...t, lease, ...t, lease, ...t, lease, ...t, lease, ...t]))
    const row = rows[0] as (Row & { taken: number }) | undefined
    if (row !== undefined && Number(row.taken) === 1) return { state: 'acquired', token }
    if (row === undefined || row.state === null) return undefined
    return toResult(row)
  }

  async complete (db: Knex | Knex.Transaction, table: string, c: Completion): Promise<number> {
    const t = this.clock.values()
    const { rows } = await this.bound(raw(db, this.#complete, [table, c.statusCode, c.contentType, c.headers, c.body, ...t, c.ttl, c.id, c.token, ...t]))
    if (rows.length === 0) return 0
    if ((rows[0] as { waiting: boolean }).waiting) await this.bound(db.raw('SELECT pg_notify(?, ?)', [this.channel, c.id.toString('base64')]))
    return rows.length
  }

  async release (knex: Knex, table: string, id: Buffer, token: string): Promise<number> {
    return await this.#notifying(knex, this.#release, id, [table, id, token, ...this.clock.values()])
  }

  async renew (knex: Knex, table: string, id: Buffer, token: string, lease: number): Promise<number> {
    return await extendLease(knex, table, id, token, lease, this.clock, this.bound)
  }

  async purgeBatch (knex: Knex, table: string, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    return await purgeBySubquery(knex, table, batchSize, true, this.clock, this.bound)
  }

  isDeadlock (error: unknown): boolean {
    return DEADLOCK_CODES.has(String((error as { code?: unknown } | null)?.code))
  }

  /** A `release`: how many rows it changed. Notifications carry the key's bytes in base64. */
  async #notifying (db: Knex | Knex.Transaction, statement: Statement, id: Buffer, bindings: Knex.RawBinding[]): Promise<number> {
    const { rows } = await this.bound(raw(db, statement, [...bindings, this.channel, id.toString('base64')]))
    return Number((rows[0] as { changed: unknown }).changed)
  }
}
