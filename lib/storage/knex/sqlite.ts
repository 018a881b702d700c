/**
 * SQLite: `begin` reads the row first, so a replay is one read and never a write (which would take
 * SQLite's one write lock); only a key that is absent or dead goes on to the upsert, which takes
 * the row when it is still absent or dead and says with RETURNING whether it did. SQLite runs one
 * writer at a time, so there are no deadlocks to retry.
 *
 * With better-sqlite3, the hot statements (read, upsert, complete) are prepared once per
 * connection and run on it directly: knex prepares a statement anew on every query, which cost
 * more than running it.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, clockOf, completeSql, deleteLease, driverOf, onConnection, extendLease, purgeBySubquery, updateCompleted, type Clock, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { COLUMNS, readLive, toResult, type Row } from './rows.js'
import { quotedName } from './schema.js'

// Unqualified columns in DO UPDATE ... WHERE are the existing row's. SQLite's 'now' is one
// instant for the whole statement.
const begin = (N: string, table: string): string => `INSERT INTO ${table} (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ${N} + ?, ${N} + ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
  fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
  lease_end = excluded.lease_end, expires_at = excluded.expires_at,
  status_code = NULL, content_type = NULL, headers = NULL, body = NULL
WHERE expires_at <= ${N}
RETURNING token`

/** The database's clock in epoch ms, from julianday, which every SQLite version has (unixepoch came in 3.38). */
const NOW = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

const readLiveSql = (N: string, table: string): string => `SELECT ${COLUMNS} FROM ${table} WHERE idempotency_key = ? AND expires_at > ${N}`

/** A better-sqlite3 statement, as far as it is used here. */
interface Statement {
  all: (...values: unknown[]) => unknown[]
  run: (...values: unknown[]) => { changes: number }
}
interface Connection { prepare: (sql: string) => Statement }

function isBetterSqlite (db: Knex | Knex.Transaction): boolean {
  return driverOf(db) === 'better-sqlite3'
}

/** better-sqlite3 runs each statement to its end synchronously: there is nothing to cancel. */
const unbounded = bounded(0)

export class SqliteDialect implements Dialect {
  readonly name = 'sqlite' as const
  readonly clock: Clock
  readonly bound = unbounded
  readonly #sql: { readLive: string, begin: string, complete: string }
  /** Statements prepared on each connection (better-sqlite3 only), by SQL text. */
  readonly #prepared = new WeakMap<Connection, Map<string, Statement>>()

  constructor (table: string, now: (() => number) | undefined) {
    this.clock = clockOf({ now: NOW, scan: NOW, int: '?' }, now)
    const quoted = quotedName(table)
    this.#sql = { readLive: readLiveSql(this.clock.now, quoted), begin: begin(this.clock.now, quoted), complete: completeSql(quoted, this.clock.now) }
  }

  async prepare (): Promise<void> {}

  async begin (knex: Knex, table: string, { id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const live = await this.#readLive(knex, table, id)
    if (live !== undefined) return live
    const t = this.clock.values()
    const rows = await this.#run(knex, this.#sql.begin, [id, fingerprint, token, ...t, lease, ...t, lease, ...t], 'all') as unknown[]
    if (rows.length === 1) return { state: 'acquired', token }
    // Another process took the key between the read and the upsert.
    return await readLive(knex, table, id, this.clock, unbounded)
  }

  async complete (db: Knex | Knex.Transaction, table: string, c: Completion): Promise<number> {
    // A transaction holds the one connection: its statements go through it, as knex sends them.
    if (db.isTransaction === true || !isBetterSqlite(db)) return await updateCompleted(db, table, c, this.clock, unbounded)
    const t = this.clock.values()
    return await this.#run(db, this.#sql.complete, [...t, c.statusCode, c.contentType, c.headers, c.body, ...t, c.ttl, c.id, c.token, ...t], 'run') as number
  }

  async release (knex: Knex, table: string, id: Buffer, token: string): Promise<number> {
    return await deleteLease(knex, table, id, token, this.clock, unbounded)
  }

  async renew (knex: Knex, table: string, id: Buffer, token: string, lease: number): Promise<number> {
    return await extendLease(knex, table, id, token, lease, this.clock, unbounded)
  }

  async purgeBatch (knex: Knex, table: string, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    return await purgeBySubquery(knex, table, batchSize, false, this.clock, unbounded)
  }

  isDeadlock (): boolean {
    return false
  }

  async #readLive (knex: Knex, table: string, id: Buffer): Promise<BeginResult | undefined> {
    const rows = await this.#run(knex, this.#sql.readLive, [id, ...this.clock.values()], 'all') as Row[]
    return rows.length === 0 ? undefined : toResult(rows[0]!)
  }

  /** A statement with better-sqlite3, prepared once per connection; a read through knex otherwise. */
  async #run (knex: Knex, sql: string, values: unknown[], mode: 'all' | 'run'): Promise<unknown[] | number> {
    if (!isBetterSqlite(knex)) return await knex.raw(sql, values as Knex.RawBinding[]) as unknown[]
    return await onConnection<Connection, unknown[] | number>(knex, 0, async (connection) => {
      let statements = this.#prepared.get(connection)
      if (statements === undefined) this.#prepared.set(connection, statements = new Map())
      let statement = statements.get(sql)
      if (statement === undefined) statements.set(sql, statement = connection.prepare(sql))
      return mode === 'all' ? statement.all(...values) : statement.run(...values).changes
    })
  }
}
