import { isUtf8 } from 'node:buffer'
import { createHash } from 'node:crypto'
import type { Cluster, Redis } from 'ioredis'
import { duration } from './durations.js'
import { forgetKey, inspectKey, listLeases, type RedisView } from './redis-operations.js'
import { TOKEN_LENGTH, TokenGenerator, tokenIssuedAt } from './tokens.js'
import type { BeginCompleted, BeginResult, StorageForgetOptions, StorageForgetResult, IdempotencyStorage, LeaseListing, StoredResponse, StoredState } from './types.js'
import { UnreadableEntryError } from './unreadable-entry.js'
import { KeyWaiters, type Waiter } from './waiters.js'

export interface RedisStorageOptions {
  /**
   * An ioredis `Redis` or `Cluster` client (`fastify.redis` from @fastify/redis works too). The
   * storage never closes it: whoever created the client closes it.
   */
  client: Redis | Cluster
  /** Prepended to every Redis key. No `{` or `}` (see `redisKey`). Default `'idempotency:'`. */
  prefix?: string
}

/*
 * One string per idempotency key, whose first byte says what it holds:
 *
 *   lease:  'L' <token: 36 chars> <waiters: '-' or 'W'> <lease end: epoch ms> '|' <fingerprint>
 *   entry:  'C' <fingerprint length> '|' <fingerprint> <head length> '|' <head> <body bytes>
 *
 * where head is the JSON `[status, contentType, headers, bodyOmitted (1 or 0), stored at: epoch ms]`
 * (entries of earlier versions end after headers or bodyOmitted; lengths in bytes, in decimal).
 * The first byte is also the layout's version: a later layout takes another letter, and a value
 * whose first byte this version does not know (or that does not parse) is refused as unreadable
 * (UnreadableEntryError), never overwritten: `SET NX` leaves it as it is.
 *
 * so that `begin` is Redis's own `SET key <lease> PX <lockTimeout> NX GET`: it takes the lease
 * when the key is free and otherwise returns what is there, in one native command and one round
 * trip, with no script. A replay then costs what a GET costs, plus the lease value sent along
 * (a hash read by a Lua script cost Redis two to three times as much per replay:
 * docs/benchmarks.md#measurements-behind-the-design).
 * The key's PX expiry is the lease while in flight and the entry's lifetime once completed, so
 * Redis drops both on time.
 *
 * Complete and release (one script) and renew first compare the lease's first 37 bytes
 * ('L' + token). What `begin` hands out as the token is that token followed by the fingerprint, so
 * `complete` builds the whole entry on the client and the script only compares and SETs.
 * A request waiting for the key (`waitFor`, possibly in another process) turns the waiters byte
 * into 'W'; only then do complete and release PUBLISH on the key's channel, so a key nobody
 * waits for costs no PUBLISH (which in Redis Cluster goes to every node).
 */

const LEASE_PREFIX_LENGTH = 1 + TOKEN_LENGTH

// Lua strings count from 1: the lease prefix is bytes 1..37, the waiters byte is byte 38.
const PREFIX_END = LEASE_PREFIX_LENGTH
const WAITERS_BYTE = LEASE_PREFIX_LENGTH + 1

// Ends a lease: stores the entry when one is given (complete), deletes the key otherwise
// (release). ARGV: lease prefix ('L' .. token), channel, [entry, expiration ms].
const END_LEASE_LUA = `
local head = redis.call('GETRANGE', KEYS[1], 0, ${PREFIX_END})
if string.sub(head, 1, ${PREFIX_END}) ~= ARGV[1] then
  return 0
end
if ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
else
  redis.call('DEL', KEYS[1])
end
if string.sub(head, ${WAITERS_BYTE}, ${WAITERS_BYTE}) == 'W' then
  redis.call('PUBLISH', ARGV[2], '1')
end
return 1
`

// ARGV: lease prefix, new lease end (epoch ms), lockTimeout ms. The waiters byte and the
// fingerprint are kept from the current value, so the lease still reports it to duplicates.
// A Redis full under noeviction refuses the SET (it may grow the value), but not PEXPIRE: the
// lease is then extended with the old lease end in its value (duplicates are told a Retry-After
// too early, which is harmless), rather than let lapse while its response waits to be stored.
const RENEW_LUA = `
local value = redis.call('GET', KEYS[1])
if not value or string.sub(value, 1, ${PREFIX_END}) ~= ARGV[1] then
  return 0
end
local bar = string.find(value, '|', ${WAITERS_BYTE + 1}, true)
local set = redis.pcall('SET', KEYS[1], string.sub(value, 1, ${WAITERS_BYTE}) .. ARGV[2] .. string.sub(value, bar), 'PX', ARGV[3])
if type(set) == 'table' and set.err then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
`

