/**
 * The direct path: the hot statements run on a connection of knex's pool, past knex's query
 * building, whose formatting and renumbering of values cost as much as the statement on SQLite and
 * a share of the first request elsewhere.
 */
import type { Knex } from 'knex'

/** What the direct path needs of knex's client (see `onConnection`). */
interface PoolClient<C> {
  driverName?: string
  acquireConnection: () => Promise<C>
  releaseConnection: (connection: C) => Promise<unknown>
  cancelQuery: (connection: C) => Promise<unknown>
}

/** The driver knex runs `db` on: `'pg'`, `'mysql2'`, `'better-sqlite3'`, ... */
export function driverOf (db: Knex | Knex.Transaction): string | undefined {
  return (db.client as { driverName?: string }).driverName
}

/**
 * Run `query` on a connection of `db` (a pooled one, or a transaction's own), past knex's query
 * building: for the statements of the hot path, whose values knex would format and renumber on
 * every call. Bounded like `bounded`: past `ms` the server cancels the statement.
 */
export async function onConnection<C, T> (db: Knex | Knex.Transaction, ms: number, query: (connection: C) => Promise<T>): Promise<T> {
  const client = db.client as PoolClient<C>
  const connection = await client.acquireConnection() as C & { __knex__disposed?: unknown }
  /** The cancel sent past `ms`: it never rejects (its failure is kept on the connection). */
  let cancelling: Promise<void> | undefined
  const timer = ms === 0
    ? undefined
    : setTimeout(() => {
      // Its own connection may hang as the statement does, and fail before the statement does
      // (a partition healed with resets): its failure is handled from the start, never left to
      // reject with nobody listening, which would end the process.
      cancelling = Promise.resolve().then(() => client.cancelQuery(connection)).then(() => {}, (error: unknown) => { connection.__knex__disposed ??= error })
    }, ms)
  try {
    return await query(connection)
  } finally {
    clearTimeout(timer)
    // A cancel that lands after its statement ended would stop the next statement sent on this
    // connection: it goes back to the pool once the cancel is done, or is thrown away (as knex
    // does) when the cancel failed, or has not ended within `ms` more (then its pool slot is free).
    if (cancelling !== undefined && !await settlesWithin(cancelling, ms)) connection.__knex__disposed ??= new Error('KnexStorage: a statement cancel did not end in time')
    await client.releaseConnection(connection)
  }
}

/** Whether `promise` (which never rejects) settles within `ms`. */
async function settlesWithin (promise: Promise<void>, ms: number): Promise<boolean> {
  let timer: NodeJS.Timeout | undefined
  const late = new Promise<false>((resolve) => { timer = setTimeout(resolve, ms, false) })
  try {
    return await Promise.race([promise.then(() => true), late])
  } finally {
    clearTimeout(timer)
  }
}
