import { randomUUID } from 'node:crypto'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Knex } from 'knex'
import type { FastifyRequest } from 'fastify'
import type { BeginResult, StorageTransaction, StoredResponse, TransactionalStorage } from './types.js'
import {
  createIdempotencyTable,
  DEFAULT_TABLE_NAME,
  MAX_KEY_BYTES,
  notificationChannel,
  sqlDialect,
  type SqlDialect
} from './knex-schema.js'

export {
  createIdempotencyTable,
  dropIdempotencyTable,
  DEFAULT_TABLE_NAME,
  MAX_KEY_BYTES,
  type SqlDialect
} from './knex-schema.js'

export interface KnexStorageOptions {
  /** A knex instance (pg, mysql2/mysql, better-sqlite3/sqlite3). Never destroyed by the storage. */
  knex: Knex
  /** Table holding keys, leases and responses; may be schema-qualified. Default `'idempotency_keys'`. */
  tableName?: string
  /** Create the table and its index on first use if missing (`CREATE TABLE IF NOT EXISTS`). Default `false`. */
  createTable?: boolean
  /** Clock in epoch milliseconds; tests inject one. Default `Date.now`. */
  now?: () => number
}

export interface PurgeExpiredOptions {
  /** Rows deleted per statement, so a large purge never holds long locks. Default 1000. */
  batchSize?: number
}

/** A row as the drivers return it: BIGINTs may be strings (pg) or bigints (safeIntegers). */
interface Row {
  fingerprint: string
  state: string
  token?: string | null
  lease_end: unknown
  status_code: unknown
  content_type: string | null
  headers: string | null
  body: unknown
}

const COLUMNS = 'fingerprint, state, lease_end, status_code, content_type, headers, body'
const READ_COLUMNS = ['fingerprint', 'state', 'lease_end', 'status_code', 'content_type', 'headers', 'body']

/**
 * How often `begin` starts over when the row it lost to changed before it could be read (a purge,
 * a release, an expiry in between). Each round needs a concurrent change to fail, so a few suffice.
 */
const BEGIN_ROUNDS = 10
/** Retries of a statement chosen as a deadlock victim (it was rolled back whole, so it can rerun). */
const DEADLOCK_RETRIES = 5

