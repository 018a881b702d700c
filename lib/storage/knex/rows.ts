/**
 * Between KnexStorage and the drivers: keys as bytes, rows as results, and values as pg, mysql2
 * and better-sqlite3 return them (a BIGINT may come back as a number, a numeric string or a bigint).
 */
import type { BeginResult } from '../types.js'
import { UnreadableEntryError } from '../unreadable-entry.js'
import { MAX_KEY_BYTES } from './schema.js'

/**
 * A row as the drivers return it, under the names of COLUMNS. No name has an underscore, so a
 * knex whose `postProcessResponse` renames result columns (Objection's knexSnakeCaseMappers,
 * knex-stringcase: `lease_end` becomes `leaseEnd`) hands them back as they were asked for.
 */
export interface Row {
  fingerprint: string
  state: string
  token?: string | null
  leaseend: unknown
  statuscode: unknown
  contenttype: string | null
  headers: string | null
  body: unknown
}

/** The columns a result is built from, as a SELECT (or RETURNING) list and as knex's column array. */
export const COLUMNS = 'fingerprint, state, lease_end AS leaseend, status_code AS statuscode, content_type AS contenttype, headers, body'
export const READ_COLUMNS = ['fingerprint', 'state', 'lease_end as leaseend', 'status_code as statuscode', 'content_type as contenttype', 'headers', 'body']

const LONE_SURROGATE = /\p{Surrogate}/u

/** The key as the table stores it: its UTF-8 bytes, compared exactly on every dialect. */
export function encodeKey (key: string): Buffer {
  if (typeof key !== 'string') throw new TypeError('KnexStorage: the key must be a string')
  // UTF-8 would turn a lone surrogate into U+FFFD, and two different keys into one row.
  if (LONE_SURROGATE.test(key)) throw new TypeError('KnexStorage: the key is not well-formed Unicode (lone surrogate)')
  const bytes = Buffer.from(key, 'utf8')
  if (bytes.length > MAX_KEY_BYTES) {
    throw new TypeError(`KnexStorage: the key is ${bytes.length} bytes in UTF-8; the table holds at most ${MAX_KEY_BYTES}`)
  }
  return bytes
}

/** BIGINT as the drivers return it (number, numeric string from pg, bigint) -> number. */
export function millis (value: unknown): number {
  const result = typeof value === 'number' ? value : Number(value as string | bigint)
  if (!Number.isSafeInteger(result)) throw new Error(`KnexStorage: unexpected time value ${String(value)}`)
  return result
}

export function toBuffer (value: unknown): Buffer {
  if (Buffer.isBuffer(value)) return value
  if (value === null || value === undefined) return Buffer.alloc(0)
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength)
  throw new Error(`KnexStorage: unexpected body type ${typeof value}`)
}

/**
 * A live row as what `begin` returns for it. A `state` this version does not know (a later
 * version's, with the migration that allowed it) or a damaged `headers` column is refused as
 * unreadable, and the row is left as it is.
 */
export function toResult (row: Row): BeginResult {
  if (row.state === 'completed') {
    return {
      state: 'completed',
      fingerprint: row.fingerprint,
      response: {
        statusCode: Number(row.statuscode),
        contentType: row.contenttype ?? null,
        headers: row.headers === null ? {} : storedHeaders(row.headers),
        body: toBuffer(row.body),
        // An empty body is stored as an empty value; NULL says the body was not kept.
        ...(row.body === null ? { bodyOmitted: true } : {})
      }
    }
  }
  if (row.state === 'in_flight') {
    return { state: 'in-flight', fingerprint: row.fingerprint, lockExpiresAt: millis(row.leaseend) }
  }
  throw new UnreadableEntryError(`KnexStorage: the row's state ${JSON.stringify(row.state)} is not one this version knows (written by another version)`)
}

function storedHeaders (text: string): Record<string, string | string[]> {
  let headers: unknown
  try {
    headers = JSON.parse(text)
  } catch (error) {
    throw new UnreadableEntryError('KnexStorage: the row\'s headers are damaged', { cause: error })
  }
  if (headers === null || typeof headers !== 'object' || Array.isArray(headers)) throw new UnreadableEntryError('KnexStorage: the row\'s headers are not an object')
  return headers as Record<string, string | string[]>
}

/**
 * Whether a failed statement may still have run: the server did not refuse it with an error of
 * its own (node-postgres's errors from the server carry `severity`, mysql2's `sqlState`), so the
 * connection was lost after it was sent, or the client stopped waiting (knex's `.timeout()`). A
 * statement the server cancelled (57014, 1317, 1969), or chose as a deadlock victim, was rolled
 * back; one that never got a connection from knex's pool was never sent.
 */
export function outcomeUnknown (error: unknown): boolean {
  const { severity, sqlState, fatal, message } = (error ?? {}) as { severity?: unknown, sqlState?: unknown, fatal?: unknown, message?: unknown }
  if (typeof message === 'string' && message.startsWith(POOL_TIMEOUT)) return false
  return typeof severity !== 'string' && (typeof sqlState !== 'string' || fatal === true)
}

/** How knex's error begins when no pool connection came within `acquireConnectionTimeout`. */
const POOL_TIMEOUT = 'Knex: Timeout acquiring a connection'

/** Longest error message (and `sql`) passed on; see `trimmed`. */
const MAX_ERROR_TEXT = 2048

/**
 * knex writes the statement with its values into the error message, and mysql2 adds it as `sql`:
 * for a failed `complete` that is the whole body, hex-encoded, and it would end up in the logs.
 * The message keeps its start (the statement) and its end (the server's reason).
 */
export function trimmed (error: unknown): unknown {
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
