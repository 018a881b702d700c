/**
 * RedisStorage's value layout: one Redis string per idempotency key, whose first byte says what
 * it holds. Everything that knows where a byte sits in a value is here; the Lua scripts
 * (scripts.ts) take their offsets from the constants below.
 *
 *   lease:  'L' <token: 36 chars> <waiters: '-' or 'W'> <lease end: epoch ms> '|' <fingerprint>
 *   entry:  'C' <fingerprint length> '|' <fingerprint> <head length> '|' <head> <body bytes>
 *
 * where head is the JSON `[status, contentType, headers, bodyOmitted (1 or 0), stored at: epoch ms]`
 * (entries of earlier versions end after headers or bodyOmitted; lengths in bytes, in decimal).
 *
 * The first byte is also the layout's version: a later layout takes another letter, and a value
 * whose first byte this version does not know (or that does not parse) is refused as unreadable
 * (UnreadableEntryError), never overwritten: `SET NX` leaves it as it is.
 *
 * Why a lease looks like this: `begin` is Redis's own `SET key <lease> PX <lockTimeout> NX GET`,
 * which takes the lease or returns what is there in one native command, so the lease must be a
 * whole value, ready to store. Its first bytes, 'L' + token + waiters byte, are what the scripts
 * that end or renew it read (`GETRANGE`) and compare: the fence. The waiters byte turns 'W' when a
 * request waits for the lease to end (`SETRANGE`, which keeps the expiry), and only then does the
 * end PUBLISH. The fingerprint comes last so that an in-flight answer can report it.
 */
import { isUtf8 } from 'node:buffer'
import { TOKEN_LENGTH } from '../tokens.js'
import type { BeginCompleted, StoredResponse } from '../types.js'
import { UnreadableEntryError } from '../unreadable-entry.js'

/** First byte of a lease. */
export const LEASE_TAG = 'L'
/** First byte of a completed entry. */
export const ENTRY_TAG = 'C'
/** Ends the lease end (in a lease) and each length (in an entry). */
export const SEPARATOR = '|'
/** The waiters byte of a lease nobody waits for, and of one somebody does. */
export const NO_WAITERS = '-'
export const WAITING = 'W'

// Offsets into a value, counted from 0 as Buffers and GETRANGE/SETRANGE count.
/** Where the lease's token starts. */
export const TOKEN_OFFSET = LEASE_TAG.length
/** The waiters byte: right after the token. */
export const WAITERS_OFFSET = TOKEN_OFFSET + TOKEN_LENGTH
/** Where the lease end starts. */
export const LEASE_END_OFFSET = WAITERS_OFFSET + 1
/** The fence: the bytes a script compares to know the lease is still the caller's ('L', token, waiters byte). */
export const FENCE_LENGTH = LEASE_END_OFFSET

const LEASE_BYTE = LEASE_TAG.charCodeAt(0)
const ENTRY_BYTE = ENTRY_TAG.charCodeAt(0)
const SEPARATOR_BYTE = SEPARATOR.charCodeAt(0)

/**
 * The token RedisStorage's `begin` hands out, as a named thing: the lease's own token (TOKEN_LENGTH
 * characters, the part the scripts compare) followed by the fingerprint the lease was taken with.
 * The fingerprint travels in it because `complete` (whose signature all stores share) is given the
 * token but not the fingerprint, and the entry must record it: with it at hand the client builds
 * the whole entry and the script only compares and SETs, where reading it back from the lease
 * would have Redis copy the body into a new value inside Lua.
 */
export interface LeaseToken {
  token: string
  fingerprint: string
}

/** The string a LeaseToken travels as through the plugin. */
export function joinLeaseToken (lease: LeaseToken): string {
  return lease.token + lease.fingerprint
}

export function splitLeaseToken (text: string): LeaseToken {
  return { token: text.slice(0, TOKEN_LENGTH), fingerprint: text.slice(TOKEN_LENGTH) }
}