// PostgreSQL, one statement for every outcome. `live` reads the row as of the statement's snapshot;
// only when it shows nothing live does `taken` try to insert, and ON CONFLICT then decides on the
// newest row version, under its row lock, whether the row is free to take over. A replay is thus
// a plain read (no row lock, no write). When the insert lost to a row committed after our snapshot,
// both parts come back empty and the caller runs the statement again with a fresh snapshot.
const POSTGRES_BEGIN = `WITH live AS (
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

// SQLite: the upsert takes the row when it is absent or dead, and RETURNING says whether it did.
// Unqualified columns in DO UPDATE ... WHERE are the existing row's.
const SQLITE_BEGIN = `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
VALUES (?, ?, 'in_flight', ?, ?, ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
  fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
  lease_end = excluded.lease_end, expires_at = excluded.expires_at,
  status_code = NULL, content_type = NULL, headers = NULL, body = NULL
WHERE expires_at <= ?
RETURNING token`

// MySQL/MariaDB: ON DUPLICATE KEY UPDATE has no WHERE, so each assignment carries the condition.
// Assignments run left to right and see the columns already assigned, so `expires_at`, which the
// condition reads, comes last. affectedRows cannot tell an insert from an untouched row when the
// client sets CLIENT_FOUND_ROWS (mysql2 does by default), so LAST_INSERT_ID(expr), which the
// server reports as the OK packet's insertId, does: 0 inserted, 1 taken over, 2 left alone.
const MYSQL_BEGIN = `INSERT INTO ?? (idempotency_key, fingerprint, state, token, lease_end, expires_at)
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
// MariaDB 10.5+ returns the row as it stands after the upsert, whichever branch ran: the
// replay needs no second statement.
const MARIADB_BEGIN = `${MYSQL_BEGIN}
RETURNING token, ${COLUMNS}`

// PostgreSQL `complete` and `release`: the fenced change, and a NOTIFY for the waiters only when
// one of them marked the row (`waiting`, see `waitFor`), in the same statement. NOTIFY is not
// free: at commit it takes a lock global to the server, so the commits of all notifying
// transactions take turns; a complete or release nobody waits for skips it. CASE is the construct
// whose order of evaluation PostgreSQL guarantees, so pg_notify runs only for a marked row.
// RETURNING gives `waiting` as the newest row version has it: a mark that committed while the
// statement waited for the row lock is seen.
const POSTGRES_COMPLETE = `WITH done AS (
  UPDATE ?? SET state = 'completed', token = NULL, lease_end = NULL, status_code = ?, content_type = ?,
    headers = ?, body = ?, expires_at = ?
  WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ?
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`
const POSTGRES_RELEASE = `WITH done AS (
  DELETE FROM ?? WHERE idempotency_key = ? AND token = ? AND state = 'in_flight' AND lease_end > ?
  RETURNING waiting
)
SELECT count(*)::integer AS changed, count(CASE WHEN waiting THEN pg_notify(?, ?) END)::integer AS notified FROM done`
// A waiter marks the lease it waits for, and learns in the same step whether it is still held.
const POSTGRES_MARK_WAITING = `UPDATE ?? SET waiting = true
WHERE idempotency_key = ? AND state = 'in_flight' AND lease_end > ?
RETURNING lease_end`

/** setTimeout's longest delay; a longer one fires at once. */
const MAX_TIMER_MS = 2 ** 31 - 1

/** One pending `waitFor`. */
interface Waiter {
  /** The key as notifications carry it: its UTF-8 bytes in base64. */
  name: string
  resolve: () => void
  reject: (error: unknown) => void
  timer: NodeJS.Timeout
  /** When `timer` fires at the latest, on `performance.now()`'s clock. */
  deadline: number
  settled: boolean
}

/** The listening connection: a pg `Client` of knex's driver, outside knex's pool. */
interface PgConnection {
  query: (sql: string) => Promise<unknown>
  on: (event: string, listener: (...args: any[]) => void) => unknown
  end: () => Promise<void>
  unref?: () => void
}

interface Listener {
  /** Resolves once LISTEN is in effect. */
  ready: Promise<PgConnection>
  connection: PgConnection | undefined
  /** Why the connection is gone (it failed, or the storage closed it). */
  failure: Error | undefined
}

/** The part of knex's (untyped) pg client that opens connections outside its pool. */
interface KnexPgClient {
  acquireRawConnection?: () => Promise<PgConnection>
  connectionSettings?: unknown
  config?: { connectionPool?: unknown }
}

/**
 * Whether the storage can open its own listening connection: knex's pg client opens connections
 * from its configuration. With an external `connectionPool`, knex has no configuration to open
 * one with, and the plugin polls instead.
 */
function canListen (knex: Knex): boolean {
  const client = knex.client as KnexPgClient | undefined
  return typeof client?.acquireRawConnection === 'function' && client.config?.connectionPool === undefined
}

const LONE_SURROGATE = /\p{Surrogate}/u

function encodeKey (key: string): Buffer {
  if (typeof key !== 'string') throw new TypeError('KnexStorage: the key must be a string')
  // UTF-8 would turn a lone surrogate into U+FFFD, and two different keys into one row.
  if (LONE_SURROGATE.test(key)) throw new TypeError('KnexStorage: the key is not well-formed Unicode (lone surrogate)')
  const bytes = Buffer.from(key, 'utf8')
  if (bytes.length > MAX_KEY_BYTES) {
    throw new TypeError(`KnexStorage: the key is ${bytes.length} bytes in UTF-8; the table holds at most ${MAX_KEY_BYTES}`)
  }
  return bytes
}

function duration (value: number, name: string): number {
  if (typeof value !== 'number' || !Number.isFinite(value) || value <= 0) {
    throw new TypeError(`KnexStorage: ${name} must be a positive number of milliseconds`)
  }
  // The columns are integers; a fractional timeout must not make the driver or server choke.
  return Math.ceil(value)
}

/** BIGINT as the drivers return it (number, numeric string from pg, bigint) → number. */
function millis (value: unknown): number {
  const result = typeof value === 'number' ? value : Number(value as string | bigint)
  if (!Number.isSafeInteger(result)) throw new Error(`KnexStorage: unexpected time value ${String(value)}`)
  return result
}

function toBuffer (value: unknown): Buffer {
  if (Buffer.isBuffer(value)) return value
  if (value === null || value === undefined) return Buffer.alloc(0)
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength)
  throw new Error(`KnexStorage: unexpected body type ${typeof value}`)
}

