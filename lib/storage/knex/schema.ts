/**
 * The one definition of the SQL table behind `KnexStorage`, per dialect.
 *
 * `KnexStorage({ createTable: true })` calls `createIdempotencyTable` on first use; teams that
 * manage their schema themselves call the same function from a knex migration:
 *
 *   import { createIdempotencyTable, dropIdempotencyTable } from 'fastify-idempotency/knex'
 *   export const up = (knex) => createIdempotencyTable(knex, 'idempotency_keys')
 *   export const down = (knex) => dropIdempotencyTable(knex, 'idempotency_keys')
 */
import { createHash } from 'node:crypto'
import type { Knex } from 'knex'

/** The table KnexStorage uses unless `tableName` says otherwise. */
export const DEFAULT_TABLE_NAME = 'idempotency_keys'

/**
 * Longest key the table holds, in UTF-8 bytes. Keys are stored as bytes so that they compare
 * exactly (case, trailing spaces, Unicode normalization) on every dialect; 1024 bytes fit a
 * 255-character key with a generous scope prefix, and stay well under InnoDB's 3072-byte index
 * limit.
 */
export const MAX_KEY_BYTES = 1024

/** The SQL families `KnexStorage` supports. */
export type SqlDialect = 'postgres' | 'mysql' | 'sqlite'

const DIALECTS: Readonly<Record<string, SqlDialect>> = {
  pg: 'postgres',
  postgres: 'postgres',
  postgresql: 'postgres',
  mysql: 'mysql',
  mysql2: 'mysql',
  'better-sqlite3': 'sqlite',
  sqlite3: 'sqlite',
  sqlite: 'sqlite'
}

/**
 * The dialect of a knex instance, from the `client` it was configured with. Anything else is
 * refused here, at construction, rather than failing on a dialect's SQL at the first request.
 */
export function sqlDialect (knex: Knex): SqlDialect {
  const client = (knex as { client?: { config?: { client?: unknown }, driverName?: unknown } } | undefined)?.client
  if (client === undefined || client === null) {
    throw new TypeError('fastify-idempotency: expected a knex instance (the value returned by knex({ client, connection }))')
  }
  const configured = client.config?.client
  // A Client class instead of a name: its driver name tells the family.
  const name = typeof configured === 'string' ? configured : client.driverName
  const dialect = typeof name === 'string' ? DIALECTS[name] : undefined
  if (dialect === undefined) {
    const hint = name === 'mariadb' ? ' (for MariaDB use the mysql2 client)' : ''
    throw new TypeError(`fastify-idempotency: knex client ${JSON.stringify(name ?? configured)} is not supported${hint}; ` +
      'use pg, mysql2 (or mysql), or better-sqlite3 (or sqlite3)')
  }
  return dialect
}

/** `schema.table` → its parts; index names live in the table's schema. */
function splitName (tableName: string): { schema: string | undefined, base: string } {
  const dot = tableName.lastIndexOf('.')
  return dot === -1
    ? { schema: undefined, base: tableName }
    : { schema: tableName.slice(0, dot), base: tableName.slice(dot + 1) }
}

function checkTableName (tableName: unknown): asserts tableName is string {
  if (typeof tableName !== 'string' || tableName.length === 0) {
    throw new TypeError('fastify-idempotency: tableName must be a non-empty string')
  }
}

/** The expiry index's name, also used by the tests to look it up. */
export function expiryIndexName (tableName: string): string {
  return `${splitName(tableName).base}_expires_idx`
}

/** The in-flight index's name (see `createInFlightIndex`). */
export function inFlightIndexName (tableName: string): string {
  return `${splitName(tableName).base}_in_flight_idx`
}

/**
 * The PostgreSQL NOTIFY channel of a table (see `KnexStorage.waitFor`), also used by the tests.
 * Channel names are identifiers of at most 63 bytes, and a table name may be longer or hold any
 * character, so the channel is a hash of the name: lower-case hex, safe quoted or not. Every
 * process must name the table the same way (`'app.keys'` and `'keys'` on a search_path give two
 * channels).
 */
export function notificationChannel (tableName: string): string {
  return `fastify_idempotency_${createHash('sha256').update(tableName).digest('hex').slice(0, 32)}`
}

/** `schema.table` quoted the way knex quotes `??`, for a `::regclass` cast. */
export function quotedName (tableName: string): string {
  return tableName.split('.').map((part) => `"${part.replace(/"/g, '""')}"`).join('.')
}

