/**
 * SQLite: the upsert takes the row when it is absent or dead, and RETURNING says whether it did;
 * a replay reads the row with a second statement. SQLite runs one writer at a time, so there are
 * no deadlocks to retry.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, clockOf, deleteLease, extendLease, purgeBySubquery, updateCompleted, type Clock, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { readLive } from './rows.js'

// Unqualified columns in DO UPDATE ... WHERE are the existing row's. SQLite's 'now' is one
// instant for the whole statement.
const begin = (N: string): string => `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ${N} + ?, ${N} + ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
  fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
  lease_end = excluded.lease_end, expires_at = excluded.expires_at,
  status_code = NULL, content_type = NULL, headers = NULL, body = NULL
WHERE expires_at <= ${N}
RETURNING token`

/** The database's clock in epoch ms, from julianday, which every SQLite version has (unixepoch came in 3.38). */
const NOW = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"

/** better-sqlite3 runs each statement to its end synchronously: there is nothing to cancel. */
const unbounded = bounded(0)

export class SqliteDialect implements Dialect {
  readonly name = 'sqlite' as const
  readonly clock: Clock
  readonly #begin: string

  constructor (now: (() => number) | undefined) {
    this.clock = clockOf({ now: NOW, scan: NOW, int: '?' }, now)
    this.#begin = begin(this.clock.now)
  }

  async prepare (): Promise<void> {}

  async begin (knex: Knex, table: string, { id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const t = this.clock.values()
    const rows = await knex.raw(this.#begin, [table, id, fingerprint, token, ...t, lease, ...t, lease, ...t])
    if ((rows as unknown[]).length === 1) return { state: 'acquired', token }
    return await readLive(knex, table, id, this.clock, unbounded)
  }

  async complete (db: Knex | Knex.Transaction, table: string, completion: Completion): Promise<number> {
    return await updateCompleted(db, table, completion, this.clock, unbounded)
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
}
