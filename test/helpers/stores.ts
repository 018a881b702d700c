/**
 * Every store the behaviour tests run against, each on its real server. A store whose server is
 * unreachable is skipped with the reason (and fails under CI=true, see services.ts).
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Redis } from 'ioredis'
import knexFactory, { type Knex } from 'knex'
import type { IdempotencyStorage } from '../../lib/storage/types.js'
import { MemoryStorage } from '../../lib/storage/memory.js'
import { RedisStorage } from '../../lib/redis.js'
import { KnexStorage } from '../../lib/knex.js'
import { dropIdempotencyTable } from '../../lib/knex.js'
import { MARIADB, POSTGRES, REDIS, deleteRedisPrefix, mysqlConnection, pgConnection, service } from './services.js'

export interface StoreCase {
  name: string
  available: boolean
  reason: string
  /** A storage on a fresh namespace (prefix or table) of the shared server. */
  create: () => Promise<IdempotencyStorage>
  /** Drop what `create` made (keys, tables, connections). */
  cleanup: () => Promise<void>
  /**
   * Everything the server holds for this store, as text (Redis: every key name and value; SQL:
   * every row): what someone who reads the store sees. Absent for the in-process store.
   */
  dump?: () => Promise<string>
  /** The SQL stores: the knex instance `create` made, for a test's own tables. */
  knex?: () => Knex
  /**
   * Another storage on the namespace of the last `create`, through a client of its own, and how
   * to close that client: what an app that closes its client in `onClose` uses (an app after a
   * restart, say). The in-process store gives the same storage, with nothing to close.
   */
  open: () => Promise<{ storage: IdempotencyStorage, close: () => Promise<void> }>
  /**
   * Another storage on the namespace `create` made (the same Redis prefix, the same table), built
   * with the given classes: another version of the package sharing the store. Absent for the
   * in-process store.
   */
  sibling?: (classes: StorageClasses) => IdempotencyStorage
}

/** The store classes of some version of the package. */
export interface StorageClasses {
  RedisStorage: new (options: { client: Redis, prefix?: string }) => IdempotencyStorage
  KnexStorage: new (options: { knex: Knex, tableName?: string, createTable?: boolean }) => IdempotencyStorage
}

/** Bytes as a reader of a dump sees them: as text, whatever their encoding. */
function readable (value: unknown): string {
  if (Buffer.isBuffer(value)) return value.toString('latin1')
  if (value instanceof Uint8Array) return Buffer.from(value).toString('latin1')
  return String(value)
}

let unique = 0
const namespace = (label: string) => `bt_${label}_${process.pid}_${Date.now()}_${++unique}`

function redisCase (available: boolean, reason: string): StoreCase {
  let client: Redis | undefined
  let prefix = ''
  return {
    name: 'redis',
    available,
    reason,
    create: async () => {
      client = new Redis({ host: REDIS.host, port: REDIS.port, enableAutoPipelining: true })
      prefix = `${namespace('redis')}:`
      return new RedisStorage({ client, prefix })
    },
    cleanup: async () => {
      if (client === undefined) return
      await deleteRedisPrefix(client, prefix)
      await client.quit()
    },
    open: async () => {
      const own = new Redis({ host: REDIS.host, port: REDIS.port, enableAutoPipelining: true })
      return { storage: new RedisStorage({ client: own, prefix }), close: async () => { await own.quit() } }
    },
    sibling: (classes) => new classes.RedisStorage({ client: client!, prefix }),
    dump: async () => {
      const keys = await client!.keysBuffer(`${prefix}*`)
      const lines = await Promise.all(keys.map(async (key) => `${readable(key)} = ${readable(await client!.getBuffer(key))}`))
      return lines.join('\n')
    }
  }
}

function knexCase (name: string, available: boolean, reason: string, connect: () => Knex, dispose: () => void = () => {}): StoreCase {
  let knex: Knex | undefined
  let table = ''
  return {
    name,
    available,
    reason,
    create: async () => {
      knex = connect()
      table = namespace(name)
      return new KnexStorage({ knex, tableName: table, createTable: true })
    },
    cleanup: async () => {
      if (knex === undefined) return
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
      dispose()
    },
    knex: () => knex!,
    open: async () => {
      const own = connect()
      return { storage: new KnexStorage({ knex: own, tableName: table, createTable: true }), close: async () => { await own.destroy() } }
    },
    sibling: (classes) => new classes.KnexStorage({ knex: knex!, tableName: table, createTable: true }),
    dump: async () => {
      const rows = await knex!(table).select('*') as Array<Record<string, unknown>>
      return rows.map((row) => Object.entries(row).map(([column, value]) => `${column}=${readable(value)}`).join(' | ')).join('\n')
    }
  }
}

function memoryCase (): StoreCase {
  let storage = new MemoryStorage()
  return {
    name: 'memory',
    available: true,
    reason: '',
    create: async () => (storage = new MemoryStorage()),
    cleanup: async () => {},
    open: async () => ({ storage, close: async () => {} })
  }
}

export async function storeCases (): Promise<StoreCase[]> {
  const [redis, postgres, mariadb] = await Promise.all([service(REDIS), service(POSTGRES), service(MARIADB)])
  const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-behaviour-'))
  return [
    memoryCase(),
    redisCase(redis.available, redis.reason),
    knexCase('postgres', postgres.available, postgres.reason, () => knexFactory({ client: 'pg', connection: pgConnection })),
    knexCase('mariadb', mariadb.available, mariadb.reason, () => knexFactory({ client: 'mysql2', connection: mysqlConnection })),
    knexCase('sqlite', true, '', () => knexFactory({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'behaviour.db') }, useNullAsDefault: true }),
      () => rmSync(sqliteDir, { recursive: true, force: true }))
  ]
}
