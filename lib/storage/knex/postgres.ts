/**
 * PostgreSQL: one statement for every outcome of `takeLease`, and a NOTIFY from `storeResponse`
 * and `giveBack` only when a waiter asked for one (see pg-listener.ts, whose statement is here
 * too: `markWaiting`).
 */
import { hash } from 'node:crypto'
import type { Knex } from 'knex'
import type { BeginResult, IsolationLevel } from '../types.js'
import { BaseDialect } from './base-dialect.js'
import { onConnection } from './connection.js'
import { bounded, clockOf, readsCommitted, type Completion, type DialectOptions, type HeldLease, type LeaseHolding, type LeaseRenewal, type LeaseRequest, type PurgedBatch } from './dialect.js'
import { COLUMNS, millis, toResult, type Row } from './rows.js'
import { notificationChannel, quotedName } from './schema.js'

// `live` reads the row as of the statement's snapshot; only when it shows nothing live does
// `taken` try to insert, and ON CONFLICT then decides on the newest row version, under its row
// lock, whether the row is free to take over. A replay is thus a plain read (no row lock, no
// write). When the insert lost to a row committed after our snapshot, both parts come back empty
// and the caller runs the statement again with a fresh snapshot. `N` is the clock: read after the
// row lock, so the lease taken over is measured from when it is written.
const takeLease = (N: string, table: string, B: string): string => `WITH live AS (
  SELECT ${COLUMNS} FROM ${table} WHERE idempotency_key = $1 AND expires_at > ${N}
), taken AS (
  INSERT INTO ${table} AS cur (idempotency_key, fingerprint, state, token, lease_end, expires_at)
  SELECT $1::bytea, $2::text, 'in_flight', $3::text, ${N} + $4::bigint, ${N} + $4::bigint
  WHERE NOT EXISTS (SELECT 1 FROM live)${B}
  ON CONFLICT (idempotency_key) DO UPDATE SET
    fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
    lease_end = ${N} + $4::bigint, expires_at = ${N} + $4::bigint,
    status_code = NULL, content_type = NULL, headers = NULL, body = NULL, waiting = false
  WHERE cur.expires_at <= ${N}
  RETURNING 1
)
SELECT (SELECT count(*) FROM taken)::integer AS taken, live.* FROM (VALUES (1)) AS one LEFT JOIN live ON true`

// `giveBack`: the fenced change, and a NOTIFY for the waiters only when one of them marked the row
// (`waiting`), in the same statement. NOTIFY is not free: at commit it takes a lock global to the
// server, so the commits of all notifying transactions take turns; a lease given back that nobody waits
// for skips it. CASE is the construct whose order of evaluation PostgreSQL guarantees, so pg_notify
// runs only for a marked row. RETURNING gives `waiting` as the newest row version has it: a mark
// that committed while the statement waited for the row lock is seen.
const notifying = (change: string): string => `WITH done AS (
  ${change}
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`
// `storeResponse`, the hot one, is a plain UPDATE: wrapped in the same CTE as `giveBack`, first
// requests measured 0.69 of their floor against 0.82 (bench/analysis.md, "KnexStorage on
// PostgreSQL" under #where-the-cost-is-target-by-target). Its RETURNING says whether somebody waits;
// only then does a second statement send the NOTIFY (in transaction mode, within the
// transaction, so it is delivered at commit). A waiter that marked the row after the UPDATE finds
// the lease gone when it marks, and does not wait.
const storeResponse = (N: string, table: string, B: string): string => `UPDATE ${table} SET state = 'completed', token = NULL, lease_end = ${N},
    status_code = $1, content_type = $2, headers = $3, body = $4, expires_at = ${N} + $5::bigint
  WHERE idempotency_key = $6 AND token = $7 AND state = 'in_flight' AND lease_end > ${N}${B}
  RETURNING waiting`