function toResult (row: Row): BeginResult {
  if (row.state === 'completed') {
    return {
      state: 'completed',
      fingerprint: row.fingerprint,
      response: {
        statusCode: Number(row.status_code),
        contentType: row.content_type ?? null,
        headers: row.headers === null ? {} : JSON.parse(row.headers),
        body: toBuffer(row.body)
      }
    }
  }
  if (row.state === 'in_flight') {
    return { state: 'in-flight', fingerprint: row.fingerprint, lockExpiresAt: millis(row.lease_end) }
  }
  throw new Error(`KnexStorage: unexpected state ${JSON.stringify(row.state)} in the idempotency table`)
}

function isDeadlock (dialect: SqlDialect, error: unknown): boolean {
  const { code, errno } = (error ?? {}) as { code?: unknown, errno?: unknown }
  if (dialect === 'mysql') return errno === 1213 || code === 'ER_LOCK_DEADLOCK'
  // 40001 only arises when the server's default isolation is stricter than READ COMMITTED.
  if (dialect === 'postgres') return code === '40P01' || code === '40001'
  return false
}

/** Longest error message (and `sql`) passed on; see `trimmed`. */
const MAX_ERROR_TEXT = 2048

/**
 * knex writes the statement with its values into the error message, and mysql2 adds it as `sql`:
 * for a failed `complete` that is the whole body, hex-encoded, and it would end up in the logs.
 * The message keeps its start (the statement) and its end (the server's reason).
 */
function trimmed (error: unknown): unknown {
  if (error instanceof Error) {
    const half = MAX_ERROR_TEXT / 2
    if (error.message.length > MAX_ERROR_TEXT) {
      error.message = `${error.message.slice(0, half)} … (${error.message.length - MAX_ERROR_TEXT} characters cut) … ${error.message.slice(-half)}`
    }
    const withSql = error as Error & { sql?: unknown }
    if (typeof withSql.sql === 'string' && withSql.sql.length > MAX_ERROR_TEXT) withSql.sql = `${withSql.sql.slice(0, MAX_ERROR_TEXT)} … (cut)`
  }
  return error
}

/** MariaDB 10.5 added INSERT ... RETURNING; MySQL has none. */
function hasInsertReturning (version: string): boolean {
  // Anywhere in the string: some servers put a compatibility prefix ('5.5.5-') before it.
  const match = /(\d+)\.(\d+)\.\d+-mariadb/i.exec(version)
  if (match === null) return false
  const major = Number(match[1])
  const minor = Number(match[2])
  return major > 10 || (major === 10 && minor >= 5)
}

/**
 * An `IdempotencyStorage` on PostgreSQL, MySQL/MariaDB or SQLite through knex.
 *
 * One row per key, the key as primary key. `begin` is a single conditional upsert that takes the
 * row when it is absent, expired or its lease lapsed, so two requests can never both hold a key;
 * `complete`, `release` and `renew` are single statements conditioned on the fencing token.
 * All times are epoch milliseconds from the application's clock.
 */