// No ARGV. A waiter marks the lease so that its end is published; 0 when there is no lease (any
// more): the waiter then has nothing to wait for. SETRANGE (which counts from 0) keeps the expiry.
const MARK_WAITING_LUA = `
if redis.call('GETRANGE', KEYS[1], 0, 0) ~= 'L' then
  return 0
end
redis.call('SETRANGE', KEYS[1], ${WAITERS_BYTE - 1}, 'W')
return 1
`

type ScriptArg = string | number | Buffer
type ScriptCall = (scriptOrSha: string, numberOfKeys: number, key: string, ...args: ScriptArg[]) => Promise<unknown>
interface ScriptingClient {
  evalsha: ScriptCall
  eval: ScriptCall
  defineCommand: unknown
}

/**
 * A script sent as `EVALSHA`, and as `EVAL` (which also loads it into the server) the first time
 * on each client and whenever the server answers NOSCRIPT: after a restart, a failover or a
 * SCRIPT FLUSH, or on a cluster node that has not seen it yet. Called directly rather than
 * through ioredis's `defineCommand`, whose wrapper adds an extra promise, a callback adapter and a
 * rejection hook to every call (8.2 against 10.6 µs of client CPU per call:
 * docs/benchmarks.md#measurements-behind-the-design).
 */
class Script {
  readonly #lua: string
  readonly #sha: string
  /** Clients this script was sent to as EVAL once already. */
  readonly #loaded = new WeakSet<object>()

  constructor (lua: string) {
    this.#lua = lua
    this.#sha = createHash('sha1').update(lua).digest('hex')
  }

