/**
 * How RedisStorage names things in Redis: the Redis key of an idempotency key (the prefix, then
 * the key, escaped, as the hash tag), the way back from a Redis key to the key, and the channel a
 * lease's end is published on.
 *
 * Two kinds of names: a command's key arguments, which the client may rewrite (ioredis's
 * `keyPrefix` goes in front of each), and everything named outside them (a SCAN's MATCH pattern and
 * the keys it returns, a pub/sub channel), which no client rewrites. The scripts name the channel
 * from KEYS[1] as Redis sees it, keyPrefix included; so the storage subscribes to, and scans for,
 * names with the client's keyPrefix in front (`keyPrefixText`, read by each driver), and hands back to its commands
 * the keys a SCAN found without it.
 */
import { isUtf8 } from 'node:buffer'

/** Appended to a Redis key to name the channel its lease's end is published on. */
export const CHANNEL_SUFFIX = ':ended'

// Escaped: `%` (the escape character itself), both braces (so the user's text can never end or
// open the hash tag) and lone UTF-16 surrogates (ioredis would encode each as U+FFFD, making two
// different keys one). In `u` mode the class skips well-formed surrogate pairs.
const NEEDS_ESCAPE = /[%{}\uD800-\uDFFF]/u
const ESCAPES = /[%{}\uD800-\uDFFF]/gu
const UNESCAPES = /%(25|7B|7D|u[0-9A-F]{4})/g

function escapeChar (char: string): string {
  if (char === '%') return '%25'
  if (char === '{') return '%7B'
  if (char === '}') return '%7D'
  return '%u' + char.charCodeAt(0).toString(16).toUpperCase()
}

/** The Redis key of `key`, under `open` (the prefix and the opening brace of the hash tag). */
export function redisKeyOf (open: string, key: string): string {
  return open + (NEEDS_ESCAPE.test(key) ? key.replace(ESCAPES, escapeChar) : key) + '}'
}

/** A `%` that starts no escape: only the start-up proof's probe keys have one (proof.ts). */
const LONE_PERCENT = /%(?!25|7B|7D|u[0-9A-F]{4})/

/** The key a RedisStorage was given, from the Redis key it stored it under; `null` for another key. */
export function storageKeyOf (open: string, redisKey: string): string | null {
  if (!redisKey.startsWith(open) || !redisKey.endsWith('}')) return null
  const escaped = redisKey.slice(open.length, -1)
  if (LONE_PERCENT.test(escaped)) return null
  return escaped.replace(UNESCAPES, (_match, code: string) => {
    if (code === '25') return '%'
    if (code === '7B') return '{'
    if (code === '7D') return '}'
    return String.fromCharCode(parseInt(code.slice(1), 16))
  })
}

export function channelOf (redisKey: string): string {
  return redisKey + CHANNEL_SUFFIX
}

/**
 * A client's `keyPrefix` option (ioredis's, which a Cluster also takes from its `redisOptions`;
 * node-redis 6's) as the text in front of every key it sends, or ''. A Buffer counts as its UTF-8
 * text, which is how the storage's names are sent.
 */
export function keyPrefixText (prefix: unknown): string {
  if (typeof prefix === 'string') return prefix
  if (Buffer.isBuffer(prefix)) {
    if (!isUtf8(prefix)) throw new TypeError('RedisStorage: the client\'s `keyPrefix` must be text (a Buffer of valid UTF-8)')
    return prefix.toString('utf8')
  }
  return ''
}