// Inside a request's transaction, the key's row is changed with INSERT ... ON CONFLICT DO UPDATE,
// never with UPDATE: finding the row for an UPDATE is a read, which a SERIALIZABLE transaction
// records as a predicate lock (on the index pages, or the whole table when the planner scans it,
// as it does a small table), and then every other request's change to those pages or that table is
// a read/write conflict: requests for unrelated keys aborted each other. ON CONFLICT finds the row
// through the unique index without recording a read, and takes its row lock; its WHERE then decides
// on the locked row, by the lease's token alone, as every statement inside a transaction does (see
// heldLease in base-dialect.ts). When the row is gone, the proposed row is inserted instead (a dead
// lease: no token, expired): the statement says nothing was kept, and the transaction is rolled
// back with it.
// `F` is the proposed fingerprint: empty, or with statementTimeout, empty after setting the
// transaction's lock_timeout, which then bounds the wait for the row lock (the values are computed
// before the insert is tried).
const onKeyRow = (table: string, F: string, change: string, held: string, returning: string): string => `INSERT INTO ${table} AS cur (idempotency_key, fingerprint, state, token, lease_end, expires_at)
  VALUES ($1, ${F}, 'in_flight', NULL, 0, 0)
  ON CONFLICT (idempotency_key) DO UPDATE SET ${change}
  WHERE ${held}
  RETURNING ${returning}`
const storeResponseInside = (N: string, table: string, F: string): string => onKeyRow(table, F,
  `state = 'completed', token = NULL, lease_end = ${N}, status_code = $2, content_type = $3, headers = $4, body = $5, expires_at = ${N} + $6::bigint`,
  "cur.token = $7 AND cur.state = 'in_flight'", "cur.state = 'completed' AS kept, cur.waiting")
const renewInside = (N: string, table: string): string => onKeyRow(table, "''",
  `lease_end = ${N} + $3::bigint, expires_at = ${N} + $3::bigint`,
  "cur.token = $2 AND cur.state = 'in_flight'", 'cur.token IS NOT NULL AS kept')

const giveBack = (N: string, B: string): string => notifying(`DELETE FROM ?? WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ${N}${B}`)

// A waiter marks the lease it waits for, and learns in the same step whether it is still held.
const markWaiting = (N: string, B: string): string => `UPDATE ?? SET waiting = true
WHERE idempotency_key = ? AND state = 'in_flight' AND lease_end > ${N}${B}
RETURNING lease_end - ${N} AS remaining`

/**
 * A condition, always true, that sets the server's `lock_timeout` for the statement's own
 * transaction (`set_config(..., true)`: nothing outlives it, whichever server connection a pooler
 * gave the statement). PostgreSQL evaluates a row's conditions before the statement waits for
 * that row's lock, and reads `lock_timeout` when a wait begins: past `ms` the server ends the wait
 * and the statement (55P03), with no cancel from the client, so it works through any pooler. An
 * empty string when nothing is bounded: a `lock_timeout` of the role's or the database's applies.
 */
export function lockWaitBound (ms: number): string {
  return ms === 0 ? '' : `${settingLockTimeout(ms)} IS NOT NULL`
}

/** SQL that sets the transaction's `lock_timeout` to `ms` and is that setting as text. */
function settingLockTimeout (ms: number): string {
  return `set_config('lock_timeout', '${ms}', true)`
}

/**
 * The server's clock in epoch ms: clock_timestamp() advances within a statement (read after a
 * row lock); statement_timestamp() is fixed for it, so an index scan can compare with it.
 */
const SERVER_CLOCK = {
  now: '(extract(epoch from clock_timestamp()) * 1000)::bigint',
  scan: '(extract(epoch from statement_timestamp()) * 1000)::bigint',
  int: '?::bigint'
}

/** A query as node-postgres takes it: by `name` when prepared, with `$n` placeholders. */
export interface PgQuery {
  text: string
  name?: string
  values: unknown[]
}

/**
 * A node-postgres client, as far as the store uses one: a pooled connection for the hot
 * statements, the listening connection (pg-listener.ts) for LISTEN and its notifications.
 */
export interface PgConnection {
  query: (query: PgQuery | string) => Promise<{ rows: unknown[] }>
  on: (event: string, listener: (...args: any[]) => void) => unknown
  off: (event: string, listener: (...args: any[]) => void) => unknown
  end: () => Promise<void>
  unref?: () => void
}

/**
 * A hot statement's text, and its name when it is prepared: node-postgres then sends the text
 * once per connection (Parse) and after that only the values (Bind, Execute), and PostgreSQL plans
 * it once instead of on every call. The name is unique to the table and the text.
 */
interface PgStatement {
  text: string
  name: string | undefined
}

/**
 * 40001 only arises when the server's default isolation is stricter than READ COMMITTED. A
 * statement standing alone is its own transaction, rolled back whole: it may run again. In a
 * request's transaction either aborts it (`isConflict`).
 */
