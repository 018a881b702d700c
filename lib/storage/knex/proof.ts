/**
 * KnexStorage's start-up proof: the database reached on a connection of its own, the table there
 * (made with `createTable`), a read, and a write, an update and a delete of a probe row, each in a
 * savepoint of one transaction that is rolled back: nothing is left, and a database that refuses
 * writes (a reader endpoint, a hot standby, `default_transaction_read_only`, a role granted SELECT
 * only, or without DELETE) fails the start instead of answering 503 to every guarded request.
 * The probe's key is not UTF-8 (0xFF), so no idempotency key is ever stored under it.
 *
 * Each failure says what was refused, the server's own words (never the statement knex puts in
 * front of them) and the cure.
 */
import { randomBytes } from 'node:crypto'
import type { Knex } from 'knex'
import { ProofAbortedError, beforeAbort, driverReason, failed, passed } from '../proof.js'
import type { StoreCheck, StoreProofOptions } from '../types.js'
import type { Dialect } from './dialect.js'
import { quotedName } from './schema.js'

export interface KnexProofContext {
  dialect: Dialect
  /** The storage's start: its table (with `createTable`), and what the server can do; whether it made the table now. */
  start: () => Promise<boolean>
}

/** A driver's error, as the proof reads it: the server's own words and code. */
export interface DriverFailure {
  /** The driver's message, without the statement knex puts in front of it. */
  reason: string
  /** PostgreSQL's SQLSTATE, mysql2's or SQLite's code; `undefined` when none. */
  code: string | undefined
  errno: number | undefined
  /** The proof's time was up first: no answer at all. */
  stalled: boolean
}

/** A driver's error: the server's words (`driverReason`), and its code. */
export function driverFailure (error: unknown): DriverFailure {
  const { code, errno } = (error ?? {}) as { code?: unknown, errno?: unknown }
  return { reason: driverReason(error), code: typeof code === 'string' ? code : undefined, errno: typeof errno === 'number' ? errno : undefined, stalled: error instanceof ProofAbortedError || (error as { name?: unknown } | null)?.name === 'KnexTimeoutError' }
}

/** The server refused a statement on a privilege. */
function deniedPrivilege ({ code, errno, reason }: DriverFailure): boolean {
  return code === '42501' || errno === 1142 || errno === 1143 || errno === 1044 || /permission denied|command denied/i.test(reason)
}

/** The server refuses every write: a read-only transaction, server or file. */
function readOnly ({ code, errno, reason }: DriverFailure): boolean {
  return code === '25006' || errno === 1792 || errno === 1290 || errno === 1836 || code?.startsWith('SQLITE_READONLY') === true || /read[- ]?only/i.test(reason)
}

/** SQLite cannot make its journal beside the file: a directory the process may not write. */
function sqliteDirectory ({ code }: DriverFailure): boolean {
  return code === 'SQLITE_CANTOPEN' || code === 'SQLITE_READONLY_DIRECTORY'
}

const SQLITE_DIRECTORY_CURE = 'the SQLite file or its directory is read-only to this process: let the process write the directory that holds the file (SQLite makes its journal there), and the file'

/**
 * The statement got no answer: the proof's time was up, the store's statementTimeout (knex's query
 * timeout) passed, or the server gave up waiting for a lock (PostgreSQL's lock_timeout or a
 * statement timeout, MySQL's lock wait timeout or max_statement_time): the table is held by
 * someone else, or the server is too busy.
 */
function stalled ({ stalled, code, errno }: DriverFailure): boolean {
  return stalled || code === '55P03' || code === '57014' || errno === 1205 || errno === 1969 || errno === 3024
}

const STALLED_CURE = 'the table is locked (a migration, a VACUUM FULL, a long transaction), or the database is too busy: start the app once what holds it is done (pg_locks, SHOW PROCESSLIST), or give the check more time (storeTimeout)'

function missingTable ({ code, errno, reason }: DriverFailure): boolean {
  return code === '42P01' || errno === 1146 || code === 'ER_NO_SUCH_TABLE' || /no such table/i.test(reason)
}

