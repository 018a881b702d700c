/**
 * SQLite: `takeLease` reads the entry first, so a replay is one read and never a write (which
 * would take SQLite's one write lock); only a key that is absent or dead goes on to the upsert,
 * which takes the row when it is still absent or dead and says with RETURNING whether it did.
 * SQLite runs one writer at a time, so there are no deadlocks to retry.
 *
 * With better-sqlite3, the hot statements (read, upsert, stored response) are prepared once per
 * connection and run on it directly: knex prepares a statement anew on every query, which cost
 * more than running it.
 */
import type { Knex } from 'knex'
import type { BeginResult, IsolationLevel } from '../types.js'
import { BaseDialect, completeSql, completeValues } from './base-dialect.js'
import { driverOf, onConnection } from './connection.js'
import { bounded, clockOf, type Completion, type DialectOptions, type HeldLease, type LeaseHolding, type LeaseRequest, type PurgedBatch } from './dialect.js'
import { COLUMNS, toResult, type Row } from './rows.js'
import { quotedName } from './schema.js'

// Unqualified columns in DO UPDATE ... WHERE are the existing row's. SQLite's 'now' is one
// instant for the whole statement.
const takeLease = (N: string, table: string): string => `INSERT INTO ${table} (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ${N} + ?, ${N} + ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
  fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
  lease_end = excluded.lease_end, expires_at = excluded.expires_at,
  status_code = NULL, content_type = NULL, headers = NULL, body = NULL
WHERE expires_at <= ${N}
RETURNING token`

/** The database's clock in epoch ms, from julianday, which every SQLite version has (unixepoch came in 3.38). */
const NOW = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

const readEntry = (N: string, table: string): string => `SELECT ${COLUMNS} FROM ${table} WHERE idempotency_key = ? AND expires_at > ${N}`

/** A better-sqlite3 statement, as far as it is used here. */
interface SqliteStatement {
  all: (...values: unknown[]) => unknown[]
  run: (...values: unknown[]) => { changes: number }
}
interface SqliteConnection { prepare: (sql: string) => SqliteStatement }

function isBetterSqlite (db: Knex | Knex.Transaction): boolean {
  return driverOf(db) === 'better-sqlite3'
}

/** What `beginTransaction` needs of knex's client: its Transaction, whose `begin` it replaces. */
interface TransactionClient {
  transaction: (container: (trx: Knex.Transaction) => void, config: object, outer: null) => {
    begin: (connection: unknown) => Promise<unknown>
    query: (connection: unknown, sql: string) => Promise<unknown>
    catch: (onRejected: (error: unknown) => void) => unknown
  }
}

/** better-sqlite3 runs each statement to its end synchronously: there is nothing to cancel. */
const unbounded = bounded(0)

export class SqliteDialect extends BaseDialect {
  readonly name = 'sqlite' as const
  readonly #sql: { readEntry: string, takeLease: string, storeResponse: string }
  /** Statements prepared on each connection (better-sqlite3 only), by SQL text. */
  readonly #statements = new WeakMap<SqliteConnection, Map<string, SqliteStatement>>()

  constructor ({ knex, table, now }: DialectOptions) {
    super({ knex, table, clock: clockOf({ now: NOW, scan: NOW, int: '?' }, now), bound: unbounded })
    const quoted = quotedName(table)
    const N = this.clock.now
    this.#sql = { readEntry: readEntry(N, quoted), takeLease: takeLease(N, quoted), storeResponse: completeSql(quoted, N) }
  }

  async takeLease ({ id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const live = await this.#readEntry(id)
    if (live !== undefined) return live
    const t = this.clock.values()
    const rows = await this.#rows(this.#sql.takeLease, [id, fingerprint, token, ...t, lease, ...t, lease, ...t])
    if (rows.length === 1) return { state: 'acquired', token }
    // Another process took the key between the read and the upsert.
    return await this.readEntry(id)
  }

  async storeResponse (db: Knex | Knex.Transaction, c: Completion): Promise<number> {
    // A transaction holds the one connection: its statements go through it, as knex sends them.
    if (db.isTransaction === true || !isBetterSqlite(db)) return await this.updateCompleted(db, c)
    return await this.#prepared(this.#sql.storeResponse, (statement) => statement.run(...completeValues(c, this.clock)).changes)
  }

  async giveBack (lease: HeldLease): Promise<number> {
    return await this.deleteHeldLease(lease)
  }

  async purgeBatch (batchSize: number): Promise<PurgedBatch> {
    return await this.purgeBySubquery(batchSize, { skipLocked: false })
  }

  isDeadlock (): boolean {
    return false
  }

  /** SQLITE_BUSY and its kinds: another connection holds the write lock, or wrote after this transaction's snapshot. */
  isConflict (error: unknown): boolean {
    return String((error as { code?: unknown } | null)?.code).startsWith('SQLITE_BUSY')
  }

  /** The transaction becomes SQLite's one writer (at once when IMMEDIATE): nothing else can renew the lease meanwhile. */
  async leaseHolding (): Promise<LeaseHolding> {
    return 'inside'
  }

  /**
   * SQLite's transactions are all serializable. `serializable` begins IMMEDIATE: the write lock is
   * taken at BEGIN (waiting for it as any writer does), so the transaction is never refused
   * halfway (SQLITE_BUSY when another connection wrote after its snapshot, with WAL). The other
   * levels begin DEFERRED (knex's BEGIN): the write lock at the first write. knex has no option for
   * it, so its transaction's `begin` is replaced before it runs (it runs once a connection is free).
   */
  override async beginTransaction (level: IsolationLevel | undefined): Promise<Knex.Transaction> {
    if (level !== 'serializable') return await this.knex.transaction()
    return await new Promise((resolve, reject) => {
      // As knex.transaction() makes it (knex-builder/make-knex.js).
      const config = { userParams: (this.knex as { userParams?: object }).userParams ?? {}, doNotRejectOnRollback: true }
      const transaction = (this.knex.client as TransactionClient).transaction(resolve, config, null)
      transaction.begin = async (connection) => await transaction.query(connection, 'BEGIN IMMEDIATE;')
      transaction.catch(reject)
    })
  }

  /** `readEntry` on the hot path: prepared once per connection with better-sqlite3. */
  async #readEntry (id: Buffer): Promise<BeginResult | undefined> {
    const rows = await this.#rows(this.#sql.readEntry, [id, ...this.clock.values()]) as Row[]
    return rows.length === 0 ? undefined : toResult(rows[0]!)
  }

  /** The rows of a statement: prepared once per connection with better-sqlite3, through knex otherwise. */
  async #rows (sql: string, values: unknown[]): Promise<unknown[]> {
    if (!isBetterSqlite(this.knex)) return await this.knex.raw(sql, values as Knex.RawBinding[]) as unknown[]
    return await this.#prepared(sql, (statement) => statement.all(...values))
  }

  /** Run `use` with `sql` prepared on a pooled better-sqlite3 connection (once per connection). */
  async #prepared<T> (sql: string, use: (statement: SqliteStatement) => T): Promise<T> {
    return await onConnection<SqliteConnection, T>(this.knex, 0, async (connection) => {
      let statements = this.#statements.get(connection)
      if (statements === undefined) this.#statements.set(connection, statements = new Map())
      let statement = statements.get(sql)
      if (statement === undefined) statements.set(sql, statement = connection.prepare(sql))
      return use(statement)
    })
  }
}