/** A lease as `begin` stores it: nobody waits for it yet. */
export function encodeLease (token: string, leaseEnd: number, fingerprint: string): string {
  return LEASE_TAG + token + NO_WAITERS + String(leaseEnd) + SEPARATOR + fingerprint
}

/** The fence of the lease `token` holds while nobody waits for it (FENCE_LENGTH bytes). */
export function fenceOf (token: string): string {
  return LEASE_TAG + token + NO_WAITERS
}

/** The fourth element is 1 when the body was omitted; both last ones are absent from entries of earlier versions. */
type Head = [statusCode: number, contentType: string | null, headers: StoredResponse['headers'], bodyOmitted?: 0 | 1, storedAt?: number]

/**
 * The whole entry value, as the complete script stores it. A string when the body is valid UTF-8
 * (a JSON body always is): it encodes back to the same bytes, and ioredis writes a command of
 * strings in one piece, where a Buffer argument costs it several copies
 * (bench/analysis.md#measurements-behind-the-design). Any other body goes as bytes.
 */
export function encodeEntry (fingerprint: string, response: StoredResponse, storedAt: number): string | Buffer {
  const head = JSON.stringify([response.statusCode, response.contentType, response.headers, response.bodyOmitted === true ? 1 : 0, storedAt] satisfies Head)
  const text = `${ENTRY_TAG}${Buffer.byteLength(fingerprint)}${SEPARATOR}${fingerprint}${Buffer.byteLength(head)}${SEPARATOR}${head}`
  return isUtf8(response.body) ? text + response.body.toString('utf8') : Buffer.concat([Buffer.from(text), response.body])
}

export interface DecodedLease {
  state: 'in-flight'
  /** The lease's own token (without a fingerprint). */
  token: string
  fingerprint: string
  lockExpiresAt: number
}

/** An entry: what `begin` replays, and when it was stored (`null` for an entry of an earlier version). */
export type DecodedEntry = BeginCompleted & { storedAt: number | null }

/** A value read from Redis; UnreadableEntryError for a layout this version does not know, or a damaged entry. */
export function decodeValue (value: Buffer): DecodedLease | DecodedEntry {
  const bar = value.indexOf(SEPARATOR_BYTE, 1)
  if (value[0] === LEASE_BYTE && bar !== -1) {
    return {
      state: 'in-flight',
      token: value.toString('latin1', TOKEN_OFFSET, WAITERS_OFFSET),
      fingerprint: value.toString('latin1', bar + 1),
      lockExpiresAt: Number(value.toString('latin1', LEASE_END_OFFSET, bar))
    }
  }
  if (value[0] !== ENTRY_BYTE || bar === -1) throw new UnreadableEntryError('RedisStorage: the value under this key is not in a layout this version knows (written by another version, or not by RedisStorage)')
  try {
    return decodeEntry(value, bar)
  } catch (error) {
    throw new UnreadableEntryError('RedisStorage: the entry under this key is damaged', { cause: error })
  }
}

function decodeEntry (value: Buffer, bar: number): DecodedEntry {
  const fingerprintEnd = bar + 1 + Number(value.toString('latin1', 1, bar))
  const headBar = value.indexOf(SEPARATOR_BYTE, fingerprintEnd)
  const headEnd = headBar + 1 + Number(value.toString('latin1', fingerprintEnd, headBar))
  const head = JSON.parse(value.toString('utf8', headBar + 1, headEnd)) as Head
  if (!Array.isArray(head) || typeof head[0] !== 'number') throw new TypeError('the head of the entry is not [status, contentType, headers]')
  return {
    state: 'completed',
    fingerprint: value.toString('latin1', bar + 1, fingerprintEnd),
    // A view into the reply, not a copy: the reply buffer is ours alone.
    response: head[3] === 1
      ? { statusCode: head[0], contentType: head[1], headers: head[2], body: value.subarray(headEnd), bodyOmitted: true }
      : { statusCode: head[0], contentType: head[1], headers: head[2], body: value.subarray(headEnd) },
    storedAt: head[4] ?? null
  }
}
