import { LRUCache } from 'lru-cache'
import { duration } from './durations.js'
import { TokenGenerator, tokenIssuedAt } from './tokens.js'
import { SYNCHRONOUS_STEPS, type BeginResult, type StorageForgetOptions, type StorageForgetResult, type HeldLease, type IdempotencyStorage, type LeaseListing, type StoredResponse, type StoredState, type SynchronousSteps } from './types.js'
import { KeyWaiters } from './waiters.js'

/** Options of `new MemoryStorage()`: its bounds (docs/stores/memory.md). */
export interface MemoryStorageOptions {
  /** Most stored responses kept; the least recently used goes first. Default 100 000. */
  maxEntries?: number
  /** Most bytes of stored responses kept (bodies, headers, keys). Default 64 MiB. */
  maxBytes?: number
  /** Clock in epoch milliseconds; tests inject one. Default `Date.now`. */
  now?: () => number
}

interface Lease {
  token: string
  fingerprint: string
  expiresAt: number
}

interface Entry {
  fingerprint: string
  /** The stored response; its body is empty while the body is kept as `text`. */
  response: StoredResponse
  /**
   * The body as a string until the entry is first read (`responseOf`), which makes its bytes: the
   * string the handler sent (SynchronousSteps' `text`, `binary` false), or a body given as bytes
   * kept one character per byte (`binary` true). A first request makes no Buffer, and an entry
   * holds no memory outside V8's heap, which the collector tracks one ArrayBuffer at a time.
   * `null` once made.
   */
  text: string | null
  binary: boolean
  storedAt: number
  expiresAt: number
}

/** The body of a stored response whose bytes are not made yet (responseOf makes them). */
const EMPTY_BODY = Buffer.alloc(0)

/** Rough per-entry bookkeeping cost, so thousands of empty bodies still count against `maxBytes`. */
const ENTRY_OVERHEAD_BYTES = 256
/**
 * Expired entries go three ways: a read drops the one it finds; every 16th write drops up to 32
 * expired entries from the least recently used end (where old entries gather; batched, because
 * each look costs an iterator, and only once the entry the last look stopped at may have
 * expired); and a full sweep catches the rest once the writes since the last one reach 16 times
 * the entries held (at least 65 536), so a sweep, which walks every entry, costs at most one step
 * per 16 writes however large the store.
 */
const SWEEP_MIN_WRITES = 65_536
const SWEEP_WRITES_PER_ENTRY = 16
const OLDEST_CHECK_EVERY_WRITES = 16
const OLDEST_CHECKED = 32

/**
 * An entry's response, its body made from its text when it is first read: exactly its size, in
 * memory of its own (a slice of Node's pool would keep the pool's slab alive), and kept.
 */
function responseOf (entry: Entry): StoredResponse {
  const { text } = entry
  if (text !== null) {
    const encoding = entry.binary ? 'latin1' : 'utf8'
    const body = Buffer.allocUnsafeSlow(entry.binary ? text.length : Buffer.byteLength(text))
    body.write(text, encoding)
    entry.response.body = body
    entry.text = null
  }
  return entry.response
}

function entrySize (key: string, entry: Entry): number {
  // A body kept as text counts its length in UTF-16 units: its bytes for ASCII and for a binary
  // one, fewer otherwise.
  let size = ENTRY_OVERHEAD_BYTES + key.length + entry.fingerprint.length + (entry.text === null ? entry.response.body.length : entry.text.length)
  for (const name in entry.response.headers) {
    const value = entry.response.headers[name]!
    size += name.length + (Array.isArray(value) ? value.join('').length : value.length)
  }
  return size
}

/**
 * The embedded default store: one process, bounded, no timers.
 *
 * Leases live apart from stored responses: a response may be evicted under memory pressure (the
 * next request then simply runs again), but evicting a lease would let two requests run at once.
 * Leases are bounded by the number of requests in flight, and each one ends with its request.
 */
export class MemoryStorage implements IdempotencyStorage {
  readonly #leases = new Map<string, Lease>()
  readonly #entries: LRUCache<string, Entry>
  readonly #now: () => number
  /** Requests waiting for a key's lease to end (see `waitFor`). */
  readonly #waiters = new KeyWaiters()
  readonly #tokens = new TokenGenerator()
  /** Stored responses since the last full sweep; every 16th also looks at the oldest entries. */
  #writesSinceSweep = 0
  /**
   * When the oldest entries are next worth a look: the expiry of the first one the last look found
   * unexpired (where that look stopped), or of any entry stored since, whichever is sooner.
   * Until then a look would stop at once, and its iterator is not made.
   */
  #oldestLookAt = 0

