import type { Cluster, Redis } from 'ioredis'
import { duration } from '../durations.js'
import { TokenGenerator } from '../tokens.js'
import { readyWhenProven } from '../proof.js'
import type { BeginResult, StorageForgetOptions, StorageForgetResult, IdempotencyStorage, LeaseListing, StoreCheck, StoreProofOptions, StoredResponse, StoredState } from '../types.js'
import { KeyWaiters, type Waiter } from '../waiters.js'
import { decodeValue, encodeEntry, encodeLease, fenceOf, joinLeaseToken, splitLeaseToken } from './codec.js'
import { driverFor, type RedisDriver, type Subscription } from './driver.js'
import type { GlideLikeClient } from './glide.js'
import { channelOf, redisKeyOf } from './keys.js'
import type { NodeRedisClient, NodeRedisCluster } from './node-redis.js'
import { forgetKey, inspectKey, listLeases, type RedisView } from './operations.js'
import { proveRedis } from './proof.js'
import { END_LEASE, MARK_WAITING, RENEW } from './scripts.js'

/**
 * A client RedisStorage works with: an ioredis 5 or 6 (or iovalkey) `Redis` or `Cluster`
 * (`fastify.redis` from @fastify/redis too), a node-redis 5 or 6 client or cluster
 * (`createClient`, `createCluster`), or a Valkey GLIDE 2 `GlideClient` or `GlideClusterClient`.
 */
export type RedisStorageClient = Redis | Cluster | NodeRedisClient | NodeRedisCluster | GlideLikeClient

/** Options of `new RedisStorage()` (docs/stores/redis.md). */
export interface RedisStorageOptions {
  /**
   * The client (see RedisStorageClient), connected or connecting. The storage never closes it:
   * whoever created the client closes it.
   */
  client: RedisStorageClient
  /** Prepended to every Redis key. No `{` or `}` (see `redisKey`). Default `'idempotency:'`. */
  prefix?: string
  /**
   * Start on a Redis that may evict keys (a `maxmemory-policy` other than `noeviction`, with
   * `maxmemory` set): the start-up check then warns instead of failing. Under memory pressure such
   * a Redis may evict a lease, and a duplicate then runs while the first request still runs.
   * Default `false`.
   */
  allowEviction?: boolean
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

/**
 * For a promise nobody waits for, whose failure changes nothing (a fenced release, a subscriber's
 * close): handled, so that it never rejects unhandled, which would end the process.
 */
const ignore = (): void => {}

/** What the scripts compare a lease's first bytes with. */
function fence (leaseToken: string): string {
  return fenceOf(splitLeaseToken(leaseToken).token)
}

/** What `begin` answers for the value the SET found (`null`: none, the lease is taken). */
function beginResult (value: Buffer | null, token: string, fingerprint: string): BeginResult {
  if (value === null) return { state: 'acquired', token: joinLeaseToken({ token, fingerprint }) }
  const found = decodeValue(value)
  if (found.state === 'completed') return found
  // This very SET, sent again: a client (ioredis) may resend the commands a lost connection left
  // unanswered, and the first one had taken the lease.
  if (found.token === token) return { state: 'acquired', token: joinLeaseToken({ token, fingerprint }) }
  return { state: 'in-flight', fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt }
}

/**
 * Idempotency storage on Redis, Valkey or a cluster of either, through ioredis, iovalkey,
 * node-redis or Valkey GLIDE (driver.ts): one string per key, every operation one command
 * (`begin`) or one short script and one round trip, leases and entries expired by Redis itself.
 */
export class RedisStorage implements IdempotencyStorage {
  /** The client, through the driver of its family (driver.ts). */
  readonly #driver: RedisDriver
  readonly #open: string
  readonly #tokens = new TokenGenerator()
  /** What the operations (inspect, forget, listInFlight) see of this storage. */
  readonly #view: RedisView
  #subscription: Promise<Subscription> | null = null
  /** Whether the storage listens for the client's end, to close the subscriber with it. */
  #followsClient = false
  /** The channels subscribed to (a request waits on each), each with its subscription's confirmation. */
  readonly #channels = new Map<string, Promise<void>>()
  /** Requests waiting, per channel; the last one gone unsubscribes from it. */
  readonly #waiters = new KeyWaiters((channel) => { this.#idle(channel) })
  readonly #prefix: string
  readonly #allowEviction: boolean
  /**
   * Why waits poll instead of being woken: the client's Redis user may not PUBLISH or SUBSCRIBE
   * (found by the start-up proof, or by a script whose PUBLISH was refused). `null` while they work.
   */
  #cannotSignal: Error | null = null