// Times are BIGINT epoch milliseconds from the database's clock (see Clock in dialect.ts), the
// same rule on every dialect. `expires_at` is when the row stops mattering: the lease end while in flight,
// the response's expiry once completed, so one indexed column serves both `begin` and the purge.
// PostgreSQL only: `waiting` is set by a request that waits for the lease (`waitFor`), so that
// `complete` and `release` send a NOTIFY only when somebody listens for it.
const POSTGRES_TABLE = `CREATE TABLE IF NOT EXISTS ?? (
  idempotency_key bytea NOT NULL PRIMARY KEY CHECK (octet_length(idempotency_key) <= ${MAX_KEY_BYTES}),
  fingerprint text NOT NULL,
  state varchar(16) NOT NULL CHECK (state IN ('in_flight', 'completed')),
  token varchar(64),
  lease_end bigint,
  status_code integer,
  content_type text,
  headers text,
  body bytea,
  expires_at bigint NOT NULL,
  waiting boolean NOT NULL DEFAULT false
)`

// VARBINARY compares bytewise with no pad-space rule and no collation, so 'A' and 'a', or 'k' and
// 'k ', are different keys (utf8mb4_bin would still treat trailing spaces as equal on MariaDB).
const MYSQL_TABLE = `CREATE TABLE IF NOT EXISTS ?? (
  idempotency_key VARBINARY(${MAX_KEY_BYTES}) NOT NULL,
  fingerprint TEXT NOT NULL,
  state VARCHAR(16) NOT NULL CHECK (state IN ('in_flight', 'completed')),
  token VARCHAR(64) NULL,
  lease_end BIGINT NULL,
  status_code INT NULL,
  content_type TEXT NULL,
  headers MEDIUMTEXT NULL,
  body LONGBLOB NULL,
  expires_at BIGINT NOT NULL,
  PRIMARY KEY (idempotency_key),
  KEY ?? (expires_at),
  KEY ?? (state, lease_end)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`

const SQLITE_TABLE = `CREATE TABLE IF NOT EXISTS ?? (
  idempotency_key BLOB NOT NULL PRIMARY KEY CHECK (length(idempotency_key) <= ${MAX_KEY_BYTES}),
  fingerprint TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('in_flight', 'completed')),
  token TEXT,
  lease_end INTEGER,
  status_code INTEGER,
  content_type TEXT,
  headers TEXT,
  body BLOB,
  expires_at INTEGER NOT NULL
)`

/** A stable advisory-lock key per table, so creators of different tables do not queue. */
function advisoryKey (tableName: string): number {
  return createHash('sha256').update(`fastify-idempotency:${tableName}`).digest().readInt32BE(0)
}
const ADVISORY_NAMESPACE = 0x1de4

/**
 * Create the idempotency table and its expiry index if they do not exist yet. Safe to call
 * concurrently from several processes, and from a knex migration's `up` (pass the migration's
 * `knex`, which may be a transaction).
 */
export async function createIdempotencyTable (knex: Knex, tableName: string = DEFAULT_TABLE_NAME): Promise<void> {
  await ensureIdempotencyTable(knex, tableName)
}

/** `createIdempotencyTable`, saying whether the table was missing (and is made now). */
export async function ensureIdempotencyTable (knex: Knex, tableName: string = DEFAULT_TABLE_NAME): Promise<boolean> {
  checkTableName(tableName)
  const dialect = sqlDialect(knex)
  const { schema, base } = splitName(tableName)
  const index = expiryIndexName(tableName)
  if (dialect === 'postgres') {
    // Concurrent CREATE TABLE IF NOT EXISTS can still collide in PostgreSQL's catalogs (a unique
    // violation on pg_type); a transaction-scoped advisory lock makes creators take turns.
    return await knex.transaction(async (trx) => {
      await trx.raw('SELECT pg_advisory_xact_lock(?::integer, ?::integer)', [ADVISORY_NAMESPACE, advisoryKey(tableName)])
      // Found through the catalogs (readable by every role) when the name has its schema, so a role
      // without USAGE on that schema is told so by its first statement, not here.
      const { rows: existing } = schema === undefined
        ? await trx.raw('SELECT to_regclass(?)::oid AS found', [quotedName(tableName)])
        : await trx.raw('SELECT pg_class.oid AS found FROM pg_class JOIN pg_namespace ON pg_namespace.oid = pg_class.relnamespace WHERE pg_namespace.nspname = ? AND pg_class.relname = ? AND pg_class.relkind IN (\'r\', \'p\')', [schema, base])
      const found = (existing as Array<{ found: number | null }>)[0]?.found ?? null
      if (found === null) {
        await trx.raw(POSTGRES_TABLE, [tableName])
        await trx.raw('CREATE INDEX IF NOT EXISTS ?? ON ?? (expires_at)', [index, tableName])
        // Only with a new table: building it on a full one blocks writes (see `createInFlightIndex`).
        await trx.raw(IN_FLIGHT_INDEX, [inFlightIndexName(tableName), tableName])
        return true
      }
      // A table that is there is left alone (PostgreSQL checks CREATE on the schema before IF NOT
      // EXISTS finds the table, and an app's role granted only its rows may run this at start);
      // only an expiry index it lacks is added.
      const { rows: indexed } = await trx.raw('SELECT 1 FROM pg_index JOIN pg_class ON pg_class.oid = pg_index.indexrelid WHERE pg_index.indrelid = ? AND pg_class.relname = ?', [found, index])
      if (indexed.length === 0) await trx.raw('CREATE INDEX IF NOT EXISTS ?? ON ?? (expires_at)', [index, tableName])
      // A table created before `waiting` existed gets it. Only when it is missing: ALTER TABLE
      // takes an ACCESS EXCLUSIVE lock even when IF NOT EXISTS then finds the column, and every
      // process start would queue all requests behind it. (A constant default costs no rewrite.)
      const { rows } = await trx.raw("SELECT 1 FROM pg_attribute WHERE attrelid = ? AND attname = 'waiting' AND NOT attisdropped", [found])
      if (rows.length === 0) await trx.raw('ALTER TABLE ?? ADD COLUMN IF NOT EXISTS waiting boolean NOT NULL DEFAULT false', [tableName])
      return false
    })
  } else if (dialect === 'mysql') {
    // A table that is there is left alone: MySQL checks CREATE before IF NOT EXISTS finds the
    // table, and an app's user granted only its rows may run this at start.
    const [rows] = await knex.raw('SELECT 1 FROM information_schema.tables WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?', [schema ?? null, base])
    if ((rows as unknown[]).length > 0) return false
    // One statement with the index inline: MySQL DDL is not transactional, and a separate
    // CREATE INDEX would fail for the second of two racing creators.
    await knex.raw(MYSQL_TABLE, [tableName, index, inFlightIndexName(tableName)])
    return true
  } else {
    // The statements are idempotent, so racing creators need no lock; SQLite serializes them.
    const existed = await sqliteTableExists(knex, tableName)
    await knex.raw(SQLITE_TABLE, [tableName])
    await knex.raw('CREATE INDEX IF NOT EXISTS ?? ON ?? (expires_at)', [schema === undefined ? index : `${schema}.${index}`, base])
    if (!existed) await createInFlightIndex(knex, tableName)
    return !existed
  }
}

