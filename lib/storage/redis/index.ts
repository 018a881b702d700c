import type { Cluster, Redis } from 'ioredis'
import { duration } from '../durations.js'
import { TokenGenerator } from '../tokens.js'
import type { BeginResult, StorageForgetOptions, StorageForgetResult, IdempotencyStorage, LeaseListing, StoredResponse, StoredState } from '../types.js'
import { KeyWaiters, type Waiter } from '../waiters.js'
import { decodeValue, encodeEntry, encodeLease, fenceOf, joinLeaseToken, splitLeaseToken } from './codec.js'
import { channelOf, clientKeyPrefix, redisKeyOf } from './keys.js'
import { forgetKey, inspectKey, listLeases, type RedisView } from './operations.js'
import { RedisCommands } from './commands.js'
import { END_LEASE, MARK_WAITING, RENEW } from './scripts.js'

/** Options of `new RedisStorage()` (docs/stores/redis.md). */
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
 * The value layout is in codec.ts, the scripts in scripts.ts. `begin` is Redis's own
 * `SET key <lease> PX <lockTimeout> NX GET`: it takes the lease when the key is free and otherwise
 * returns what is there, in one native command and one round trip, with no script. A replay then
 * costs what a GET costs, plus the lease value sent along (a hash read by a Lua script cost Redis
 * two to three times as much per replay: bench/analysis.md#measurements-behind-the-design).
 * The key's PX expiry is the lease while in flight and the entry's lifetime once completed, so
 * Redis drops both on time. Complete, release and renew are one script each, fenced by the
 * lease's token; a request waiting for the key marks the lease, and only then do complete and
 * release PUBLISH on the key's channel, so a key nobody waits for costs no PUBLISH (which in Redis
 * Cluster goes to every node).
 */

type Subscriber = (Redis | Cluster) & { on: (event: string, listener: (...args: unknown[]) => void) => unknown }

/** What the scripts compare a lease's first bytes with. */
function fence (leaseToken: string): string {
  return fenceOf(splitLeaseToken(leaseToken).token)
}

/** What `begin` answers for the value the SET found (`null`: none, the lease is taken). */
function beginResult (value: Buffer | null, token: string, fingerprint: string): BeginResult {
  if (value === null) return { state: 'acquired', token: joinLeaseToken({ token, fingerprint }) }
  const found = decodeValue(value)
  if (found.state === 'completed') return found
  // This very SET, sent again: ioredis resends the commands a lost connection left unanswered,
  // and the first one had taken the lease.
  if (found.token === token) return { state: 'acquired', token: joinLeaseToken({ token, fingerprint }) }
  return { state: 'in-flight', fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt }
}

/**
 * Idempotency storage on Redis or Redis Cluster through ioredis: one string per key, every
 * operation one command (`begin`) or one short script and one round trip, leases and entries
 * expired by Redis itself.
 */