  async run (client: ScriptingClient, key: string, ...args: ScriptArg[]): Promise<number> {
    if (this.#loaded.has(client)) {
      try {
        return Number(await client.evalsha(this.#sha, 1, key, ...args))
      } catch (error) {
        if (!(error instanceof Error) || !error.message.startsWith('NOSCRIPT')) throw error
      }
    }
    this.#loaded.add(client)
    return Number(await client.eval(this.#lua, 1, key, ...args))
  }
}

const END_LEASE = new Script(END_LEASE_LUA)
const RENEW = new Script(RENEW_LUA)
const MARK_WAITING = new Script(MARK_WAITING_LUA)

type SetNxGet = (key: string, value: string, px: 'PX', ttl: number, nx: 'NX', get: 'GET') => Promise<Buffer | null>
type Subscriber = (Redis | Cluster) & { on: (event: string, listener: (...args: unknown[]) => void) => unknown }

/** The fourth element is 1 when the body was omitted; both last ones are absent from entries of earlier versions. */
type Head = [statusCode: number, contentType: string | null, headers: StoredResponse['headers'], bodyOmitted?: 0 | 1, storedAt?: number]

const LEASE = 0x4c // 'L'
const ENTRY = 0x43 // 'C'
const BAR = 0x7c // '|'

// Escaped: `%` (the escape character itself), both braces (so the user's text can never end or
// open the hash tag) and lone UTF-16 surrogates (ioredis would encode each as U+FFFD, making two
// different keys one). In `u` mode the class skips well-formed surrogate pairs.
const NEEDS_ESCAPE = /[%{}\uD800-\uDFFF]/u
const ESCAPES = /[%{}\uD800-\uDFFF]/gu

function escapeChar (char: string): string {
  if (char === '%') return '%25'
  if (char === '{') return '%7B'
  if (char === '}') return '%7D'
  return '%u' + char.charCodeAt(0).toString(16).toUpperCase()
}

/** What the scripts compare a lease's first LEASE_PREFIX_LENGTH bytes with. */
function leasePrefix (token: string): string {
  return 'L' + token.slice(0, TOKEN_LENGTH)
}

function decodeBegin (value: Buffer | null, token: string, fingerprint: string): BeginResult {
  if (value === null) return { state: 'acquired', token: token + fingerprint }
  const bar = value.indexOf(BAR, 1)
  if (value[0] === LEASE && bar !== -1) {
    // This very SET, sent again: ioredis resends the commands a lost connection left unanswered,
    // and the first one had taken the lease.
    if (value.toString('latin1', 1, LEASE_PREFIX_LENGTH) === token) return { state: 'acquired', token: token + fingerprint }
    return {
      state: 'in-flight',
      fingerprint: value.toString('latin1', bar + 1),
      // After the token and the waiters byte.
      lockExpiresAt: Number(value.toString('latin1', LEASE_PREFIX_LENGTH + 1, bar))
    }
  }
  if (value[0] !== ENTRY || bar === -1) throw new UnreadableEntryError('RedisStorage: the value under this key is not in a layout this version knows (written by another version, or not by RedisStorage)')
  try {
    return decodeEntry(value, bar)
  } catch (error) {
    throw new UnreadableEntryError('RedisStorage: the entry under this key is damaged', { cause: error })
  }
}

/** An entry's value: what `begin` replays, and when it was stored (`null` for an entry of an earlier version). */
function decodeEntry (value: Buffer, bar: number): BeginCompleted & { storedAt: number | null } {
  const fingerprintEnd = bar + 1 + Number(value.toString('latin1', 1, bar))
  const headBar = value.indexOf(BAR, fingerprintEnd)
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

/** A value as `inspect` reports it; an entry's expiry is the key's remaining time to live (`ttl` ms). */
function decodeStored (value: Buffer, ttl: number): StoredState {
  const found = decodeBegin(value, '', '')
  if (found.state === 'in-flight') return { ...found, since: tokenIssuedAt(value.toString('latin1', 1, LEASE_PREFIX_LENGTH)) }
  const { fingerprint, response, storedAt } = found as ReturnType<typeof decodeEntry>
  return { state: 'completed', fingerprint, response, storedAt, expiresAt: Date.now() + ttl }
}

/**
 * The whole entry value, as END_LEASE_LUA stores it. A string when the body is valid UTF-8 (a
 * JSON body always is): it encodes back to the same bytes, and ioredis writes a command of
 * strings in one piece, where a Buffer argument costs it several copies
 * (docs/benchmarks.md#measurements-behind-the-design). Any other body goes as bytes.
 */
function encodeEntry (fingerprint: string, response: StoredResponse): string | Buffer {
  const head = JSON.stringify([response.statusCode, response.contentType, response.headers, response.bodyOmitted === true ? 1 : 0, Date.now()] satisfies Head)
  const text = `C${Buffer.byteLength(fingerprint)}|${fingerprint}${Buffer.byteLength(head)}|${head}`
  return isUtf8(response.body) ? text + response.body.toString('utf8') : Buffer.concat([Buffer.from(text), response.body])
}

/**
 * Idempotency storage on Redis or Redis Cluster through ioredis: one string per key, every
 * operation one command (`begin`) or one short script and one round trip, leases and entries
 * expired by Redis itself.
 */
export class RedisStorage implements IdempotencyStorage {
  readonly #client: ScriptingClient
  readonly #setNxGet: SetNxGet
  readonly #getBuffer: (key: string) => Promise<Buffer | null>
  readonly #open: string
  readonly #tokens = new TokenGenerator()
  /** What the operations (inspect, forget, listInFlight) see of this storage. */
  readonly #view: RedisView
  #subscriber: Promise<Subscriber> | null = null
  /** Requests waiting, per channel; the last one gone unsubscribes from it. */
  readonly #waiters = new KeyWaiters((channel) => {
    void this.#subscriber?.then((connection) => connection.unsubscribe(channel)).catch(() => {})
  })

  constructor (options: RedisStorageOptions) {
    const client = options?.client as unknown as ScriptingClient | undefined
    // `defineCommand` tells ioredis from other clients that also have `evalsha` and `eval`.
    if (client === undefined || client === null || typeof client.defineCommand !== 'function' || typeof client.evalsha !== 'function') {
      throw new TypeError('RedisStorage: `client` must be an ioredis Redis or Cluster instance')
    }
    const prefix = options.prefix ?? 'idempotency:'
    if (typeof prefix !== 'string') throw new TypeError('RedisStorage: `prefix` must be a string')
    // A brace in the prefix would become the hash tag of every key, putting them all in one slot.
    if (prefix.includes('{') || prefix.includes('}')) {
      throw new TypeError('RedisStorage: `prefix` must not contain `{` or `}`; the storage places its own hash tag')
    }
    this.#client = client
    this.#setNxGet = (client as unknown as { setBuffer: SetNxGet }).setBuffer.bind(client)
    this.#getBuffer = (client as unknown as { getBuffer: (key: string) => Promise<Buffer | null> }).getBuffer.bind(client)
    this.#open = prefix + '{'
    this.#view = { client: options.client, open: this.#open, redisKey: (key) => this.redisKey(key), channel: (redisKey) => this.#channel(redisKey), decode: decodeStored }
  }

  /**
   * The Redis key an idempotency key is stored under: the prefix, then the key (with `%`, `{`, `}`
   * and lone surrogates percent-escaped) as the hash tag. Useful to inspect or delete an entry.
   */
  redisKey (key: string): string {
    return this.#open + (NEEDS_ESCAPE.test(key) ? key.replace(ESCAPES, escapeChar) : key) + '}'
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    const ms = duration('RedisStorage', 'lockTimeout', lockTimeout)
    const token = this.#tokens.next()
    const lease = `L${token}-${Date.now() + ms}|${fingerprint}`
    const redisKey = this.redisKey(key)
    let value
    try {
      value = await this.#setNxGet(redisKey, lease, 'PX', ms, 'NX', 'GET')
    } catch (error) {
      if (!(error instanceof Error) || error.name !== 'ReplyError') {
        // Sent but unanswered (a command timeout, a connection lost for good): the SET may have
        // taken the lease. Give it back, fenced by this call's token, once Redis can be reached.
        this.release(key, token).catch(() => {})
        throw error
      }
      // A Redis full under noeviction refuses SET even for a key that exists; what is there can
      // still be read, so a replay or an in-flight answer does not fail with it.
      if (!error.message.startsWith('OOM')) throw error
      const existing = await this.#getBuffer(redisKey)
      if (existing === null) throw error
      value = existing
    }
    return decodeBegin(value, token, fingerprint)
  }

  /** The token is the lease's own token and the fingerprint the lease was taken with (see `begin`). */
  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    const redisKey = this.redisKey(key)
    const entry = encodeEntry(token.slice(TOKEN_LENGTH), response)
    return await END_LEASE.run(this.#client, redisKey, leasePrefix(token), this.#channel(redisKey), entry, duration('RedisStorage', 'expiration', expiration)) === 1
  }

  async release (key: string, token: string): Promise<boolean> {
    const redisKey = this.redisKey(key)
    return await END_LEASE.run(this.#client, redisKey, leasePrefix(token), this.#channel(redisKey)) === 1
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const ms = duration('RedisStorage', 'lockTimeout', lockTimeout)
    return await RENEW.run(this.#client, this.redisKey(key), leasePrefix(token), Date.now() + ms, ms) === 1
  }

  /**
   * Wait for the lease on `key` to end, woken by the PUBLISH of the script that ends it. One
   * subscriber connection per storage (a duplicate of the client, opened on the first wait),
   * one channel per key in wait, subscribed before the key is checked so no end is missed.
   */
  async waitFor (key: string, timeout: number): Promise<void> {
    const redisKey = this.redisKey(key)
    const channel = this.#channel(redisKey)
    const subscriber = this.#subscriber ??= this.#subscribe()
    const first = !this.#waiters.has(channel)
    const waiter = this.#waiters.add(channel, timeout)
    void this.#watch(subscriber, first, channel, redisKey, waiter)
    await waiter.promise
  }

  /** Subscribe (once per channel), then mark the lease; settles the waiter if there is none. */
  async #watch (subscriber: Promise<Subscriber>, first: boolean, channel: string, redisKey: string, waiter: Waiter): Promise<void> {
    try {
      if (first) await (await subscriber).subscribe(channel)
      // Subscribed: an end from now on is heard (the mark makes the holder publish it). One that
      // came before is seen here: there is no lease left to mark.
      if (await MARK_WAITING.run(this.#client, redisKey) === 0) waiter.settle()
    } catch (error) {
      waiter.settle(error)
    }
  }

  async inspect (key: string): Promise<StoredState> {
    return await inspectKey(this.#view, key)
  }

  /** Related keys are found with SCAN over the whole keyspace: it never blocks Redis, and takes as long as the keyspace is large. */
  async forget (key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
    return await forgetKey(this.#view, key, options)
  }

  /** A SCAN of the keys under the prefix, which stops after 1,000,000 keys (`complete: false`). */
  async listInFlight (options: { limit: number }): Promise<LeaseListing> {
    return await listLeases(this.#view, options.limit)
  }

  /** Ends the subscriber connection this storage opened; the client itself belongs to the caller. */
  async close (): Promise<void> {
    const subscriber = this.#subscriber
    this.#subscriber = null
    this.#waiters.wakeAll()
    if (subscriber !== null) (await subscriber.catch(() => null))?.disconnect()
  }

  #channel (redisKey: string): string {
    return `${redisKey}:ended`
  }

  async #subscribe (): Promise<Subscriber> {
    const connection = (this.#client as unknown as Redis).duplicate() as Subscriber
    connection.on('message', (channel: unknown) => { this.#waiters.wake(String(channel)) })
    // A broken subscriber fails the waits in progress (the plugin then polls) and is replaced on
    // the next wait; its errors must not go unhandled.
    connection.on('error', () => {})
    connection.on('end', () => {
      if (this.#subscriber === null) return
      this.#subscriber = null
      this.#waiters.wakeAll(new Error('RedisStorage: subscriber connection ended'))
    })
    return connection
  }
}