const DEADLOCK_CODES = new Set(['40P01', '40001'])

/**
 * A handler's statement in conflict with another transaction: those, and a lock wait cut short by
 * `lock_timeout` (55P03: a role's, a database's, or `FOR UPDATE NOWAIT`), as MariaDB's lock wait
 * timeout (1205) is. Not retried as a statement standing alone: the store's own lock waits are
 * bounded by `statementTimeout`, and would only wait again.
 */
const CONFLICT_CODES = new Set([...DEADLOCK_CODES, '55P03'])

/**
 * The server does not hold a named statement as node-postgres believes it does (26000: no such
 * statement; 42P05: the name is taken): a pooler between them hands each statement to another
 * server connection (PgBouncer in transaction mode before 1.21). Either error comes before the
 * statement runs.
 */
const LOST_STATEMENT_CODES = new Set(['26000', '42P05'])

export class PostgresDialect extends BaseDialect {
  readonly name = 'postgres' as const
  /** The table's NOTIFY channel (see pg-listener.ts). */
  readonly channel: string
  readonly #statementTimeout: number
  readonly #takeLease: PgStatement
  readonly #storeResponse: PgStatement
  readonly #storeResponseInside: PgStatement
  readonly #renewInside: string
  /**
   * The level the server gives the store's sessions (`default_transaction_isolation`: a role's, a
   * database's, the server's), read by `probeServer`: what a transaction opened without a level
   * runs at (see `leaseHolding`), and what each statement standing alone runs at (see `#send`).
   */
  #sessionLevel = 'read committed'
  readonly #giveBack: string
  readonly #markWaiting: string
  /**
   * Whether hot statements are sent by name: `namedStatements` (by default, unless a pooler is in
   * front), until the server turns out not to hold them.
   */
  #named: boolean
  readonly #namedByChoice: boolean | undefined
  /**
   * What the server probe found (see `probeServer`); shared with `bound`, made before it ran.
   * `strict`: the sessions default to REPEATABLE READ or SERIALIZABLE (see `#send`).
   */
  readonly #path: { pooled: boolean, strict: boolean }

  /**
   * `namedStatements`: name the hot statements, so each connection parses and plans them once.
   * `takeLease` and `storeResponse` run on a connection directly, with `$n` placeholders: knex
   * would format and renumber their values on every call (`onConnection`).
   */
  constructor ({ knex, table, statementTimeout, now, namedStatements }: DialectOptions) {
    const path = { pooled: false, strict: false }
    const lockBound = lockWaitBound(statementTimeout)
    const cancelled = bounded(statementTimeout)
    super({
      knex,
      table,
      clock: clockOf(SERVER_CLOCK, now),
      // A statement built with knex: its lock waits bounded on the server, and, on a direct
      // connection, the statement cancelled by process id past the same time (a table lock, a
      // slow server). Through a pooler that id is the pooler's: the cancel would reach nothing.
      bound: (query) => {
        if (lockBound !== '' && 'andWhereRaw' in query) query.andWhereRaw(lockBound)
        const sent = path.pooled ? query : cancelled(query)
        // Standing alone where the sessions default to REPEATABLE READ or SERIALIZABLE: in a READ
        // COMMITTED transaction of its own, as `#send` does for the hot statements (the lease's
        // renewals beside a request, its give-back, a waiter's mark, a purge, the operations). At
        // the role's SERIALIZABLE each recorded its read of the table, and they failed one another
        // and the requests' transactions as serialization failures: a renewal that failed lost its
        // request's lease (answered 503, or the handler run again on the retry), a give-back that
        // failed left the key locked until the lease lapsed.
        if (!path.strict || (query as { client?: { transacting?: boolean } }).client?.transacting === true) return sent
        return knex.transaction(async (trx) => await sent.transacting(trx), { isolationLevel: 'read committed' }) as unknown as typeof query
      }
    })
    this.#path = path
    this.channel = notificationChannel(table)
    this.#statementTimeout = statementTimeout
    const quoted = quotedName(table)
    const B = lockBound === '' ? '' : ` AND ${lockBound}`
    // With the application's clock (tests), its value is the statement's last parameter.
    const at = (index: number): string => now === undefined ? SERVER_CLOCK.now : `$${index}::bigint`
    const statement = (text: string): PgStatement => ({ text, name: `idempotency_${hash('sha256', text, 'hex').slice(0, 40)}` })
    this.#namedByChoice = namedStatements
    this.#named = namedStatements !== false
    this.#takeLease = statement(takeLease(at(5), quoted, B))
    this.#storeResponse = statement(storeResponse(at(8), quoted, B))
    this.#storeResponseInside = statement(storeResponseInside(at(8), quoted, statementTimeout === 0 ? "''" : `left(${settingLockTimeout(statementTimeout)}, 0)`))
    this.#renewInside = renewInside(at(4), quoted)
    this.#giveBack = giveBack(this.clock.now, B)
    this.#markWaiting = markWaiting(this.clock.now, B)
  }