/**
 * The knex transaction of a request on a route in transaction mode (`transaction: true`), typed.
 * Throws when the request has none (the route is not in transaction mode, or has no key).
 */
export function transactionOf (request: FastifyRequest): Knex.Transaction {
  const transaction = (request as FastifyRequest & { idempotency?: { transaction?: unknown } | null }).idempotency?.transaction
  if (transaction === undefined || transaction === null) {
    throw new Error('fastify-idempotency: this request has no transaction (is the route in transaction mode, with KnexStorage, and did the request carry an Idempotency-Key?)')
  }
  return transaction as Knex.Transaction
}

export class KnexStorage implements TransactionalStorage {
  readonly #knex: Knex
  readonly #table: string
  readonly #dialect: SqlDialect
  readonly #createTable: boolean
  readonly #now: () => number
  #ready: Promise<void> | undefined
  #prepared = false
  /** MariaDB 10.5+: `begin` returns the row in the upsert itself. */
  #returning = false
  /** PostgreSQL: the table's NOTIFY channel, and the waiting side (see `waitFor`). */
  readonly #channel: string = ''
  #listener: Listener | undefined
  /** Every pending `waitFor`; and by key, those listening for a notification. */
  readonly #pending = new Set<Waiter>()
  readonly #waiters = new Map<string, Set<Waiter>>()

  /**
   * PostgreSQL only (the property is absent on MySQL/MariaDB and SQLite, where the plugin polls
   * `begin` instead): resolve once the lease on `key` was completed or released (woken by
   * LISTEN/NOTIFY, from any process), or lapsed, or after `timeout` ms. Rejects when the listening
   * connection fails (the plugin then polls); the next call opens a new one.
   *
   * One connection per storage, outside knex's pool, opened on the first call and shared by all
   * waiters; `close()` ends it. A waiter listens first, then marks the row (`waiting`), which both
   * asks `complete`/`release` to notify and tells whether the lease is still held: an end that
   * comes after the call cannot be missed.
   */
  declare readonly waitFor?: (key: string, timeout: number) => Promise<void>

  constructor (options: KnexStorageOptions) {
    if (options === null || typeof options !== 'object') throw new TypeError('KnexStorage: options { knex } are required')
    this.#dialect = sqlDialect(options.knex)
    const tableName = options.tableName ?? DEFAULT_TABLE_NAME
    if (typeof tableName !== 'string' || tableName.length === 0) throw new TypeError('KnexStorage: tableName must be a non-empty string')
    if (options.now !== undefined && typeof options.now !== 'function') throw new TypeError('KnexStorage: now must be a function')
    this.#knex = options.knex
    this.#table = tableName
    this.#createTable = options.createTable === true
    this.#now = options.now ?? Date.now
    if (this.#dialect === 'postgres' && canListen(options.knex)) {
      this.#channel = notificationChannel(tableName)
      this.waitFor = (key, timeout) => this.#waitFor(key, timeout)
    }
  }

  /** The table this storage uses. */
  get tableName (): string {
    return this.#table
  }

  /** The SQL family of the knex instance: `'postgres'`, `'mysql'` or `'sqlite'`. */
  get dialect (): SqlDialect {
    return this.#dialect
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    const id = encodeKey(key)
    const lease = duration(lockTimeout, 'lockTimeout')
    if (typeof fingerprint !== 'string') throw new TypeError('KnexStorage: the fingerprint must be a string')
    if (!this.#prepared) await this.#prepare()
    for (let round = 0; round < BEGIN_ROUNDS; round++) {
      const result = await this.#retrying(() => this.#beginOnce(id, fingerprint, lease))
      if (result !== undefined) return result
    }
    throw new Error(`KnexStorage: begin did not settle after ${BEGIN_ROUNDS} rounds of concurrent changes to one key`)
  }

  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    return this.#complete(this.#knex, key, token, response, expiration)
  }