const shownCode = ({ code }: DriverFailure): string => code === undefined ? '' : ` (${code})`

const READ_ONLY_CURE = 'the database is read-only to this connection: give the app the primary\'s address (not a reader endpoint or a standby), and no read-only default for its role or database (default_transaction_read_only, transaction_read_only)'

/** How to cure a database that refuses writes, on each dialect. */
const READ_ONLY_CURES: Record<Dialect['name'], string> = {
  postgres: READ_ONLY_CURE,
  mysql: 'the database is read-only to this connection: give the app the primary\'s address (not a reader endpoint or a replica), and no read-only default for its user or session (transaction_read_only, read_only)',
  sqlite: 'the SQLite file is read-only to this process: open it without readonly: true, and let the process write the file and its directory (SQLite writes its journal beside the file)'
}

export async function proveKnex ({ dialect, start }: KnexProofContext, { signal }: StoreProofOptions): Promise<StoreCheck[]> {
  const checks: StoreCheck[] = []
  const { knex, table } = dialect
  const step = async <T>(name: string, run: () => Promise<T>): Promise<T> => await beforeAbort(run(), signal, name)
  try {
    await step('connection', () => connectOnce(knex))
    checks.push(passed('connection', 'the database answers'))
  } catch (error) {
    const failure = driverFailure(error)
    return [failed('connection', `the database cannot be used: ${failure.reason}${shownCode(failure)}`,
      'check that the database runs, and the connection settings knex was given (host, port, user, password, database)')]
  }
  if (dialect.name === 'mysql') {
    let autocommit: number | null = null
    try {
      autocommit = await step('autocommit', () => autocommitOf(knex))
    } catch {
      // Unread: the checks below find what is wrong with the connection.
    }
    if (autocommit === 0) {
      checks.push(failed('autocommit', 'autocommit is off on the store\'s connections (@@autocommit = 0): no lease or response it writes would be committed, and a duplicate on another connection would wait on its row until storeTimeout',
        'turn it on for the app\'s connections (the server\'s autocommit or init_connect, or the pool\'s afterCreate)'))
    }
  }
  let created: boolean
  try {
    created = await step('table', start)
  } catch (error) {
    checks.push(tableFailure(driverFailure(error), table))
    return checks
  }
  try {
    await step('SELECT', () => dialect.readEntry(Buffer.alloc(0)))
    checks.push(passed('table', created ? `"${table}" was missing: created now (createTable: true), as the app does at its start` : `"${table}" is there`), passed('SELECT', 'an entry can be read'))
  } catch (error) {
    const failure = driverFailure(error)
    // Without createTable, nothing was created: the read is the first to find the table missing.
    if (missingTable(failure)) {
      let elsewhere: StoreCheck | null = null
      try {
        if (dialect.name === 'postgres' && !table.includes('.')) elsewhere = await step('search_path', () => offSearchPath(knex, table))
      } catch {
        // Unread: said as missing.
      }
      checks.push(elsewhere ?? tableFailure(failure, table))
      return checks
    }
    checks.push(passed('table', created ? `"${table}" was missing: created now (createTable: true), as the app does at its start` : `"${table}" is there`), statementFailure('SELECT', failure, table, dialect.name))
    // A table that does not answer a read answers no write either: said once.
    if (stalled(failure)) return checks
  }
  checks.push(...await step('INSERT, UPDATE, DELETE', () => writes(dialect)).catch((error: unknown) => [statementFailure('INSERT', driverFailure(error), table, dialect.name)]))
  const refused = checks.find((check) => check.cure === READ_ONLY_CURE)
  if (refused !== undefined && dialect.name === 'postgres') refused.found += await step('read-only', () => whyReadOnly(knex)).catch(() => '')
  return checks
}

