/**
 * Instruments for knex instances under test: what a store sends (counted, watched, made to fail)
 * and which server it believes it talks to. Every statement the stores send reaches a pooled
 * connection's `query` (knex's, and the store's own on PostgreSQL) or `execute` (the store's
 * prepared statements on MariaDB); on SQLite, better-sqlite3's statements.
 */
import type { Knex } from 'knex'
import { sqlDialect } from '../../lib/storage/knex/schema.js'

type Method = (...args: unknown[]) => unknown
type Connection = Record<string, unknown>

/**
 * `acquire`, replacing `methods` of each connection it lends by `wrap(original)`, once per
 * connection and in place: the pool must get back the very object it lent.
 */
export function wrappingConnections (acquire: () => Promise<Connection>, methods: readonly string[], wrap: (original: Method, connection: Connection) => Method): () => Promise<Connection> {
  const wrapped = new WeakSet<Method>()
  return async () => {
    const connection = await acquire()
    for (const method of methods) {
      const original = connection[method]
      if (typeof original !== 'function' || wrapped.has(original as Method)) continue
      const replacement = wrap(original as Method, connection)
      wrapped.add(replacement)
      connection[method] = replacement
    }
    return connection
  }
}

interface PoolClient { acquireConnection: () => Promise<Connection> }

/**
 * Replaces `methods` of every connection the knex instance's pool lends from now on; the returned
 * function stops it for connections lent later.
 */
export function watchConnections (knex: Knex, methods: readonly string[], wrap: (original: Method, connection: Connection) => Method): () => void {
  const client = knex.client as PoolClient
  const acquire = client.acquireConnection
  client.acquireConnection = wrappingConnections(() => acquire.call(client), methods, wrap)
  return () => { client.acquireConnection = acquire }
}

/**
 * A knex instance whose server claims to be MySQL 8: the storage then takes the MySQL path
 * (upsert, then a read) instead of MariaDB's INSERT ... RETURNING, and the same SQL runs on MariaDB.
 */
export function asMySql (knex: Knex): Knex {
  return new Proxy(knex, {
    get (target, property, receiver) {
      if (property !== 'raw') return Reflect.get(target, property, receiver)
      return (sql: string, ...rest: unknown[]) => /VERSION\(\)/.test(sql)
        ? Promise.resolve([[{ version: '8.0.36' }], []])
        : (target.raw as Method)(sql, ...rest)
    }
  })
}

/**
 * Statements as they run: on pooled connections; on SQLite, better-sqlite3's own runs, since the
 * store runs its hot statements on the connection itself (and knex's go through the same methods).
 */
export function countStatements (knex: Knex): { count: () => number, stop: () => void } {
  let count = 0
  if (sqlDialect(knex) !== 'sqlite') {
    let countOn = true
    const unwatch = watchConnections(knex, ['query', 'execute'], (original, connection) => function (this: unknown, ...args: unknown[]) {
      if (countOn) count++
      return original.apply(this ?? connection, args)
    })
    return { count: () => count, stop: () => { countOn = false; unwatch() } }
  }
  const Database = knex.client.driver as new (filename: string) => { prepare: (sql: string) => object, close: () => void }
  const probe = new Database(':memory:')
  const prototype = Object.getPrototypeOf(probe.prepare('SELECT 1')) as Record<string, Method>
  probe.close()
  const originals = Object.fromEntries(['all', 'run', 'get'].map((name) => [name, prototype[name]!]))
  for (const [name, original] of Object.entries(originals)) {
    prototype[name] = function (this: unknown, ...args: unknown[]) { count++; return original.apply(this, args) }
  }
  return { count: () => count, stop: () => { Object.assign(prototype, originals) } }
}

/** The SQL of a driver call: a string, or pg's `{ text }` and mysql2's `{ sql }`. */
function sqlOf (args: unknown[]): string {
  const first = args[0] as string | { text?: string, sql?: string }
  return typeof first === 'string' ? first : String(first.text ?? first.sql)
}

/**
 * A knex instance whose `begin` statement fails `failures` times with `error` before it runs. On
 * SQLite the store then goes through knex too (it runs statements on better-sqlite3 directly only
 * when the client is better-sqlite3's).
 */
export function failingBegins (knex: Knex, failures: number, error: Record<string, unknown>, attempts: { count: number }): Knex {
  const fails = (sql: string, pattern: RegExp): boolean => {
    if (!pattern.test(sql)) return false
    attempts.count++
    return attempts.count <= failures
  }
  const failure = (): Error => Object.assign(new Error('injected deadlock'), error)
  // PostgreSQL and MariaDB send begin on a pooled connection directly: fail it there.
  const acquire = wrappingConnections(() => (knex.client as PoolClient).acquireConnection(), ['query', 'execute'], (original, connection) => (...args: unknown[]) => {
    if (!fails(sqlOf(args), /^(WITH live|SET STATEMENT)/)) return original.apply(connection, args)
    const callback = args.find((arg) => typeof arg === 'function') as ((error: Error) => void) | undefined
    if (callback !== undefined) { callback(failure()); return undefined }
    return Promise.reject(failure())
  })
  return new Proxy(knex, {
    get (target, property, receiver) {
      if (property === 'client') {
        return new Proxy(target.client, {
          get: (client, name) => {
            if (name === 'driverName') return 'proxied'
            return name === 'acquireConnection' ? acquire : Reflect.get(client, name)
          }
        })
      }
      if (property !== 'raw') return Reflect.get(target, property, receiver)
      return (sql: string, ...rest: unknown[]) => {
        if (!fails(sql, /^(WITH live|INSERT INTO)/)) return (target.raw as Method)(sql, ...rest)
        // Shaped like a knex Raw as far as KnexStorage uses one: a thenable with .timeout()
        // and .options().
        const failed = Promise.reject(failure())
        return Object.assign(failed, { timeout: () => failed, options: () => failed })
      }
    }
  })
}