  /**
   * The store's name in events, logs and errors, whatever a bundler calls the class; a subclass
   * goes by its own class's name.
   */
  get [Symbol.toStringTag] (): string {
    return this.constructor === RedisStorage ? 'RedisStorage' : this.constructor.name
  }

  constructor (options: RedisStorageOptions) {
    const driver = driverFor(options?.client)
    if (driver === null) {
      throw new TypeError('RedisStorage: `client` must be a client of ioredis (Redis or Cluster, @fastify/redis\'s too), iovalkey, node-redis (createClient or createCluster) or Valkey GLIDE (GlideClient or GlideClusterClient)')
    }
    const prefix = options.prefix ?? 'idempotency:'
    if (typeof prefix !== 'string') throw new TypeError('RedisStorage: `prefix` must be a string')
    // A brace in the prefix would become the hash tag of every key, putting them all in one slot.
    if (prefix.includes('{') || prefix.includes('}')) {
      throw new TypeError('RedisStorage: `prefix` must not contain `{` or `}`; the storage places its own hash tag')
    }
    const { keyPrefix } = driver
    // On a cluster, braces in the client's keyPrefix would make its hash tag every key's: one slot.
    if (driver.cluster && (keyPrefix.includes('{') || keyPrefix.includes('}'))) {
      throw new TypeError(`RedisStorage: the ${driver.family} client's \`keyPrefix\` (${JSON.stringify(keyPrefix)}) must not contain \`{\` or \`}\`: its hash tag would put every idempotency key in one slot, on one node. Give the storage a client without it (the storage's own \`prefix\` keeps apps apart)`)
    }
    if (options.allowEviction !== undefined && typeof options.allowEviction !== 'boolean') throw new TypeError('RedisStorage: `allowEviction` must be a boolean')
    this.#allowEviction = options.allowEviction === true
    this.#driver = driver
    this.#prefix = prefix
    this.#open = prefix + '{'
    this.#view = { driver, open: this.#open }
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
      value = await this.#driver.call('set', redisKey, [lease, 'PX', String(ms), 'NX', 'GET']) as Buffer | null
    } catch (error) {
      const code = this.#driver.replyCode(error)
      if (code === null) {
        // Sent but unanswered (a command timeout, a connection lost for good): the SET may have
        // taken the lease. Give it back, fenced by this call's token, once Redis can be reached.
        this.release(key, token).catch(ignore)
        throw error
      }
      // A Redis full under noeviction refuses SET even for a key that exists; what is there can
      // still be read, so a replay or an in-flight answer does not fail with it.
      if (code !== 'OOM') throw error
      const existing = await this.#driver.call('get', redisKey, []) as Buffer | null
      if (existing === null) throw error
      value = existing
    }
    return beginResult(value, token, fingerprint)
  }

