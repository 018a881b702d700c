/**
 * SQLite: the upsert takes the row when it is absent or dead, and RETURNING says whether it did;
 * a replay reads the row with a second statement. SQLite runs one writer at a time, so there are
 * no deadlocks to retry.
 */
import type { Knex } from 'knex'
import type { BeginResult } from '../types.js'
import { bounded, deleteLease, extendLease, purgeBySubquery, updateCompleted, type Completion, type Dialect, type LeaseRequest } from './dialect.js'
import { readLive } from './rows.js'

// Unqualified columns in DO UPDATE ... WHERE are the existing row's.
const BEGIN = `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ?, ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
  fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
  lease_end = excluded.lease_end, expires_at = excluded.expires_at,
  status_code = NULL, content_type = NULL, headers = NULL, body = NULL
WHERE expires_at <= ?
RETURNING token`

/** better-sqlite3 runs each statement to its end synchronously: there is nothing to cancel. */
const unbounded = bounded(0)

export class SqliteDialect implements Dialect {
  readonly name = 'sqlite' as const

  async prepare (): Promise<void> {}

  async begin (knex: Knex, table: string, { id, fingerprint, token, now, leaseEnd }: LeaseRequest): Promise<BeginResult | undefined> {
    const rows = await knex.raw(BEGIN, [table, id, fingerprint, token, leaseEnd, leaseEnd, now])
    if ((rows as unknown[]).length === 1) return { state: 'acquired', token }
    return await readLive(knex, table, id, now, unbounded)
  }

  async complete (db: Knex | Knex.Transaction, table: string, completion: Completion): Promise<number> {
    return await updateCompleted(db, table, completion, unbounded)
  }

  async release (knex: Knex, table: string, id: Buffer, token: string, now: number): Promise<number> {
    return await deleteLease(knex, table, id, token, now, unbounded)
  }

  async renew (knex: Knex, table: string, id: Buffer, token: string, now: number, leaseEnd: number): Promise<number> {
    return await extendLease(knex, table, id, token, now, leaseEnd, unbounded)
  }

  async purgeBatch (knex: Knex, table: string, now: number, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    return await purgeBySubquery(knex, table, now, batchSize, false, unbounded)
  }

  isDeadlock (): boolean {
    return false
  }
}