/** A connection of its own: knex's pool would retry a refused one until its acquireConnectionTimeout, and say only that it timed out. */
async function connectOnce (knex: Knex): Promise<void> {
  const client = knex.client as { connectionSettings?: unknown, acquireRawConnection: () => Promise<unknown>, destroyRawConnection: (connection: unknown) => Promise<void> }
  // A connection given as a function is only known to the pool: its first statement connects.
  if (client.connectionSettings === undefined) return
  await client.destroyRawConnection(await client.acquireRawConnection())
}

function tableFailure (failure: DriverFailure, table: string): StoreCheck {
  if (missingTable(failure)) {
    return failed('table', `the table "${table}" does not exist`, 'create it with createTable: true, or beforehand with createIdempotencyTable (in a migration)')
  }
  const found = `the table "${table}" cannot be created: ${failure.reason}${shownCode(failure)}`
  if (deniedPrivilege(failure)) {
    return failed('table', found, 'grant the app\'s role CREATE on the schema, or create the table beforehand with createIdempotencyTable in a migration run by a role that may, and set createTable: false')
  }
  if (failure.code === '3F000' || failure.errno === 1049) {
    return failed('table', found, 'create the schema (or database) first, or give tableName one that exists')
  }
  return failed('table', `the database cannot be used: ${failure.reason}${shownCode(failure)}`, 'check the role\'s rights on the database and the table, and tableName')
}

function statementFailure (statement: string, failure: DriverFailure, table: string, dialect: Dialect['name']): StoreCheck {
  if (stalled(failure)) return failed(statement, `${statement} on the table "${table}" got no answer: ${failure.reason}${shownCode(failure)}`, STALLED_CURE)
  const found = `${statement} on the table "${table}" was refused: ${failure.reason}${shownCode(failure)}`
  if (dialect === 'sqlite' && sqliteDirectory(failure)) {
    return failed(statement, found, SQLITE_DIRECTORY_CURE)
  }
  if (readOnly(failure)) {
    return failed(statement, found, READ_ONLY_CURES[dialect])
  }
  const schema = /permission denied for schema (\S+)/.exec(failure.reason)?.[1]
  if (schema !== undefined) {
    return failed(statement, found, `grant the app's role USAGE on the schema "${schema}" (GRANT USAGE ON SCHEMA ${schema} TO ...): it may not reach the tables in it`)
  }
  if (deniedPrivilege(failure)) {
    return failed(statement, found, `grant the app's role SELECT, INSERT, UPDATE and DELETE on "${table}": every request writes its key there, and gives it back with a DELETE`)
  }
  return failed(statement, found, 'the table may not be the one this version writes: see docs/upgrading.md (createTable: true adds what is missing)')
}

/**
 * The writes a request makes, on the probe row, each in a savepoint of one transaction rolled back
 * at the end: the lease taken (INSERT), the response stored (UPDATE, every column `complete` and a
 * waiter's mark write), the lease given back (DELETE).
 */
async function writes (dialect: Dialect): Promise<StoreCheck[]> {
  const { knex, table } = dialect
  const id = Buffer.concat([Buffer.from([0xff]), randomBytes(15)])
  const checks: StoreCheck[] = []
  // UPDATE and DELETE must each find the probe row: under row-level security without a policy for
  // them, PostgreSQL changes no row and says nothing, and every response would go unstored.
  const statements: Array<[string, (trx: Knex.Transaction) => Promise<unknown>, string]> = [
    ['INSERT', (trx) => trx(table).insert({ idempotency_key: id, fingerprint: 'start-up proof', state: 'in_flight', token: 'start-up proof', lease_end: 1, expires_at: 1 }), 'a lease can be taken'],
    ['UPDATE', (trx) => trx(table).where('idempotency_key', id).update({
      state: 'completed',
      token: null,
      lease_end: 2,
      status_code: 200,
      content_type: null,
      headers: '{}',
      body: Buffer.alloc(0),
      expires_at: 2,
      ...(dialect.name === 'postgres' ? { waiting: true } : {})
    }), 'a response can be stored'],
    ['DELETE', (trx) => trx(table).where('idempotency_key', id).del(), 'a lease can be given back']
  ]
  const trx = await knex.transaction()
  // Rolled back on purpose: that is no failure of anyone's.
  trx.executionPromise.catch(() => {})
  try {
    for (const [name, statement, says] of statements) {
      try {
        const changed = await trx.transaction(async (savepoint) => await statement(savepoint))
        if (name !== 'INSERT' && Number(changed) !== 1) {
          checks.push(await unchanged(name, dialect, trx))
          continue
        }
        checks.push(passed(name, `${says} (rolled back)`))
      } catch (error) {
        checks.push(statementFailure(name, driverFailure(error), table, dialect.name))
      }
    }
  } finally {
    await trx.rollback().catch(() => {})
  }
  return checks
}