  /**
   * The store's name in events, logs and errors, whatever a bundler calls the class; a subclass
   * goes by its own class's name.
   */
  get [Symbol.toStringTag] (): string {
    return this.constructor === MemoryStorage ? 'MemoryStorage' : this.constructor.name
  }

  constructor (options: MemoryStorageOptions = {}) {
    const maxEntries = options.maxEntries ?? 100_000
    const maxBytes = options.maxBytes ?? 64 * 1024 * 1024
    if (!Number.isInteger(maxEntries) || maxEntries < 1) throw new TypeError('MemoryStorage: maxEntries must be a positive integer')
    if (!Number.isInteger(maxBytes) || maxBytes < 1) throw new TypeError('MemoryStorage: maxBytes must be a positive integer')
    this.#now = options.now ?? Date.now
    this.#entries = new LRUCache<string, Entry>({
      max: maxEntries,
      maxSize: maxBytes,
      sizeCalculation: (entry, key) => entrySize(key, entry)
      // No lru-cache TTL: entries carry their own expiry, checked against `now` here, which keeps
      // lru-cache's per-entry TTL bookkeeping off the hot path and every entry visible to sweeps.
    })
  }

  /** Stored responses currently held (expired ones may linger until swept or touched). */
  get size (): number {
    return this.#entries.size
  }

  /** Bytes currently counted against `maxBytes`. */
  get calculatedSize (): number {
    return this.#entries.calculatedSize
  }

  /** Leases currently held. */
  get leases (): number {
    return this.#leases.size
  }

  /** The request path's steps, answered at once (the engine's own use; see SynchronousSteps). */
  readonly [SYNCHRONOUS_STEPS]: SynchronousSteps = {
    begin: (key, fingerprint, lockTimeout) => this.#begin(key, fingerprint, lockTimeout),
    complete: (key, token, response, expiration, text) => this.#complete(key, token, response, expiration, text),
    release: (key, token) => this.#release(key, token),
    of: MemoryStorage.prototype
  }

  async begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult> {
    return this.#begin(key, fingerprint, lockTimeout)
  }

  async complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean> {
    return this.#complete(key, token, response, expiration, undefined)
  }

  async release (key: string, token: string): Promise<boolean> {
    return this.#release(key, token)
  }

  #begin (key: string, fingerprint: string, lockTimeout: number): BeginResult {
    const length = duration('MemoryStorage', 'lockTimeout', lockTimeout)
    const now = this.#now()
    const entry = this.#entries.get(key)
    if (entry !== undefined) {
      if (entry.expiresAt > now) return { state: 'completed', fingerprint: entry.fingerprint, response: responseOf(entry) }
      this.#entries.delete(key)
    }
    const lease = this.#leases.get(key)
    if (lease !== undefined && lease.expiresAt > now) {
      return { state: 'in-flight', fingerprint: lease.fingerprint, lockExpiresAt: lease.expiresAt }
    }
    const token = this.#tokens.next(now)
    this.#leases.set(key, { token, fingerprint, expiresAt: now + length })
    return { state: 'acquired', token }
  }

  #complete (key: string, token: string, response: StoredResponse, expiration: number, text: string | undefined): boolean {
    const ttl = duration('MemoryStorage', 'expiration', expiration)
    const now = this.#now()
    const lease = this.#heldLease(key, token, now)
    if (lease === undefined) return false
    this.#leases.delete(key)
    // A body given as bytes is copied (the caller may change its Buffer afterwards, and a small one
    // is usually a slice of Node's shared 8 KiB pool, whose whole slab the slice would keep alive,
    // unseen by `maxBytes`), into a string of one character per byte, on V8's heap: a sealed
    // envelope, say. A body given as text is kept as the string.
    const binary = text === undefined
    const kept = binary ? response.body.toString('latin1') : text
    // Built field by field: a spread of the caller's object costs more, on every first request.
    const stored: StoredResponse = { statusCode: response.statusCode, contentType: response.contentType, headers: response.headers, body: EMPTY_BODY }
    if (response.bodyOmitted !== undefined) stored.bodyOmitted = response.bodyOmitted
    const expiresAt = now + ttl
    this.#entries.set(key, { fingerprint: lease.fingerprint, response: stored, text: kept, binary, storedAt: now, expiresAt })
    if (expiresAt < this.#oldestLookAt) this.#oldestLookAt = expiresAt
    this.#notify(key)
    if (++this.#writesSinceSweep >= Math.max(SWEEP_MIN_WRITES, SWEEP_WRITES_PER_ENTRY * this.#entries.size)) this.#sweep()
    else if (this.#writesSinceSweep % OLDEST_CHECK_EVERY_WRITES === 0) this.#dropOldestExpired(now)
    return true
  }

  #release (key: string, token: string): boolean {
    if (this.#heldLease(key, token) === undefined) return false
    this.#leases.delete(key)
    this.#notify(key)
    return true
  }

  async renew (key: string, token: string, lockTimeout: number): Promise<boolean> {
    const ms = duration('MemoryStorage', 'lockTimeout', lockTimeout)
    const lease = this.#heldLease(key, token)
    if (lease === undefined) return false
    lease.expiresAt = this.#now() + ms
    return true
  }

  async waitFor (key: string, timeout: number): Promise<void> {
    const lease = this.#leases.get(key)
    if (lease === undefined) return
    const wait = Math.min(timeout, lease.expiresAt - this.#now())
    if (wait <= 0) return
    await this.#waiters.add(key, wait).promise
  }

  async inspect (key: string): Promise<StoredState> {
    const now = this.#now()
    // `peek`: looking does not make an entry recently used.
    const entry = this.#entries.peek(key)
    if (entry !== undefined && entry.expiresAt > now) {
      return { state: 'completed', fingerprint: entry.fingerprint, response: responseOf(entry), storedAt: entry.storedAt, expiresAt: entry.expiresAt }
    }
    const lease = this.#leases.get(key)
    if (lease !== undefined && lease.expiresAt > now) {
      return { state: 'in-flight', fingerprint: lease.fingerprint, lockExpiresAt: lease.expiresAt, since: tokenIssuedAt(lease.token) }
    }
    return { state: 'absent' }
  }

  async forget (key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
    const found = await this.inspect(key)
    if (found.state === 'in-flight' && !options.force) return { outcome: 'refused', lockExpiresAt: found.lockExpiresAt }
    this.#remove(key)
    let related = 0
    const prefix = options.relatedPrefix
    // Every key is looked at: forgetting is rare, and the keys of one request are not kept together.
    for (const candidate of new Set([...this.#entries.keys(), ...this.#leases.keys()])) {
      if (candidate.startsWith(prefix) && this.#remove(candidate)) related++
    }
    return { outcome: 'forgotten', previous: found.state, related }
  }

  async listInFlight (options: { limit: number }): Promise<LeaseListing> {
    const now = this.#now()
    const leases: HeldLease[] = []
    for (const [key, lease] of this.#leases) {
      if (lease.expiresAt <= now) continue
      if (leases.length === options.limit) return { leases, complete: false }
      leases.push({ key, fingerprint: lease.fingerprint, lockExpiresAt: lease.expiresAt, since: tokenIssuedAt(lease.token) })
    }
    return { leases, complete: true }
  }

  async close (): Promise<void> {
    this.#waiters.wakeAll()
    this.#leases.clear()
    this.#entries.clear()
  }

  #notify (key: string): void {
    this.#waiters.wake(key)
  }

  /** Drop the entry and the lease under `key`; whether there was either. A request waiting for the lease is woken. */
  #remove (key: string): boolean {
    const entry = this.#entries.delete(key)
    const lease = this.#leases.delete(key)
    if (lease) this.#notify(key)
    return entry || lease
  }

  #heldLease (key: string, token: string, now = this.#now()): Lease | undefined {
    const lease = this.#leases.get(key)
    if (lease === undefined || lease.token !== token || lease.expiresAt <= now) return undefined
    return lease
  }

  #dropOldestExpired (now: number): void {
    if (now < this.#oldestLookAt) return
    let expired: string[] | null = null
    let checked = 0
    this.#oldestLookAt = Number.POSITIVE_INFINITY
    for (const [key, entry] of this.#entries.rentries() as Generator<[string, Entry]>) {
      if (++checked > OLDEST_CHECKED) {
        this.#oldestLookAt = now
        break
      }
      if (entry.expiresAt > now) {
        this.#oldestLookAt = entry.expiresAt
        break
      }
      ;(expired ??= []).push(key)
    }
    if (expired !== null) for (const key of expired) this.#entries.delete(key)
  }

  #sweep (): void {
    this.#writesSinceSweep = 0
    const now = this.#now()
    const expired: string[] = []
    for (const [key, entry] of this.#entries.entries() as Generator<[string, Entry]>) if (entry.expiresAt <= now) expired.push(key)
    for (const key of expired) this.#entries.delete(key)
    for (const [key, lease] of this.#leases) {
      if (lease.expiresAt <= now) this.#leases.delete(key)
    }
  }
}
