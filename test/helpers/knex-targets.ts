/**
 * The databases the knex store is tested on, and what its tests share: tables of their own,
 * knex instances destroyed after the suite, a stored response.
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import knexFactory, { type Knex } from 'knex'
import { afterAll } from 'vitest'
import { KnexStorage } from '../../lib/knex.js'
import { dropIdempotencyTable, sqlDialect } from '../../lib/storage/knex/schema.js'
import type { StoredResponse } from '../../lib/storage/types.js'
import { asMySql } from './knex-instrument.js'
import { pgbouncer } from './pgbouncer.js'
import { type Availability, MARIADB, mysqlConnection, pgConnection, POSTGRES, service } from './services.js'

export const postgres = await service(POSTGRES)
export const mariadb = await service(MARIADB)
const bouncer = await pgbouncer()

/** The ways the PostgreSQL store is tested: directly, and through PgBouncer in each pooling mode. */
export interface PostgresConnection {
  name: string
  availability: Availability
  settings: typeof pgConnection
  /** Through a pooler: the store cannot LISTEN, nor cancel a statement by process id. */
  pooled: boolean
}

export async function postgresConnections (): Promise<PostgresConnection[]> {
  return [
    { name: 'directly', availability: postgres, settings: pgConnection, pooled: false },
    { name: 'through PgBouncer (transaction pooling)', availability: bouncer.availability, settings: bouncer.transaction, pooled: true },
    { name: 'through PgBouncer (session pooling)', availability: bouncer.availability, settings: bouncer.session, pooled: true }
  ]
}

export const LEASE = 30_000
export const EXPIRY = 60_000

export interface Target {
  name: string
  availability: Availability
  config: () => Knex.Config
  /** Statements `begin` spends on a replay (after the storage is prepared). */
  replayStatements: number
  /** Statements of a first `begin` (SQLite reads before it writes). Default 1. */
  firstBeginStatements?: number
  /** Wraps every knex instance handed to a storage (the MySQL path is tested on MariaDB this way). */
  wrap?: (knex: Knex) => Knex
  /** How the server reports a deadlock victim, for the retry test; none for SQLite. */
  deadlock?: Record<string, unknown>
  /** The driver set to return BIGINTs another way (pg already returns strings by default). */
  bigintConfig?: () => Knex.Config
  /** PostgreSQL through a pooler (PgBouncer): waits poll instead of LISTEN. */
  pooled?: boolean
}

/** Every database the store supports, SQLite in a directory removed after the test file. */
export function knexTargets (): Target[] {
  const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-knex-'))
  afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))
  const sqliteFile = join(sqliteDir, 'store.sqlite')
  return [
    {
      name: 'PostgreSQL (pg)',
      availability: postgres,
      config: () => ({ client: 'pg', connection: pgConnection }),
      replayStatements: 1,
      deadlock: { code: '40P01' }
    },
    {
      name: 'PostgreSQL (pg) through PgBouncer, transaction pooling',
      availability: bouncer.availability,
      config: () => ({ client: 'pg', connection: bouncer.transaction }),
      replayStatements: 1,
      deadlock: { code: '40P01' },
      pooled: true
    },
    {
      name: 'MariaDB (mysql2, INSERT ... RETURNING)',
      availability: mariadb,
      config: () => ({ client: 'mysql2', connection: mysqlConnection }),
      replayStatements: 1,
      deadlock: { errno: 1213, code: 'ER_LOCK_DEADLOCK' },
      bigintConfig: () => ({ client: 'mysql2', connection: { ...mysqlConnection, supportBigNumbers: true, bigNumberStrings: true } })
    },
    {
      name: 'MariaDB (mysql2, the MySQL path: upsert then read)',
      availability: mariadb,
      config: () => ({ client: 'mysql2', connection: mysqlConnection }),
      replayStatements: 2,
      wrap: asMySql,
      deadlock: { errno: 1213, code: 'ER_LOCK_DEADLOCK' }
    },
    {
      name: 'SQLite (better-sqlite3, file)',
      availability: { available: true, reason: '' },
      config: () => ({ client: 'better-sqlite3', connection: { filename: sqliteFile }, useNullAsDefault: true }),
      replayStatements: 1,
      firstBeginStatements: 2,
      bigintConfig: () => ({ client: 'better-sqlite3', connection: { filename: sqliteFile, options: { safeIntegers: true } }, useNullAsDefault: true })
    }
  ]
}