  /**
   * Transaction mode: a knex transaction for the handler's writes, in which `complete` writes the
   * stored response with the same fenced statement as above, so both commit or neither does.
   */
  async transaction (): Promise<StorageTransaction> {
    if (!this.#prepared) await this.#prepare()
    const trx = await this.#knex.transaction()
    // A failed COMMIT rejects the transaction's own promise as well as commit()'s; the caller
    // handles the latter, so the former must not surface as an unhandled rejection.
    trx.executionPromise.catch(() => {})
    return {
      handle: trx,
      complete: (key, token, response, expiration) => this.#complete(trx, key, token, response, expiration),
      commit: async () => { await trx.commit() },
      rollback: async () => { if (!trx.isCompleted()) await trx.rollback() }
    }
  }

  async #complete (db: Knex | Knex.Transaction, key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    const id = encodeKey(key)
    const ttl = duration(expiration, 'expiration')
    const body = toBuffer(response.body)
    const headers = JSON.stringify(response.headers ?? {})
    if (!this.#prepared) await this.#prepare()
    // Inside a transaction a deadlock aborts the whole transaction: retrying one statement of it
    // would be wrong, so only the stand-alone statement is retried.
    const run = <T>(statement: () => PromiseLike<T>): Promise<T> => db === this.#knex ? this.#retrying(statement) : Promise.resolve(statement())
    if (this.#dialect === 'postgres') {
      const changed = await run(() => {
        const now = this.#now()
        return this.#notifying(db, POSTGRES_COMPLETE, id, [this.#table, response.statusCode, response.contentType ?? null,
          headers, body, now + ttl, id, token, now])
      })
      return changed === 1
    }
    const changed = await run(() => {
      const now = this.#now()
      return db(this.#table)
        .where({ idempotency_key: id, token, state: 'in_flight' })
        .andWhere('lease_end', '>', now)
        .update({
          state: 'completed',
          token: null,
          lease_end: null,
          status_code: response.statusCode,
          content_type: response.contentType ?? null,
          headers,
          body,
          expires_at: now + ttl
        })
    })
    return Number(changed) === 1
  }

  async release (key: string, token: string): Promise<boolean> {
    const id = encodeKey(key)
    if (!this.#prepared) await this.#prepare()
    if (this.#dialect === 'postgres') {
      const changed = await this.#retrying(() => this.#notifying(this.#knex, POSTGRES_RELEASE, id, [this.#table, id, token, this.#now()]))
      return changed === 1
    }
    const deleted = await this.#retrying(() => this.#knex(this.#table)
      .where({ idempotency_key: id, token, state: 'in_flight' })
      .andWhere('lease_end', '>', this.#now())
      .del())
    return Number(deleted) === 1
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const id = encodeKey(key)
    const lease = duration(lockTimeout, 'lockTimeout')
    if (!this.#prepared) await this.#prepare()
    const changed = await this.#retrying(() => {
      const now = this.#now()
      return this.#knex(this.#table)
        .where({ idempotency_key: id, token, state: 'in_flight' })
        .andWhere('lease_end', '>', now)
        .update({ lease_end: now + lease, expires_at: now + lease })
    })
    return Number(changed) === 1
  }

