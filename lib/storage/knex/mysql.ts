/**
 * MySQL and MariaDB: `begin` is one INSERT ... ON DUPLICATE KEY UPDATE. MariaDB 10.5+ returns the
 * row from it; on MySQL a replay reads the row with a second statement.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, deleteLease, extendLease, updateCompleted, type Bound, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { COLUMNS, readLive, toResult, type Row } from './rows.js'

// ON DUPLICATE KEY UPDATE has no WHERE, so each assignment carries the condition. Assignments run
// left to right and see the columns already assigned, so `expires_at`, which the condition reads,
// comes last. affectedRows cannot tell an insert from an untouched row when the client sets
// CLIENT_FOUND_ROWS (mysql2 does by default), so LAST_INSERT_ID(expr), which the server reports as
// the OK packet's insertId, does: 0 inserted, 1 taken over, 2 left alone.
const BEGIN = `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ?, ?)
ON DUPLICATE KEY UPDATE
  fingerprint = IF(expires_at <= ?, ?, fingerprint),
  state = IF(expires_at <= ?, 'in_flight', state),
  token = IF(expires_at <= ?, ?, token),
  lease_end = IF(expires_at <= ?, ?, lease_end),
  status_code = IF(expires_at <= ?, NULL, status_code),
  content_type = IF(expires_at <= ?, NULL, content_type),
  headers = IF(expires_at <= ?, NULL, headers),
  body = IF(expires_at <= ?, NULL, body),
  expires_at = IF(LAST_INSERT_ID(IF(expires_at <= ?, 1, 2)) = 1, ?, expires_at)`
// MariaDB 10.5+ returns the row as it stands after the upsert, whichever branch ran: the replay
// needs no second statement.
const BEGIN_RETURNING = `${BEGIN}
RETURNING token, ${COLUMNS}`

/** MariaDB 10.5 added INSERT ... RETURNING; MySQL has none. */
export function hasInsertReturning (version: string): boolean {
  // Anywhere in the string: some servers put a compatibility prefix ('5.5.5-') before it.
  const match = /(\d+)\.(\d+)\.\d+-mariadb/i.exec(version)
  if (match === null) return false
  const major = Number(match[1])
  const minor = Number(match[2])
  return major > 10 || (major === 10 && minor >= 5)
}

export class MysqlDialect implements Dialect {
  readonly name = 'mysql' as const
  readonly bound: Bound
  /** MariaDB 10.5+: `begin` returns the row in the upsert itself. */
  #returning = false

  constructor (statementTimeout: number) {
    this.bound = bounded(statementTimeout)
  }

  async prepare (knex: Knex): Promise<void> {
    const [rows] = await knex.raw('SELECT VERSION() AS version')
    this.#returning = hasInsertReturning(String(rows?.[0]?.version ?? ''))
  }

  async begin (knex: Knex, table: string, { id, fingerprint, token, now, leaseEnd }: LeaseRequest): Promise<BeginResult | undefined> {
    // In the order of the placeholders: the insert, then each assignment's condition and value.
    const bindings = [table, id, fingerprint, token, leaseEnd, leaseEnd,
      now, fingerprint, now, now, token, now, leaseEnd, now, now, now, now, now, leaseEnd]
    if (this.#returning) {
      const [rows] = await this.bound(knex.raw(BEGIN_RETURNING, bindings))
      const row = (rows as Row[])[0]
      if (row === undefined) return undefined
      if (row.token === token) return { state: 'acquired', token }
      // The upsert left the row alone, so it was live at `now`: in flight or completed.
      return toResult(row)
    }
    const [header] = await this.bound(knex.raw(BEGIN, bindings))
    const outcome = Number((header as { insertId?: unknown }).insertId)
    if (outcome === 0 || outcome === 1) return { state: 'acquired', token }
    if (outcome !== 2) throw new Error(`KnexStorage: unexpected upsert outcome ${outcome}`)
    return await readLive(knex, table, id, now, this.bound)
  }

  async complete (db: Knex | Knex.Transaction, table: string, completion: Completion): Promise<number> {
    return await updateCompleted(db, table, completion, this.bound)
  }

  async release (knex: Knex, table: string, id: Buffer, token: string, now: number): Promise<number> {
    return await deleteLease(knex, table, id, token, now, this.bound)
  }

  async renew (knex: Knex, table: string, id: Buffer, token: string, now: number, leaseEnd: number): Promise<number> {
    return await extendLease(knex, table, id, token, now, leaseEnd, this.bound)
  }

  /**
   * Choose the batch with a plain read, then delete by primary key. A DELETE that walks the expiry
   * index locks index entries before rows, the reverse of the order `begin`'s upsert takes them
   * in, and InnoDB then keeps picking one of the two as a deadlock victim. (MySQL also refuses
   * LIMIT inside an IN subquery.)
   */
  async purgeBatch (knex: Knex, table: string, now: number, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    const rows = await this.bound(knex(table).select('idempotency_key').where('expires_at', '<=', now)
      .orderBy('expires_at').limit(batchSize)) as Array<{ idempotency_key: Buffer }>
    if (rows.length === 0) return { chosen: 0, deleted: 0 }
    const deleted = await this.bound(knex(table).whereIn('idempotency_key', rows.map((row) => row.idempotency_key))
      .andWhere('expires_at', '<=', now).del())
    return { chosen: rows.length, deleted: Number(deleted) }
  }

  isDeadlock (error: unknown): boolean {
    const { code, errno } = (error ?? {}) as { code?: unknown, errno?: unknown }
    return errno === 1213 || code === 'ER_LOCK_DEADLOCK'
  }
}