let tables = 0
export function uniqueTable (): string {
  // Short: PostgreSQL and MySQL cut identifiers at 63/64 characters, index names included.
  return `idem_${process.pid}_${Date.now().toString(36)}_${++tables}`
}

export function response (overrides: Partial<StoredResponse> = {}): StoredResponse {
  return { statusCode: 201, contentType: 'application/json', headers: { location: '/x' }, body: Buffer.from('{"ok":true}'), ...overrides }
}

export interface TargetDatabase {
  /** A new knex instance (own pool, own connections), as handed to storages. */
  connect: () => Knex
  /** The instance the tests inspect the database with. */
  db: () => Knex
  /** A new table name, its table dropped after the suite. */
  table: () => string
  /** A storage on one knex instance shared by the storages of the suite. */
  storage: (options?: { tableName?: string, now?: () => number, createTable?: boolean }) => KnexStorage
  /** That shared knex instance, once a storage has been made. */
  storageKnex: () => Knex | undefined
  /** Destroys `knex` after the suite. */
  destroyLater: (knex: Knex) => Knex
  rowOf: (tableName: string, key: string) => Promise<Record<string, unknown> | undefined>
}

/** What a suite on `target` works with; call it in the suite's describe (it registers the clean-up). */
export function targetDatabase (target: Target): TargetDatabase {
  const instances: Knex[] = []
  const created: string[] = []
  let shared: Knex | undefined
  let storageKnex: Knex | undefined
  const destroyLater = (knex: Knex): Knex => {
    instances.push(knex)
    return knex
  }
  const connect = (): Knex => {
    const knex = destroyLater(knexFactory(target.config()))
    return target.wrap === undefined ? knex : target.wrap(knex)
  }
  const db = (): Knex => {
    shared ??= destroyLater(knexFactory(target.config()))
    return shared
  }
  const table = (): string => {
    const name = uniqueTable()
    created.push(name)
    return name
  }
  afterAll(async () => {
    const knex = db()
    for (const name of created) await dropIdempotencyTable(knex, name)
    for (const instance of instances) await instance.destroy()
  })
  return {
    connect,
    db,
    table,
    storage: (options = {}) => {
      storageKnex ??= connect()
      return new KnexStorage({ knex: storageKnex, tableName: options.tableName ?? table(), createTable: options.createTable ?? true, now: options.now })
    },
    storageKnex: () => storageKnex,
    destroyLater,
    rowOf: async (tableName, key) => db()(tableName).first('*').where('idempotency_key', Buffer.from(key, 'utf8'))
  }
}

/** Columns and indexes of a table, with the table's own name replaced by `T` in index names. */
export async function describeTable (knex: Knex, name: string): Promise<{ columns: unknown, indexes: string[] }> {
  const columns = await knex(name).columnInfo()
  let indexes: string[]
  const dialect = sqlDialect(knex)
  if (dialect === 'postgres') {
    const { rows } = await knex.raw('SELECT indexname FROM pg_indexes WHERE tablename = ?', [name])
    indexes = rows.map((row: { indexname: string }) => row.indexname)
  } else if (dialect === 'mysql') {
    const [rows] = await knex.raw('SHOW INDEX FROM ??', [name])
    indexes = [...new Set<string>(rows.map((row: { Key_name: string }) => row.Key_name))]
  } else {
    const rows = await knex.raw('PRAGMA index_list(??)', [name])
    indexes = rows.map((row: { name: string }) => row.name)
  }
  return { columns, indexes: indexes.map((index) => index.split(name).join('T')).sort() }
}

/** The pg driver as knex loaded it (it ships no types of its own). */
export interface PgClient {
  connect: () => Promise<void>
  query: (sql: string) => Promise<unknown>
  end: () => Promise<void>
  on: (event: 'notification', listener: (message: { channel: string, payload?: string }) => void) => void
}
interface PgDriver {
  Client: new (config: object) => PgClient
  Pool: new (config: object) => { end: () => Promise<void> }
}
export const pgDriver = (knex: Knex): PgDriver => knex.client.driver
