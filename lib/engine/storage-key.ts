/**
 * The key a store sees for a request: the one key policy, so that every store (and anyone's custom
 * store) accepts whatever the plugin accepts.
 *
 * Without a scope it is the client's key itself (1 to `maxKeyLength` printable ASCII characters);
 * with one, `<scope>\n<key>` (a key never contains a line feed, so the last one separates the two);
 * a request without a caller on a scoped route has the scope `NO_CALLER_SCOPE`, `\n<key>`.
 * A scope is the application's own string and may be long or not well-formed Unicode (a lone
 * surrogate, which UTF-8 cannot encode: two different scopes would become one). Such a key, or
 * one longer than MAX_STORAGE_KEY_BYTES in UTF-8, or one whose scope starts with NUL (the marker of
 * the keys the plugin makes itself: hashes, and steps' records), is replaced by a hash of it:
 * `\u0000sha256:<base64url digest>`. It cannot equal a key that was not hashed: an unscoped key
 * is printable ASCII (no NUL), and a scoped one contains a line feed (a digest never does).
 *
 * With encryption on, every key is a keyed hash of the same composition instead
 * (`\u0000hmac:<base64url digest>`, see encryption.ts): the store learns neither key nor scope.
 */
import { hash } from 'node:crypto'
import { IdempotencyKeyInvalidError } from '../errors.js'

/**
 * The scope of requests with no caller (the route's scope returned `undefined` or `null`): the empty
 * string, which no scope may return (it is refused as no caller's id, http/scope.ts). So no scope
 * value shares its namespace, and no two scope values share one either: the storage key is
 * `<scope>\n<key>`, and a key never holds a line feed. Operators address it the same way
 * (`scope: ''`, the command's `--no-caller`).
 */
export const NO_CALLER_SCOPE = ''

/**
 * The namespace of the keys of `run` (jobs, messages): their scope is `run()`, or `run():<scope>`
 * for a run given one. No request's scope may start with it (http/scope.ts refuses one that does),
 * so no client's `Idempotency-Key` reads a job's result or takes its key. Operators address a
 * job's key with this scope (`scope: 'run():billing'`).
 */
export const RUN_SCOPE = 'run()'

/** The scope a run's key is stored under, for the run's own `scope` (`null`: none). */
export function runScope (scope: string | null): string {
  return scope === null ? RUN_SCOPE : `${RUN_SCOPE}:${scope}`
}

/**
 * Longest storage key passed on unhashed, in UTF-8 bytes: every store of this package takes it
 * (KnexStorage's key column holds 1024), and it keeps Redis key names short.
 */
export const MAX_STORAGE_KEY_BYTES = 512

/** Marks a hashed storage key. */
export const HASHED_KEY_PREFIX = '\u0000sha256:'

/** In `u` mode a well-formed pair reads as one code point, so this finds lone surrogates only. */
const LONE_SURROGATE = /\p{Surrogate}/u

/** What makes keyed hashes of storage keys (encryption's ResponseCipher). */
export interface KeyHasher {
  hashKey: (composed: string) => string
}

export function storageKey (key: string, scope: string | null, hasher: KeyHasher | null = null): string {
  if (hasher !== null) return hasher.hashKey(scope === null ? key : `${scope}\n${key}`)
  // An unscoped key is ASCII: its length is its size in bytes.
  if (scope === null && key.length <= MAX_STORAGE_KEY_BYTES) return key
  const composed = scope === null ? key : `${scope}\n${key}`
  // A string of n UTF-16 units takes n to 3n bytes in UTF-8: count them only when it may matter.
  const fits = composed.length * 3 <= MAX_STORAGE_KEY_BYTES ||
    (composed.length <= MAX_STORAGE_KEY_BYTES && Buffer.byteLength(composed) <= MAX_STORAGE_KEY_BYTES)
  // A key that starts with NUL is one the plugin made (a hash, a step's record: NUL is their
  // marker, which operators and `forget` rely on); a scope that starts with one is hashed too.
  if (fits && composed.charCodeAt(0) !== 0 && !LONE_SURROGATE.test(composed)) return composed
  // UTF-16 code units, so lone surrogates hash apart.
  return HASHED_KEY_PREFIX + hash('sha256', Buffer.from(composed, 'utf16le'), 'base64url')
}

/**
 * The client's key and the scope a storage key was composed of, as far as it says: a hashed key
 * (long, ill-formed, or with encryption, a keyed hash) says neither.
 */
export function storageKeyParts (key: string): { key: string, scope: string | null } | null {
  if (key.startsWith('\u0000')) return null
  // The client's key never holds a line feed: the last one ends the scope.
  const end = key.lastIndexOf('\n')
  return end === -1 ? { key, scope: null } : { key: key.slice(end + 1), scope: key.slice(0, end) }
}

/** Printable ASCII (0x20-0x7E): what a key may hold, as an unquoted sf-string of the header may. */
const PRINTABLE_KEY = /^[\x20-\x7E]+$/

/**
 * A key the application's code gives (to `run`, or from a route's `key` function): 1 to
 * `maxLength` printable ASCII characters, as a key read from the header. `source` names where it
 * came from in the refusal (IdempotencyKeyInvalidError, a 400 on a route).
 */
export function checkKey (key: unknown, maxLength: number, source: string): string {
  if (typeof key !== 'string' || key.length === 0 || key.length > maxLength || !PRINTABLE_KEY.test(key)) {
    throw new IdempotencyKeyInvalidError(`${source} must be 1 to ${maxLength} printable ASCII characters.`)
  }
  return key
}