/**
 * An UPDATE or DELETE of the probe row, just inserted, that changed no row: on PostgreSQL, a table
 * with row-level security and no policy that lets the role change its rows (said when it is on).
 */
async function unchanged (name: string, dialect: Dialect, trx: Knex.Transaction): Promise<StoreCheck> {
  const { table } = dialect
  const verb = name === 'UPDATE' ? 'update' : 'delete'
  let secured = false
  if (dialect.name === 'postgres') {
    const { rows } = await trx.raw('SELECT relrowsecurity AS secured FROM pg_class WHERE oid = to_regclass(?)', [quotedName(table)])
    secured = (rows as Array<{ secured: boolean }>)[0]?.secured === true
  }
  const why = secured ? `row-level security is on for the table: no policy lets this role ${verb} its rows?` : 'a trigger or a policy that hides rows from this role?'
  const outcome = name === 'UPDATE' ? 'no response is stored, and each key stays locked' : 'a failed request\'s key stays locked until lockTimeout'
  return failed(name, `${name} on the table "${table}" changed no row: the probe row inserted just before was not found (${why})`,
    secured
      ? `give the app's role row-level security policies on "${table}" for SELECT, INSERT, UPDATE and DELETE of every row (USING (true)), or exempt it (BYPASSRLS): without it ${outcome}`
      : `let the app's role ${verb} every row of "${table}": without it ${outcome}`)
}

/**
 * PostgreSQL: an unqualified table that is not found may be in a schema the connection's
 * search_path leaves out (a role hardened with search_path = ''): said, with where it is.
 */
async function offSearchPath (knex: Knex, table: string): Promise<StoreCheck | null> {
  const { rows } = await knex.raw("SELECT current_setting('search_path') AS path, array(SELECT table_schema::text FROM information_schema.tables WHERE table_name = ? ORDER BY 1) AS schemas", [table])
  const { path, schemas } = rows[0] as { path: string, schemas: string[] }
  if (schemas.length === 0) return null
  return failed('table', `the table "${table}" is not in a schema on the connection's search_path (${path}) but in ${schemas.map((schema) => `"${schema}"`).join(', ')}`,
    `give tableName its schema ("${schemas[0]}.${table}"), or give the app's role a search_path that holds it (ALTER ROLE ... SET search_path)`)
}

/**
 * MySQL/MariaDB: autocommit on a pooled connection (the pool's own hooks applied). The store's
 * statements outside a request's transaction rely on it: with it off, each would stay uncommitted,
 * holding its row, until the connection ends.
 */
async function autocommitOf (knex: Knex): Promise<number> {
  const [rows] = await knex.raw('SELECT @@autocommit AS autocommit')
  return Number((rows as Array<{ autocommit: unknown }>)[0]!.autocommit)
}

/** PostgreSQL: why it refuses writes, as it says. */
async function whyReadOnly (knex: Knex): Promise<string> {
  const { rows } = await knex.raw("SELECT pg_is_in_recovery() AS standby, current_setting('default_transaction_read_only') AS readonly")
  const { standby, readonly } = rows[0] as { standby: boolean, readonly: string }
  if (standby) return ' (the server is a standby: pg_is_in_recovery() is true)'
  return readonly === 'on' ? ' (default_transaction_read_only is on for this role or database)' : ''
}