  /**
   * Delete expired responses and lapsed leases, `batchSize` rows per statement, and return how
   * many rows went. Rows that expire while the purge runs are left for the next run. Nothing
   * depends on it for correctness (`begin` never replays an expired row); it only bounds the
   * table's size.
   */
  async purgeExpired (options: PurgeExpiredOptions = {}): Promise<number> {
    const batchSize = options.batchSize ?? 1000
    if (!Number.isSafeInteger(batchSize) || batchSize < 1) throw new TypeError('KnexStorage: batchSize must be a positive integer')
    if (!this.#prepared) await this.#prepare()
    const now = this.#now()
    let total = 0
    for (;;) {
      const { chosen, deleted } = await this.#retrying(() => this.#purgeBatch(now, batchSize))
      total += deleted
      // A short batch means nothing expired is left (or another purge is taking it).
      if (chosen < batchSize) return total
    }
  }

  /**
   * End the listening connection, if `waitFor` opened one; pending waits resolve (their callers
   * ask `begin` again). The knex instance belongs to the caller, who destroys it. The storage
   * stays usable: a later `waitFor` opens a new connection.
   */
  async close (): Promise<void> {
    const listener = this.#listener
    this.#listener = undefined
    for (const waiter of [...this.#pending]) this.#settle(waiter)
    if (listener === undefined) return
    listener.failure ??= new Error('KnexStorage: closed')
    try {
      await (await listener.ready).end()
    } catch {
      // It failed to open, or is gone already: nothing left to end.
    }
  }

  /** A PostgreSQL `complete` or `release`: how many rows it changed. */
  async #notifying (db: Knex | Knex.Transaction, sql: string, id: Buffer, bindings: Knex.RawBinding[]): Promise<number> {
    const { rows } = await db.raw(sql, [...bindings, this.#channel, id.toString('base64')])
    return Number((rows[0] as { changed: unknown }).changed)
  }

  async #waitFor (key: string, timeout: number): Promise<void> {
    const id = encodeKey(key)
    if (typeof timeout !== 'number' || !(timeout > 0)) return
    const wait = Math.min(timeout, MAX_TIMER_MS)
    await new Promise<void>((resolve, reject) => {
      // The timer runs from the call: a slow connect or mark counts against the timeout.
      const waiter: Waiter = {
        name: id.toString('base64'),
        resolve,
        reject,
        timer: setTimeout(() => this.#settle(waiter), wait),
        deadline: performance.now() + wait,
        settled: false
      }
      this.#pending.add(waiter)
      void this.#subscribe(id, waiter)
    })
  }

  /** Listen, then mark the row; settles the waiter at once when the lease is not held any more. */
  async #subscribe (id: Buffer, waiter: Waiter): Promise<void> {
    try {
      if (!this.#prepared) await this.#prepare()
      const listener = this.#listening()
      await listener.ready
      if (waiter.settled) return
      if (listener.failure !== undefined) throw listener.failure
      // Subscribed before the mark: the notification may overtake the mark's answer.
      let waiters = this.#waiters.get(waiter.name)
      if (waiters === undefined) this.#waiters.set(waiter.name, (waiters = new Set()))
      waiters.add(waiter)
      const leaseEnd = await this.#retrying(async () => {
        const { rows } = await this.#knex.raw(POSTGRES_MARK_WAITING, [this.#table, id, this.#now()])
        return rows.length === 0 ? undefined : millis((rows[0] as { lease_end: unknown }).lease_end)
      })
      if (leaseEnd === undefined) {
        this.#settle(waiter)
        return
      }
      // A lease that lapses ends without a notification: wake up then, if that is before the timeout.
      const left = leaseEnd - this.#now()
      if (!waiter.settled && left < waiter.deadline - performance.now()) {
        clearTimeout(waiter.timer)
        waiter.timer = setTimeout(() => this.#settle(waiter), Math.max(0, left))
      }
    } catch (error) {
      this.#settle(waiter, trimmed(error))
    }
  }

  /** The listening connection, opened on first use and again after a failure or close. */
  #listening (): Listener {
    if (this.#listener !== undefined) return this.#listener
    const listener: Listener = { ready: undefined as unknown as Promise<PgConnection>, connection: undefined, failure: undefined }
    listener.ready = this.#openListener(listener)
    listener.ready.catch((error: unknown) => this.#drop(listener, error))
    this.#listener = listener
    return listener
  }

  async #openListener (listener: Listener): Promise<PgConnection> {
    const client = this.#knex.client as Required<KnexPgClient>
    // A connection given as a function is resolved by the pool when it first connects.
    if (client.connectionSettings === undefined) await this.#knex.raw('SELECT 1')
    // knex's own pg driver and settings (host, TLS, searchPath...), outside the pool, so that it
    // never holds a pool slot. knex listens to its 'error' event too; neither lets one crash.
    const connection = await client.acquireRawConnection()
    listener.connection = connection
    connection.on('error', (error: unknown) => this.#drop(listener, error))
    connection.on('end', () => this.#drop(listener, new Error('the connection ended')))
    connection.on('notification', (message: { channel: string, payload?: string }) => this.#notified(message))
    // It must not keep the process alive on its own: a pending wait holds its timer.
    connection.unref?.()
    if (listener.failure !== undefined) {
      // Closed while connecting: end it before close() returns.
      await connection.end().catch(() => {})
      throw listener.failure
    }
    await connection.query(`LISTEN "${this.#channel}"`)
    return connection
  }

  /** The listening connection failed or ended: its waits reject (the plugin polls), the next call opens anew. */
  #drop (listener: Listener, error: unknown): void {
    if (listener.failure === undefined) {
      const reason = error instanceof Error ? error.message : String(error)
      listener.failure = new Error(`KnexStorage: the listening connection failed: ${reason}`, { cause: error })
      if (this.#listener === listener) this.#listener = undefined
      // Every subscribed waiter is on this connection: the next one opens only once this one is
      // dropped (or closed, which settles every waiter), and its waiters subscribe after that.
      for (const waiters of [...this.#waiters.values()]) for (const waiter of [...waiters]) this.#settle(waiter, listener.failure)
    }
    listener.connection?.end().catch(() => {})
  }

  #notified (message: { channel: string, payload?: string }): void {
    if (message.channel !== this.#channel || message.payload === undefined) return
    const waiters = this.#waiters.get(message.payload)
    if (waiters !== undefined) for (const waiter of [...waiters]) this.#settle(waiter)
  }

  #settle (waiter: Waiter, error?: unknown): void {
    if (waiter.settled) return
    waiter.settled = true
    clearTimeout(waiter.timer)
    this.#pending.delete(waiter)
    const waiters = this.#waiters.get(waiter.name)
    if (waiters !== undefined) {
      waiters.delete(waiter)
      if (waiters.size === 0) this.#waiters.delete(waiter.name)
    }
    if (error === undefined) waiter.resolve()
    else waiter.reject(error)
  }

  #prepare (): Promise<void> {
    this.#ready ??= this.#init().then(() => { this.#prepared = true }, (error: unknown) => {
      // A failed start (server down, no privileges) must not poison every later call.
      this.#ready = undefined
      throw error
    })
    return this.#ready
  }

  async #init (): Promise<void> {
    if (this.#createTable) await createIdempotencyTable(this.#knex, this.#table)
    if (this.#dialect === 'mysql') {
      const [rows] = await this.#knex.raw('SELECT VERSION() AS version')
      this.#returning = hasInsertReturning(String(rows?.[0]?.version ?? ''))
    }
  }

  /** Run one statement again when the server picked it as a deadlock victim. */
  async #retrying<T> (statement: () => PromiseLike<T>): Promise<T> {
    for (let attempt = 0; ; attempt++) {
      try {
        return await statement()
      } catch (error) {
        if (attempt >= DEADLOCK_RETRIES || !isDeadlock(this.#dialect, error)) throw trimmed(error)
        // A little jitter, so the two sides of the deadlock do not collide again in step.
        await sleep(Math.random() * 5 * (attempt + 1))
      }
    }
  }

  /** One attempt: the result, or `undefined` when the row we lost to changed before we read it. */
  async #beginOnce (id: Buffer, fingerprint: string, lease: number): Promise<BeginResult | undefined> {
    const now = this.#now()
    const leaseEnd = now + lease
    const token = randomUUID()
    const table = this.#table
    if (this.#dialect === 'postgres') {
      const { rows } = await this.#knex.raw(POSTGRES_BEGIN,
        [table, id, now, table, id, fingerprint, token, leaseEnd, leaseEnd, now])
      const row = rows[0] as (Row & { taken: number }) | undefined
      if (row !== undefined && Number(row.taken) === 1) return { state: 'acquired', token }
      if (row === undefined || row.state === null) return undefined
      return toResult(row)
    }
    if (this.#dialect === 'mysql') {
      // In the order of the placeholders: the insert, then each assignment's condition and value.
      const bindings = [table, id, fingerprint, token, leaseEnd, leaseEnd,
        now, fingerprint, now, now, token, now, leaseEnd, now, now, now, now, now, leaseEnd]
      if (this.#returning) {
        const [rows] = await this.#knex.raw(MARIADB_BEGIN, bindings)
        const row = (rows as Row[])[0]
        if (row === undefined) return undefined
        if (row.token === token) return { state: 'acquired', token }
        // The upsert left the row alone, so it was live at `now`: in flight or completed.
        return toResult(row)
      }
      const [header] = await this.#knex.raw(MYSQL_BEGIN, bindings)
      const outcome = Number((header as { insertId?: unknown }).insertId)
      if (outcome === 0 || outcome === 1) return { state: 'acquired', token }
      if (outcome !== 2) throw new Error(`KnexStorage: unexpected upsert outcome ${outcome}`)
      return this.#readLive(id)
    }
    const rows = await this.#knex.raw(SQLITE_BEGIN, [table, id, fingerprint, token, leaseEnd, leaseEnd, now])
    if ((rows as unknown[]).length === 1) return { state: 'acquired', token }
    return this.#readLive(id)
  }

  /** The row as a live result, or `undefined` when it vanished or died since the upsert saw it. */
  async #readLive (id: Buffer): Promise<BeginResult | undefined> {
    const row = await this.#knex(this.#table)
      .first(READ_COLUMNS)
      .where('idempotency_key', id)
      .andWhere('expires_at', '>', this.#now()) as Row | undefined
    return row === undefined ? undefined : toResult(row)
  }

  /** One batch: how many expired rows it chose, and how many of them it deleted. */
  async #purgeBatch (now: number, batchSize: number): Promise<{ chosen: number, deleted: number }> {
    const table = this.#table
    if (this.#dialect === 'mysql') {
      // Choose the batch with a plain read, then delete by primary key. A DELETE that walks the
      // expiry index locks index entries before rows, the reverse of the order `begin`'s upsert
      // takes them in, and InnoDB then keeps picking one of the two as a deadlock victim.
      // (MySQL also refuses LIMIT inside an IN subquery.)
      const rows = await this.#knex(table).select('idempotency_key').where('expires_at', '<=', now)
        .orderBy('expires_at').limit(batchSize) as Array<{ idempotency_key: Buffer }>
      if (rows.length === 0) return { chosen: 0, deleted: 0 }
      const deleted = await this.#knex(table).whereIn('idempotency_key', rows.map((row) => row.idempotency_key))
        .andWhere('expires_at', '<=', now).del()
      return { chosen: rows.length, deleted: Number(deleted) }
    }
    const batch = this.#knex(table).select('idempotency_key').where('expires_at', '<=', now).limit(batchSize)
    // Concurrent purges on PostgreSQL take disjoint batches instead of waiting on each other.
    if (this.#dialect === 'postgres') batch.forUpdate().skipLocked()
    // The outer condition is checked again on the row as it is when deleted, so a row that a
    // `begin` took over after the batch was chosen survives.
    const deleted = Number(await this.#knex(table).whereIn('idempotency_key', batch).andWhere('expires_at', '<=', now).del())
    return { chosen: deleted, deleted }
  }
}
