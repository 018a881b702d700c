/**
 * The steps every dialect writes the same way, with knex's query builder: reading a live entry,
 * renewing a lease, and (where a dialect has nothing faster) storing a response, giving a lease
 * back and purging. Each dialect extends this with the statements that differ.
 */
import type { Knex } from 'knex'
import type { BeginResult, IsolationLevel } from '../types.js'
import type { Bound, Clock, Completion, Dialect, HeldLease, LeaseHolding, LeaseRenewal, LeaseRequest, PurgedBatch } from './dialect.js'
import { READ_COLUMNS, toResult, type Row } from './rows.js'
import type { SqlDialect } from './schema.js'

/**
 * `storeResponse` as one statement text with `?` placeholders (the clock's values, status, content
 * type, headers, body, the clock's values, ttl, key, token, the clock's values), for the dialects
 * that prepare it themselves (MariaDB, SQLite); the same fenced UPDATE as `updateCompleted`.
 * `table` is quoted already, `N` the clock. `lease_end` keeps when the lease ended: when the
 * response was stored.
 */
export function completeSql (table: string, N: string): string {
  return `UPDATE ${table} SET state = 'completed', token = NULL, lease_end = ${N}, status_code = ?, content_type = ?, headers = ?, body = ?, expires_at = ${N} + ?
WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ${N}`
}

/** The values of `completeSql`, in the order of its placeholders. */
export function completeValues (c: Completion, clock: Clock): unknown[] {
  const t = clock.values()
  return [...t, c.statusCode, c.contentType, c.headers, c.body, ...t, c.ttl, c.id, c.token, ...t]
}

export abstract class BaseDialect implements Dialect {
  abstract readonly name: SqlDialect
  readonly knex: Knex
  readonly table: string
  readonly clock: Clock
  readonly bound: Bound

  constructor (parts: { knex: Knex, table: string, clock: Clock, bound: Bound }) {
    this.knex = parts.knex
    this.table = parts.table
    this.clock = parts.clock
    this.bound = parts.bound
  }

  abstract takeLease (request: LeaseRequest): Promise<BeginResult | undefined>
  abstract storeResponse (db: Knex | Knex.Transaction, completion: Completion): Promise<number>
  abstract giveBack (lease: HeldLease): Promise<number>
  abstract purgeBatch (batchSize: number): Promise<PurgedBatch>
  abstract isDeadlock (error: unknown): boolean
  abstract isConflict (error: unknown): boolean
  abstract leaseHolding (trx: Knex.Transaction, level: IsolationLevel | undefined): Promise<LeaseHolding>

  /** knex's transaction at `level`: `BEGIN ISOLATION LEVEL` on PostgreSQL, `SET TRANSACTION` before `BEGIN` on MySQL. */
  async beginTransaction (level: IsolationLevel | undefined): Promise<Knex.Transaction> {
    return await this.knex.transaction(level === undefined ? undefined : { isolationLevel: level })
  }

  /** Nothing to learn of the server, unless a dialect says otherwise. */
  async probeServer (): Promise<void> {}

  async readEntry (id: Buffer): Promise<BeginResult | undefined> {
    const row = await this.bound(this.knex(this.table).first(READ_COLUMNS).where('idempotency_key', id)
      .andWhereRaw(`expires_at > ${this.clock.now}`, this.clock.values())) as Row | undefined
    return row === undefined ? undefined : toResult(row)
  }

  /**
   * The lease end is also when the row stops mattering. In a request's transaction, through it;
   * otherwise standing alone (which `bound` runs at READ COMMITTED on a stricter PostgreSQL session).
   */
  async renewLease ({ lease, ...held }: LeaseRenewal, db: Knex | Knex.Transaction = this.knex): Promise<number> {
    return Number(await this.bound(this.heldLease(db, held).update({ lease_end: this.fromNow(lease, db), expires_at: this.fromNow(lease, db) })))
  }

  /** `storeResponse` as a plain fenced UPDATE built by knex. */
  protected async updateCompleted (db: Knex | Knex.Transaction, c: Completion): Promise<number> {
    return Number(await this.bound(this.heldLease(db, c).update({
      state: 'completed',
      token: null,
      // When the lease ended, which is when the response was stored (`inspect` reports it).
      lease_end: db.raw(this.clock.now, this.clock.values()),
      status_code: c.statusCode,
      content_type: c.contentType,
      headers: c.headers,
      body: c.body,
      expires_at: this.fromNow(c.ttl, db)
    })))
  }

  /** `giveBack` as a plain fenced DELETE. */
  protected async deleteHeldLease (lease: HeldLease): Promise<number> {
    return Number(await this.bound(this.heldLease(this.knex, lease).del()))
  }

  /**
   * A purge batch chosen by a subquery and deleted in the same statement (PostgreSQL, SQLite). The
   * outer condition is checked again on the row as it is when deleted, so a row that a
   * `takeLease` took over after the batch was chosen survives. `skipLocked`: concurrent purges take
   * disjoint batches instead of waiting on each other.
   */
  protected async purgeBySubquery (batchSize: number, { skipLocked }: { skipLocked: boolean }): Promise<PurgedBatch> {
    const values = this.clock.values()
    const expired = `expires_at <= ${this.clock.scan}`
    const batch = this.knex(this.table).select('idempotency_key').whereRaw(expired, values).limit(batchSize)
    if (skipLocked) batch.forUpdate().skipLocked()
    const deleted = Number(await this.bound(this.knex(this.table).whereIn('idempotency_key', batch).andWhereRaw(expired, values).del()))
    return { chosen: deleted, deleted }
  }

  /**
   * The fenced row of a held lease: its token, and a lease that has not lapsed. Inside a
   * transaction (transaction mode: a request's, or a recovery point's), the token alone. A lease is
   * taken over only by writing a new token, and given back only by deleting the row, so a row that
   * still holds the token is still the lease's, lapsed or not. And where the transaction holds the
   * lease, its renewals go through its own connection, which a statement of the handler may keep
   * busy for longer than `lockTimeout` (waiting for a lock a migration holds, say): the lease then
   * lapses in the transaction's view while the transaction, holding the row's lock, keeps every
   * other writer out.
   */
  private heldLease (db: Knex | Knex.Transaction, { id, token }: HeldLease): Knex.QueryBuilder {
    const row = db(this.table).where({ idempotency_key: id, token, state: 'in_flight' })
    return db.isTransaction === true ? row : row.andWhereRaw(`lease_end > ${this.clock.now}`, this.clock.values())
  }

  /** `ms` from now, as a value to write. */
  private fromNow (ms: number, db: Knex | Knex.Transaction = this.knex): Knex.Raw {
    return db.raw(`${this.clock.now} + ${this.clock.int}`, [...this.clock.values(), ms])
  }
}
