/**
 * MySQL and MariaDB: `takeLease` is one INSERT ... ON DUPLICATE KEY UPDATE. MariaDB 10.5+ returns
 * the row from it; on MySQL a replay reads the entry with a second statement.
 */
import type { Knex } from 'knex'
import type { BeginResult, IsolationLevel } from '../types.js'
import { BaseDialect, completeSql, completeValues } from './base-dialect.js'
import { driverOf, onConnection } from './connection.js'
import { bounded, clockOf, readsCommitted, type Completion, type DialectOptions, type HeldLease, type LeaseHolding, type LeaseRequest, type PurgedBatch } from './dialect.js'
import { COLUMNS, toResult, type Row } from './rows.js'

// ON DUPLICATE KEY UPDATE has no WHERE, so each assignment carries the condition. Assignments run
// left to right and see the columns already assigned, so `expires_at`, which the condition reads,
// comes last. The first assignment reads the clock (`N`) once the row is locked and keeps it in a
// user variable, so every assignment judges the row by the same instant and the lease taken
// over is measured from when it is written. affectedRows cannot tell an insert from an untouched
// row when the client sets CLIENT_FOUND_ROWS (mysql2 does by default), so LAST_INSERT_ID(expr),
// which the server reports as the OK packet's insertId, does: 0 inserted, 1 taken over, 2 left alone.
const takeLease = (N: string): string => `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ${N} + ?, ${N} + ?)
ON DUPLICATE KEY UPDATE
  fingerprint = IF(expires_at <= (@idempotency_now := ${N}), ?, fingerprint),
  state = IF(expires_at <= @idempotency_now, 'in_flight', state),
  token = IF(expires_at <= @idempotency_now, ?, token),
  lease_end = IF(expires_at <= @idempotency_now, @idempotency_now + ?, lease_end),
  status_code = IF(expires_at <= @idempotency_now, NULL, status_code),
  content_type = IF(expires_at <= @idempotency_now, NULL, content_type),
  headers = IF(expires_at <= @idempotency_now, NULL, headers),
  body = IF(expires_at <= @idempotency_now, NULL, body),
  expires_at = IF(LAST_INSERT_ID(IF(expires_at <= @idempotency_now, 1, 2)) = 1, @idempotency_now + ?, expires_at)`

/**
 * The server's clock in epoch ms: SYSDATE() is read when evaluated (after a row lock), NOW() is
 * fixed for the statement, so an index range scan can compare with it.
 */
const SERVER_CLOCK = {
  now: 'CAST(UNIX_TIMESTAMP(SYSDATE(3)) * 1000 AS SIGNED)',
  scan: 'CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)',
  int: '?'
}

/** A mysql2 connection, as far as `#execute` uses it. */
interface ExecConnection {
  execute: (sql: string, values: unknown[], callback: (error: Error | null, rows: unknown) => void) => void
}

/** MariaDB 10.5 added INSERT ... RETURNING; MySQL has none. */
export function hasInsertReturning (version: string): boolean {
  // Anywhere in the string: some servers put a compatibility prefix ('5.5.5-') before it.
  const match = /(\d+)\.(\d+)\.\d+-mariadb/i.exec(version)
  if (match === null) return false
  const major = Number(match[1])
  const minor = Number(match[2])
  return major > 10 || (major === 10 && minor >= 5)
}

/** A session's default level, and whether it checks snapshots on write. */
interface Session {
  level: string
  snapshotIsolation: boolean
}

/**
 * Read through `trx` (a failed statement leaves a MySQL transaction as it was): MySQL 8 and
 * MariaDB 11.1+ name the level `transaction_isolation`, earlier ones `tx_isolation`; MySQL has no
 * innodb_snapshot_isolation.
 */
async function sessionOf (trx: Knex.Transaction): Promise<Session> {
  const value = async (variable: string): Promise<string | undefined> => {
    try {
      const [rows] = await trx.raw(`SELECT @@${variable} AS value`)
      return String((rows as Array<{ value: unknown }>)[0]!.value)
    } catch {
      return undefined
    }
  }
  return {
    snapshotIsolation: await value('innodb_snapshot_isolation') === '1',
    level: await value('transaction_isolation') ?? await value('tx_isolation') ?? 'REPEATABLE-READ'
  }
}

export class MysqlDialect extends BaseDialect {
  readonly name = 'mysql' as const
  /** The upsert, through knex (`??` for the table). */
  readonly #takeLease: string
  /** MariaDB 10.5+: the upsert returns the row as it stands after it, whichever branch ran: a replay needs no second statement. */
  readonly #takeLeaseReturning: string
  /** MariaDB 10.5+: `takeLease` returns the row in the upsert itself (see `probeServer`). */
  #returning = false

  /** The upsert and the stored response as statements for mysql2's `execute` (see `#execute`). */
  readonly #executeTakeLease: string
  readonly #executeStoreResponse: string
  /** Whether `#execute` is used: MariaDB 10.5+ through knex's own mysql2 client. */
  #executing = false
  /** What the server's sessions do, read once (see `leaseHolding`). */
  #session: Session | undefined