  /**
   * Whether a pooler (PgBouncer, and the like) stands between the store and the server: the
   * process id a connection was given at connect time is then the pooler's, not its server
   * connection's. Behind one, statements are not cancelled by that id, sent by name only when
   * `preparedStatements: true` says the pooler keeps them (PgBouncer 1.21+), and waits poll.
   */
  get pooled (): boolean {
    return this.#path.pooled
  }

  override async probeServer (): Promise<void> {
    const pid = await onConnection<PgConnection & { processID?: unknown }, [unknown, unknown]>(this.knex, 0, async (connection) =>
      [connection.processID, (await connection.query("SELECT pg_backend_pid() AS pid, current_setting('default_transaction_isolation') AS level")).rows[0]])
    this.#path.pooled = Number(pid[0]) !== Number((pid[1] as { pid: unknown }).pid)
    this.#sessionLevel = String((pid[1] as { level: unknown }).level)
    this.#path.strict = !readsCommitted(this.#sessionLevel)
    if (this.#path.pooled && this.#namedByChoice !== true) this.#named = false
  }

  async takeLease ({ id, fingerprint, token, lease }: LeaseRequest): Promise<BeginResult | undefined> {
    const { rows } = await this.#runHot(this.knex, this.#takeLease, [id, fingerprint, token, lease, ...this.clock.values()])
    const row = rows[0] as (Row & { taken: number }) | undefined
    if (row !== undefined && Number(row.taken) === 1) return { state: 'acquired', token }
    if (row === undefined || row.state === null) return undefined
    return toResult(row)
  }

  /** In a transaction, through ON CONFLICT (see `onKeyRow`): whatever its level, it records no read. */
  async storeResponse (db: Knex | Knex.Transaction, c: Completion): Promise<number> {
    if (db.isTransaction === true) {
      const { rows } = await this.#runHot(db, this.#storeResponseInside, [c.id, c.statusCode, c.contentType, c.headers, c.body, c.ttl, c.token, ...this.clock.values()])
      const row = rows[0] as { kept: boolean, waiting: boolean } | undefined
      if (row?.kept !== true) return 0
      if (row.waiting) await this.#notify(db, c.id)
      return 1
    }
    const { rows } = await this.#runHot(db, this.#storeResponse, [c.statusCode, c.contentType, c.headers, c.body, c.ttl, c.id, c.token, ...this.clock.values()])
    if (rows.length === 0) return 0
    if ((rows[0] as { waiting: boolean }).waiting) await this.#notify(db, c.id)
    return rows.length
  }

  /** In a transaction (its lease held there), through ON CONFLICT, as `storeResponse`. */
  override async renewLease (renewal: LeaseRenewal, db: Knex | Knex.Transaction = this.knex): Promise<number> {
    if (db.isTransaction !== true) return await super.renewLease(renewal, db)
    const { rows } = await this.#send(db, { text: this.#renewInside, values: [renewal.id, renewal.token, renewal.lease, ...this.clock.values()] })
    return (rows[0] as { kept: boolean } | undefined)?.kept === true ? 1 : 0
  }

  /**
   * A transaction that reads what others committed after it began (READ COMMITTED) stores its
   * response over renewals committed beside it; at REPEATABLE READ and SERIALIZABLE, changing a
   * row changed after the snapshot is a serialization failure, so the transaction holds the lease.
   * The level is the one asked for, or the sessions' default (a role's or a database's
   * `default_transaction_isolation`, read by `probeServer`).
   */
  async leaseHolding (_trx: Knex.Transaction, level: IsolationLevel | undefined): Promise<LeaseHolding> {
    return readsCommitted(level ?? this.#sessionLevel) ? 'outside' : 'locked'
  }

  isConflict (error: unknown): boolean {
    return CONFLICT_CODES.has(String((error as { code?: unknown } | null)?.code))
  }

  /** Notifications carry the key's bytes in base64. */
  async giveBack ({ id, token }: HeldLease): Promise<number> {
    const { rows } = await this.bound(this.knex.raw(this.#giveBack, [this.table, id, token, ...this.clock.values(), this.channel, id.toString('base64')]))
    return Number((rows[0] as { changed: unknown }).changed)
  }

  async purgeBatch (batchSize: number): Promise<PurgedBatch> {
    return await this.purgeBySubquery(batchSize, { skipLocked: true })
  }

  async wakeWaiters (id: Buffer): Promise<void> {
    await this.#notify(this.knex, id)
  }

  /**
   * Mark the held lease on `id` as waited for, so that its end is notified: the ms it has left, or
   * `undefined` when it is not held any more.
   */
  async markWaiting (id: Buffer): Promise<number | undefined> {
    const { rows } = await this.bound(this.knex.raw(this.#markWaiting, [this.table, id, ...this.clock.values(), ...this.clock.values()]))
    return rows.length === 0 ? undefined : millis((rows[0] as { remaining: unknown }).remaining)
  }

  isDeadlock (error: unknown): boolean {
    return DEADLOCK_CODES.has(String((error as { code?: unknown } | null)?.code))
  }

  async #notify (db: Knex | Knex.Transaction, id: Buffer): Promise<void> {
    await this.bound(db.raw('SELECT pg_notify(?, ?)', [this.channel, id.toString('base64')]))
  }

  /**
   * A hot statement, on a connection of `db` (the pool's, or a transaction's). When the server
   * turns out not to hold the named statements, the store sends them unnamed from then on, with a
   * process warning, and sends this one again unnamed: it did not run. Inside a transaction the
   * error has aborted it, so it is passed on (the request's transaction fails, as on any store
   * error), and the next requests are unaffected.
   */
  async #runHot (db: Knex | Knex.Transaction, { text, name }: PgStatement, values: unknown[]): Promise<{ rows: unknown[] }> {
    if (!this.#named) return await this.#send(db, { text, values })
    try {
      return await this.#send(db, { text, name, values })
    } catch (error) {
      const code = String((error as { code?: unknown } | null)?.code)
      if (!LOST_STATEMENT_CODES.has(code)) throw error
      if (this.#named) {
        // Once, though several requests may meet it at the same time.
        this.#named = false
        process.emitWarning(`PostgreSQL does not hold the store's prepared statements (${code}: ${(error as Error).message}), ` +
          'as behind PgBouncer in transaction mode before 1.21: they are sent unprepared from now on. ' +
          'Set preparedStatements: false to start that way.', { type: 'FastifyIdempotencyWarning', code: 'FASTIFY_IDEMPOTENCY_UNPREPARED' })
      }
      if ((db as Partial<Knex.Transaction>).isTransaction === true) throw error
      return await this.#send(db, { text, values })
    }
  }

  /** One query on a connection of `db`. */
  /**
   * One query on a connection of `db`. Standing alone, where the sessions default to REPEATABLE
   * READ or SERIALIZABLE (a role's `default_transaction_isolation`), it runs in a READ COMMITTED
   * transaction of its own, at the cost of two round trips: its correctness rests on row locks and
   * ON CONFLICT, never on the level, and a serializable statement would record its read of the
   * table (its index pages, or the whole table when it is small and scanned), so that the
   * statements of unrelated keys, and the requests' transactions that write the table, aborted
   * each other as serialization failures (measured: 1 to 8 requests in 200, 40 at a time, in
   * transaction mode; and `complete` failing its five retries in plain mode).
   */
  async #send (db: Knex | Knex.Transaction, query: PgQuery): Promise<{ rows: unknown[] }> {
    const cancelAfter = this.#path.pooled ? 0 : this.#statementTimeout
    const strict = this.#path.strict && db.isTransaction !== true
    return await onConnection<PgConnection, { rows: unknown[] }>(db, cancelAfter, async (connection) => {
      if (!strict) return await connection.query(query)
      await connection.query('BEGIN ISOLATION LEVEL READ COMMITTED')
      try {
        const result = await connection.query(query)
        await connection.query('COMMIT')
        return result
      } catch (error) {
        await connection.query('ROLLBACK').catch(() => {})
        throw error
      }
    })
  }
}