/**
 * Leases held are listed (`listInFlight`, the `in-flight` command) through this index: on
 * PostgreSQL and SQLite a partial index of the rows in flight alone, on MySQL/MariaDB (which have
 * none) one on `(state, lease_end)`. Without it the listing reads the whole table.
 */
const IN_FLIGHT_INDEX = "CREATE INDEX IF NOT EXISTS ?? ON ?? (lease_end) WHERE state = 'in_flight'"

async function sqliteTableExists (knex: Knex, tableName: string): Promise<boolean> {
  const { schema, base } = splitName(tableName)
  const rows = await knex.raw(`SELECT 1 FROM ${schema === undefined ? '' : `"${schema.replace(/"/g, '""')}".`}sqlite_master WHERE type = 'table' AND name = ?`, [base])
  return (rows as unknown[]).length > 0
}

/**
 * Add the in-flight index to a table created before it existed (`createIdempotencyTable` makes it
 * with every new table). Idempotent. On PostgreSQL outside a transaction it is built
 * `CONCURRENTLY`, without blocking writes (in a knex migration, set `config = { transaction: false }`);
 * inside one, and on SQLite, the build blocks writes to the table while it reads it. MySQL/MariaDB
 * build it online.
 */
export async function createInFlightIndex (knex: Knex, tableName: string = DEFAULT_TABLE_NAME): Promise<void> {
  checkTableName(tableName)
  const dialect = sqlDialect(knex)
  const { schema, base } = splitName(tableName)
  const index = inFlightIndexName(tableName)
  if (dialect === 'postgres') {
    const concurrently = knex.isTransaction === true ? '' : ' CONCURRENTLY'
    await knex.raw(IN_FLIGHT_INDEX.replace('CREATE INDEX', `CREATE INDEX${concurrently}`), [index, tableName])
  } else if (dialect === 'mysql') {
    const [rows] = await knex.raw('SELECT 1 FROM information_schema.statistics WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ? AND index_name = ?',
      [schema ?? null, base, index])
    if ((rows as unknown[]).length > 0) return
    // Two creators at once: the second finds the name taken (ER_DUP_KEYNAME), which is as good.
    await knex.raw('CREATE INDEX ?? ON ?? (state, lease_end)', [index, tableName]).catch((error: { errno?: number }) => {
      if (error.errno !== 1061) throw error
    })
  } else {
    await knex.raw(IN_FLIGHT_INDEX, [schema === undefined ? index : `${schema}.${index}`, base])
  }
}

/** Drop the idempotency table (and with it its index), if it exists: a migration's `down`. */
export async function dropIdempotencyTable (knex: Knex, tableName: string = DEFAULT_TABLE_NAME): Promise<void> {
  checkTableName(tableName)
  sqlDialect(knex)
  await knex.schema.dropTableIfExists(tableName)
}