  constructor ({ knex, table, statementTimeout, now }: DialectOptions) {
    super({ knex, table, clock: clockOf(SERVER_CLOCK, now), bound: bounded(statementTimeout) })
    this.#takeLease = takeLease(this.clock.now)
    this.#takeLeaseReturning = `${this.#takeLease}\nRETURNING token, ${COLUMNS}`
    const quoted = table.split('.').map((part) => `\`${part.replace(/`/g, '``')}\``).join('.')
    // The server cancels a statement that runs past statementTimeout, lock waits included, as
    // knex's .timeout() does for the statements it sends.
    const bound = statementTimeout > 0 ? `SET STATEMENT max_statement_time = ${statementTimeout / 1000} FOR ` : ''
    this.#executeTakeLease = bound + this.#takeLeaseReturning.replace('??', quoted)
    this.#executeStoreResponse = bound + completeSql(quoted, this.clock.now)
  }

  override async probeServer (): Promise<void> {
    const [rows] = await this.knex.raw('SELECT VERSION() AS version')
    this.#returning = hasInsertReturning(String(rows?.[0]?.version ?? ''))
    this.#executing = this.#returning && driverOf(this.knex) === 'mysql2'
  }

  async takeLease ({ id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const t = this.clock.values()
    // In the order of the placeholders: the insert, then the assignments' values.
    const bindings = [this.table, id, fingerprint, token, ...t, lease, ...t, lease, ...t, fingerprint, token, lease, lease]
    if (this.#returning) {
      const rows = this.#executing
        ? await this.#execute(this.knex, this.#executeTakeLease, bindings.slice(1))
        : (await this.bound(this.knex.raw(this.#takeLeaseReturning, bindings)))[0]
      const row = (rows as Row[])[0]
      if (row === undefined) return undefined
      if (row.token === token) return { state: 'acquired', token }
      // The upsert left the row alone, so it was live at `now`: in flight or completed.
      return toResult(row)
    }
    const [header] = await this.bound(this.knex.raw(this.#takeLease, bindings))
    const outcome = Number((header as { insertId?: unknown }).insertId)
    if (outcome === 0 || outcome === 1) return { state: 'acquired', token }
    if (outcome !== 2) throw new Error(`KnexStorage: unexpected upsert outcome ${outcome}`)
    return await this.readEntry(id)
  }

  async storeResponse (db: Knex | Knex.Transaction, c: Completion): Promise<number> {
    if (db.isTransaction === true || !this.#executing) return await this.updateCompleted(db, c)
    const header = await this.#execute(db, this.#executeStoreResponse, completeValues(c, this.clock)) as { affectedRows: number }
    return header.affectedRows
  }

  async giveBack (lease: HeldLease): Promise<number> {
    return await this.deleteHeldLease(lease)
  }

  /**
   * Choose the batch with a plain read, then delete by primary key. A DELETE that walks the expiry
   * index locks index entries before rows, the reverse of the order the upsert takes them in, and
   * InnoDB then keeps picking one of the two as a deadlock victim. (MySQL also refuses LIMIT inside
   * an IN subquery.)
   */
  async purgeBatch (batchSize: number): Promise<PurgedBatch> {
    const expired = `expires_at <= ${this.clock.scan}`
    // `id`: a name no renaming of result columns changes (see Row).
    const rows = await this.bound(this.knex(this.table).select('idempotency_key as id').whereRaw(expired, this.clock.values())
      .orderBy('expires_at').limit(batchSize)) as Array<{ id: Buffer }>
    if (rows.length === 0) return { chosen: 0, deleted: 0 }
    const deleted = await this.bound(this.knex(this.table).whereIn('idempotency_key', rows.map((row) => row.id))
      .andWhereRaw(expired, this.clock.values()).del())
    return { chosen: rows.length, deleted: Number(deleted) }
  }

  isDeadlock (error: unknown): boolean {
    const { code, errno } = (error ?? {}) as { code?: unknown, errno?: unknown }
    return errno === 1213 || code === 'ER_LOCK_DEADLOCK'
  }

  /** A deadlock, a lock wait timeout, or (snapshot isolation) a row changed since this transaction read. */
  isConflict (error: unknown): boolean {
    const errno = (error as { errno?: unknown } | null)?.errno
    return this.isDeadlock(error) || errno === 1205 || errno === 1020
  }

  /**
   * InnoDB updates the newest version of a row whatever the transaction's snapshot, so the lease is
   * renewed outside: unless the server checks snapshots on write (MariaDB's
   * innodb_snapshot_isolation, on by default from 11.6): a REPEATABLE READ or SERIALIZABLE
   * transaction then cannot change a row changed after it read (error 1020).
   */
  async leaseHolding (trx: Knex.Transaction, level: IsolationLevel | undefined): Promise<LeaseHolding> {
    this.#session ??= await sessionOf(trx)
    return !this.#session.snapshotIsolation || readsCommitted(level ?? this.#session.level) ? 'outside' : 'locked'
  }

  /**
   * A statement through mysql2's `execute`: prepared once per connection (mysql2 keeps them by
   * text), then sent as values in the binary protocol, where a body travels as bytes rather than
   * hex-encoded text in the statement, and the server does not parse it again.
   */
  async #execute (db: Knex | Knex.Transaction, sql: string, values: unknown[]): Promise<unknown> {
    // Bounded by the server (max_statement_time, in the text): nothing to cancel from here.
    return await onConnection<ExecConnection, unknown>(db, 0, async (connection) => await new Promise((resolve, reject) => {
      connection.execute(sql, values, (error, rows) => { if (error !== null) reject(error); else resolve(rows) })
    }))
  }
}
