/**
 * A store's failure in one line a person can act on: a missing table, credentials the server
 * refused, a connection refused or a host not found, told apart by the drivers' codes (pg,
 * mysql2, better-sqlite3, ioredis) and, for ioredis, which reports a connection's failure only
 * as an 'error' event it prints, by what the client printed. Anything else: the driver's own
 * message, without the statement knex puts in front of it.
 */
import { driverReason } from '../storage/proof.js'

interface Failure { code?: unknown, errno?: unknown, message?: unknown, cause?: unknown, errors?: unknown }

/** The error, its causes, and an AggregateError's errors (pg reports each address it tried). */
function failures (error: unknown, depth = 0): Failure[] {
  if (error === null || typeof error !== 'object' || depth > 4) return []
  const failure = error as Failure
  const nested = Array.isArray(failure.errors) ? failure.errors.flatMap((inner) => failures(inner, depth + 1)) : []
  return [failure, ...failures(failure.cause, depth + 1), ...nested]
}

/** The driver's message, without the statement knex puts before it (even one of several lines). */
export const driverMessage = driverReason

export function storeProblem (error: unknown, printed: readonly string[]): string | null {
  const all = failures(error)
  const texts = [...all.map((failure) => String(failure.message ?? '')), ...printed]
  const has = (test: (failure: Failure) => boolean): boolean => all.some(test)
  const find = (pattern: RegExp): RegExpExecArray | null => texts.map((text) => pattern.exec(text)).find((match) => match !== null) ?? null

  if (has((f) => f.code === '42P01' || f.errno === 1146 || f.code === 'ER_NO_SUCH_TABLE') || find(/no such table/i) !== null) {
    const table = find(/relation "([^"]+)" does not exist|Table '([^']+)' doesn't exist|no such table: (\S+)/i)
    const name = table === null ? 'the table' : `the table ${table[1] ?? table[2] ?? table[3]}`
    return `${name} does not exist: create it (createIdempotencyTable in a migration, or createTable: true in the app), or give the config module the app's tableName`
  }
  const denied = has((f) => f.code === '28P01' || f.code === '28000' || f.errno === 1045 || f.code === 'ER_ACCESS_DENIED_ERROR')
  const deniedText = find(/(WRONGPASS[^\n]*|NOAUTH[^\n]*|password authentication failed[^\n]*|Access denied for user[^\n]*)/i)
  if (denied || deniedText !== null) {
    return `the store refused the credentials (${deniedText?.[1] ?? driverMessage(error)}): check the user and password the config module gives`
  }
  const refused = find(/ECONNREFUSED ([^\s,)]+)/)
  if (refused !== null || has((f) => f.code === 'ECONNREFUSED')) {
    return `cannot connect to the store${refused === null ? '' : ` at ${refused[1]}`}: connection refused (is it running, and are the host and port in the config module right?)`
  }
  const unknownHost = find(/(?:ENOTFOUND|EAI_AGAIN) ([^\s,)]+)/)
  if (unknownHost !== null) return `cannot find the store's host ${unknownHost[1]} (is the host in the config module right?)`
  return null
}