export class RedisStorage implements IdempotencyStorage {
  /** How the commands on a request's path are sent (commands.ts); it holds the client. */
  readonly #commands: RedisCommands
  readonly #open: string
  /** The client's own keyPrefix, in front of the names a script publishes on (keys.ts). */
  readonly #keyPrefix: string
  readonly #tokens = new TokenGenerator()
  /** What the operations (inspect, forget, listInFlight) see of this storage. */
  readonly #view: RedisView
  #subscriber: Promise<Subscriber> | null = null
  /** Whether the storage listens for the client's end, to close the subscriber with it. */
  #followsClient = false
  /** Requests waiting, per channel; the last one gone unsubscribes from it. */
  readonly #waiters = new KeyWaiters((channel) => {
    void this.#subscriber?.then((connection) => connection.unsubscribe(channel)).catch(() => {})
  })

  constructor (options: RedisStorageOptions) {
    const client = options?.client as unknown as { defineCommand?: unknown, evalsha?: unknown } | undefined
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
    const keyPrefix = clientKeyPrefix(options.client)
    // On a Cluster, braces in the client's keyPrefix would make its hash tag every key's: one slot.
    if ((options.client as { isCluster?: boolean }).isCluster === true && (keyPrefix.includes('{') || keyPrefix.includes('}'))) {
      throw new TypeError(`RedisStorage: the Cluster client's \`keyPrefix\` (${JSON.stringify(keyPrefix)}) must not contain \`{\` or \`}\`: its hash tag would put every idempotency key in one slot, on one node. Give the storage a client without it (the storage's own \`prefix\` keeps apps apart)`)
    }
    this.#commands = new RedisCommands(options.client)
    this.#open = prefix + '{'
    this.#keyPrefix = keyPrefix
    this.#view = { client: options.client, open: this.#open, keyPrefix }
  }

  /**
   * The Redis key an idempotency key is stored under: the prefix, then the key (with `%`, `{`, `}`
   * and lone surrogates percent-escaped) as the hash tag. Useful to inspect or delete an entry.
   */
  redisKey (key: string): string {
    return redisKeyOf(this.#open, key)
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    const ms = duration('RedisStorage', 'lockTimeout', lockTimeout)
    const token = this.#tokens.next()
    const lease = encodeLease(token, Date.now() + ms, fingerprint)
    const redisKey = this.redisKey(key)
    let value
    try {
      value = await this.#commands.send('set', [redisKey, lease, 'PX', ms, 'NX', 'GET']) as Buffer | null
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
      const existing = await this.#commands.send('get', [redisKey]) as Buffer | null
      if (existing === null) throw error
      value = existing
    }
    return beginResult(value, token, fingerprint)
  }

  /** The token is a LeaseToken (codec.ts): the lease's own token and the fingerprint the lease was taken with. */
  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    const lease = splitLeaseToken(token)
    const entry = encodeEntry(lease.fingerprint, response, Date.now())
    return await END_LEASE.run(this.#commands, this.redisKey(key), fenceOf(lease.token), entry, duration('RedisStorage', 'expiration', expiration)) === 1
  }

  async release (key: string, token: string): Promise<boolean> {
    return await END_LEASE.run(this.#commands, this.redisKey(key), fence(token)) === 1
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const ms = duration('RedisStorage', 'lockTimeout', lockTimeout)
    return await RENEW.run(this.#commands, this.redisKey(key), fence(token), Date.now() + ms, ms) === 1
  }

  /**
   * Wait for the lease on `key` to end, woken by the PUBLISH of the script that ends it. One
   * subscriber connection per storage (a duplicate of the client, opened on the first wait),
   * one channel per key in wait, subscribed before the key is checked so no end is missed.
   */
  async waitFor (key: string, timeout: number): Promise<void> {
    const redisKey = this.redisKey(key)
    const channel = this.#keyPrefix + channelOf(redisKey)
    let subscriber = this.#subscriber
    if (subscriber === null) {
      const opening = subscriber = this.#subscriber = this.#subscribe()
      // One that could not be opened is not kept: the next wait tries again.
      opening.catch(() => { if (this.#subscriber === opening) this.#subscriber = null })
    }
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
      if (await MARK_WAITING.run(this.#commands, redisKey) === 0) waiter.settle()
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

  /**
   * The subscriber connection, a duplicate of the client, lives as long as the client: when the
   * client ends (its owner quits it, as @fastify/redis does when the app closes), so does the
   * subscriber, so that it never holds a process open that its owner has closed. Nothing else in
   * an app knows that this connection exists.
   */
  async #subscribe (): Promise<Subscriber> {
    const client = this.#commands.client as Redis
    if (client.status === 'end') throw new Error('RedisStorage: the client has been closed')
    if (!this.#followsClient) {
      this.#followsClient = true
      client.once('end', () => {
        this.#followsClient = false
        void this.close()
      })
    }
    const connection = client.duplicate() as Subscriber
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