  /** The token is a LeaseToken (codec.ts): the lease's own token and the fingerprint the lease was taken with. */
  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    const lease = splitLeaseToken(token)
    const entry = encodeEntry(lease.fingerprint, response, Date.now())
    const redisKey = this.redisKey(key)
    return this.#ended(redisKey, await this.#driver.script(END_LEASE, redisKey, [fenceOf(lease.token), entry, String(duration('RedisStorage', 'expiration', expiration))]))
  }

  async release (key: string, token: string): Promise<boolean> {
    const redisKey = this.redisKey(key)
    return this.#ended(redisKey, await this.#driver.script(END_LEASE, redisKey, [fence(token)]))
  }

  /**
   * What END_LEASE answered: 2 says the lease ended and its PUBLISH was refused (an ACL changed
   * since the start-up proof): the end is kept, the waiters of this process are woken here, and
   * waits poll from now on, said once.
   */
  #ended (redisKey: string, answer: unknown): boolean {
    const ended = Number(answer)
    if (ended !== 2) return ended === 1
    this.#waiters.wake(this.#driver.keyPrefix + channelOf(redisKey))
    if (this.#cannotSignal === null) {
      this.#cannotSignal = new Error('RedisStorage: the client\'s Redis user may not PUBLISH: waits poll the store')
      process.emitWarning('The client\'s Redis user may not PUBLISH (refused to the script that ended a lease): the lease ended and its response is kept, ' +
        'but requests waiting for it in other processes are not woken until they ask again, and waits in this process poll the store from now on. ' +
        'Allow PUBLISH and SUBSCRIBE on the storage\'s channels to have them woken at once.', { type: 'FastifyIdempotencyWarning', code: 'FASTIFY_IDEMPOTENCY_NO_PUBLISH' })
    }
    return true
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const ms = duration('RedisStorage', 'lockTimeout', lockTimeout)
    return Number(await this.#driver.script(RENEW, this.redisKey(key), [fence(token), String(Date.now() + ms), String(ms)])) === 1
  }

  /**
   * The start-up proof (proof.ts): every command, script and form a request sends, tried with the
   * client's own user on a probe key of its own, and the server's eviction policy and persistence.
   * With wait mode, PUBLISH and SUBSCRIBE too: refused, waits poll the store instead (a warning).
   */
  async prove (options: StoreProofOptions): Promise<StoreCheck[]> {
    const { checks, signals } = await proveRedis({ driver: this.#driver, prefix: this.#prefix, tokens: this.#tokens, allowEviction: this.#allowEviction }, options)
    if (signals !== undefined) this.#cannotSignal = signals ? null : new Error('RedisStorage: the client\'s Redis user may not PUBLISH or SUBSCRIBE: waits poll the store')
    return checks
  }

  /** The start-up proof, failing with one line that says why (and how to cure it) when a check failed. */
  async ready (options: Partial<StoreProofOptions> = {}): Promise<void> {
    await readyWhenProven('RedisStorage', (proof) => this.prove(proof), options)
  }

  /**
   * Wait for the lease on `key` to end, woken by the PUBLISH of the script that ends it. One
   * subscriber connection per storage (opened on the first wait), one channel per key in wait,
   * subscribed before the key is checked so no end is missed.
   */
  async waitFor (key: string, timeout: number): Promise<void> {
    // The plugin polls instead.
    if (this.#cannotSignal !== null) throw this.#cannotSignal
    const redisKey = this.redisKey(key)
    // The scripts publish on the key's name as Redis has it, the client's keyPrefix included.
    const channel = this.#driver.keyPrefix + channelOf(redisKey)
    let subscription = this.#subscription
    if (subscription === null) {
      const opening = subscription = this.#subscription = this.#subscribe()
      // One that could not be opened is not kept: the next wait tries again.
      opening.catch(() => { if (this.#subscription === opening) this.#subscription = null })
    }
    const waiter = this.#waiters.add(channel, timeout)
    // Every waiter of a channel waits for the one subscription to it before it marks the lease:
    // a mark made before the subscription is confirmed could make the holder publish unheard.
    let subscribed = this.#channels.get(channel)
    if (subscribed === undefined) {
      subscribed = subscription.then((connection) => connection.subscribe(channel))
      this.#channels.set(channel, subscribed)
    }
    void this.#watch(subscribed, redisKey, waiter)
    await waiter.promise
  }

  /** Once subscribed, mark the lease; settles the waiter if there is none. */
  async #watch (subscribed: Promise<void>, redisKey: string, waiter: Waiter): Promise<void> {
    try {
      await subscribed
      // Subscribed: an end from now on is heard (the mark makes the holder publish it). One that
      // came before is seen here: there is no lease left to mark.
      if (Number(await this.#driver.script(MARK_WAITING, redisKey, [])) === 0) waiter.settle()
    } catch (error) {
      waiter.settle(error)
    }
  }

  /** Nobody waits on `channel` any more: unsubscribe, and close a subscriber nobody needs. */
  #idle (channel: string): void {
    this.#channels.delete(channel)
    const subscription = this.#subscription
    if (subscription === null) return
    if (this.#channels.size === 0 && !this.#followsClient) {
      // A client that never says when it is closed (GLIDE, a node-redis cluster): the
      // subscriber must not hold the process open, so it lasts only while someone waits.
      this.#subscription = null
      // node-redis 5 throws from closing a connection that closed meanwhile.
      subscription.then((connection) => { connection.close() }).catch(ignore)
      return
    }
    subscription.then((connection) => connection.unsubscribe(channel)).catch(ignore)
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
    const subscription = this.#subscription
    this.#subscription = null
    this.#channels.clear()
    this.#waiters.wakeAll()
    if (subscription !== null) (await subscription.catch(() => null))?.close()
  }

  /**
   * The subscriber connection lives as long as the client: when the client ends (its owner quits
   * it, as @fastify/redis does when the app closes), so does the subscriber, so that it never holds
   * a process open that its owner has closed. Nothing else in an app knows that it exists. A client
   * that never says when it ends gets a subscriber only while someone waits (`#idle`).
   */
  async #subscribe (): Promise<Subscription> {
    const driver = this.#driver
    if (driver.ended) throw new Error('RedisStorage: the client has been closed')
    if (!this.#followsClient) {
      this.#followsClient = driver.onClientEnd(() => {
        this.#followsClient = false
        this.close().catch(ignore)
      })
    }
    return await driver.subscribe({
      message: (channel) => { this.#waiters.wake(channel) },
      // A broken subscriber fails the waits in progress (the plugin then polls), and the next
      // wait opens a new one.
      lost: (error) => {
        if (this.#subscription === null) return
        this.#subscription = null
        this.#channels.clear()
        this.#waiters.wakeAll(error)
      }
    })
  }
}
