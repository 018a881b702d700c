/**
 * Operations on stored keys, for the people who run the service (docs/operations.md): what is
 * held under a key, forgetting it so that it runs afresh, and the keys in flight now. The same
 * code serves `fastify.idempotency` and the `fastify-idempotency` command.
 *
 * An operator types what the client sent: the key (bare or quoted, checked as the header is) and
 * the scope the app's `scope` returns; both become the storage key exactly as a request's do
 * (engine/storage-key.ts, with the keyed hash when encryption is on).
 */
import type { IdempotencyOperation, IdempotencyOperationEvent } from '../diagnostics.js'
import { UnreadableEntryError } from '../storage/unreadable-entry.js'
import { isStepRecordKey, stepRecordPrefix } from '../engine/steps.js'
import { NO_CALLER_SCOPE, storageKey, storageKeyParts } from '../engine/storage-key.js'
import type { FingerprintOptions } from '../fingerprint/fingerprint.js'
import { readIdempotencyKey } from '../http/key.js'
import { toMilliseconds, type PluginSettings } from '../options.js'
import { storeNameOf, type IdempotencyStorage, type StoredCompleted } from '../storage/types.js'
import { Audit, type AuditLog, type Outcome } from './audit.js'
import { fingerprintOptionsOf } from './fingerprint-options.js'
import { shareIdentity } from '../storage/error-identity.js'

/** The scope of the requests a scoped route got without a caller, for the command (engine/storage-key.ts). */
export { NO_CALLER_SCOPE }

/** What every operation may be told. */
export interface OperationOptions {
  /** Who asks, for the audit (a support agent's name, a ticket): in the log line and the diagnostics event. */
  actor?: string
}

/** What an operation on one key is told. */
export interface KeyOptions extends OperationOptions {
  /**
   * The scope, as the app's `scope(request)` returns it for the client; omit it when the app has
   * none. `''` (NO_CALLER_SCOPE) is the requests a scoped route got without a caller (its scope
   * returned `undefined` or `null`).
   */
  scope?: string | null
}

/** The key and scope an operation was given. */
export interface KeyRef {
  /** The client's key, unquoted. */
  key: string
  /** The scope given, or `null`. */
  scope: string | null
}

/** What the fingerprint says: the string as stored, and the option set it was computed with where it tells (`null` otherwise). */
export interface FingerprintInfo {
  /** The fingerprint as stored. */
  fingerprint: string
  /**
   * The fingerprint options it was computed with, where the fingerprint tells them; `null`
   * otherwise.
   */
  fingerprintOptions: FingerprintOptions | null
}

/** What `inspect` found under a key: nothing, a request in flight, or a stored response. */
export type Inspection = (KeyRef & {
  /** Nothing live under the key: never used, expired, or forgotten. */
  state: 'absent'
}) | InFlightInspection | StoredInspection

/** A request holds the key's lease now. */
export interface InFlightInspection extends KeyRef, FingerprintInfo {
  /** Discriminant. */
  state: 'in-flight'
  /** When the lease was taken, epoch ms; `null` when the store does not know. */
  since: number | null
  /** When the lease lapses unless its holder renews it, epoch ms. */
  lockExpiresAt: number
}

/** A stored response, replayed to a retry until `expiresAt`. */
export interface StoredInspection extends KeyRef, FingerprintInfo {
  /** Discriminant. */
  state: 'stored'
  /** The stored response's status code. */
  statusCode: number
  /** When it was stored, epoch ms; `null` when the store does not know (an entry of an earlier version). */
  storedAt: number | null
  /** When it expires, epoch ms. */
  expiresAt: number
  /** The following are `null` when a sealed entry cannot be opened (see `unreadable`). */
  contentType: string | null
  /** The stored response's replayed headers. */
  headers: Record<string, string | string[]> | null
  /** The stored body's size in bytes. */
  bodyBytes: number | null
  /** The handler answered, but its body was not kept (too large, a stream): the outcome alone is replayed. */
  bodyOmitted: boolean | null
  /** With `{ body: true }`: the body, opened when it was sealed. */
  body?: Buffer
  /** With encryption: why the entry cannot be opened (a key no longer configured, an altered entry). */
  unreadable?: string
}

/** What `forget` is told. */
export interface ForgetOptions extends KeyOptions {
  /**
   * Remove a key in flight too. Its request's handler keeps running, but its response is not
   * stored (its lease is gone), and a retry may run beside it. Default `false`: refused.
   */
  force?: boolean
}

/** What `forget` did: the key forgotten, or refused because it is in flight (without `force`). */
export type ForgetResult =
  | (KeyRef & {
    /** The key went: it runs afresh on its next request. */
    outcome: 'forgotten'
    /** What was under the key. */
    previous: 'absent' | 'in-flight' | 'stored'
    /** How many recovery-point records went with it. */
    recoveryPoints: number
  })
  | (KeyRef & {
    /** The key is in flight and `force` was not set: nothing changed. */
    outcome: 'refused'
    /** When the lease lapses unless its holder renews it, epoch ms. */
    lockExpiresAt: number
  })

/** What `purge` is told. */
export interface PurgeOptions extends OperationOptions {
  /** Rows deleted per statement, where the store deletes in batches (KnexStorage: default 1000). */
  batchSize?: number
  /** Called after each batch with the number of expired entries deleted so far. */
  onProgress?: (purged: number) => void
  /**
   * Stops the purge between two batches once aborted: it rejects with the signal's reason, and
   * what was deleted until then stays deleted (`onProgress` has said how much).
   */
  signal?: AbortSignal
}

/** What `inFlight` is told. */
export interface InFlightOptions extends OperationOptions {
  /** Only leases held for longer than this: milliseconds, or a duration such as `'5m'`; 0 (the default): all. */
  olderThan?: number | string
  /** Most leases listed, oldest first. Default 100. */
  limit?: number
}

/** One lease held now, as `inFlight` lists it. */
export interface HeldKey extends FingerprintInfo {
  /** The client's key and scope; `null` when the store holds a hash of them (a long key, or encryption). */
  key: string | null
  /** The scope, or `null` (no scope, or the store holds a hash). */
  scope: string | null
  /** The key as the store holds it. */
  storageKey: string
  /** When the lease was taken, epoch ms; `null` when the store does not know. */
  since: number | null
  /** How long the lease has been held, ms; `null` when its start is unknown. */
  heldMs: number | null
  /** When the lease lapses unless its holder renews it, epoch ms. */
  lockExpiresAt: number
}

/** What `inFlight` returns. */
export interface InFlightListing {
  /** The leases, oldest first, at most `limit`. */
  leases: HeldKey[]
  /** `false` when there may be more than those listed (over the limit, or a store that lists a bounded part). */
  complete: boolean
}

/** The store does not offer the operation (a custom store without the optional method). */
export class IdempotencyOperationNotSupportedError extends Error {
  /** The operation the store does not offer. */
  readonly operation: string
  constructor (operation: string, store: string, method: string) {
    const needless = method === 'purgeExpired' ? '; a store that drops expired entries itself, as MemoryStorage and RedisStorage do, needs none' : ''
    super(`fastify-idempotency: ${store} does not support ${operation} (it has no ${method} method${needless})`)
    this.name = 'IdempotencyOperationNotSupportedError'
    this.operation = operation
  }
}
shareIdentity(IdempotencyOperationNotSupportedError, 'IdempotencyOperationNotSupportedError')

/** Leases read from the store, at most, before they are sorted and cut to `limit`. */
const STORE_LISTING_LIMIT = 10_000
const DEFAULT_LIMIT = 100

type Settings = Pick<PluginSettings, 'storage' | 'cipher' | 'maxKeyLength' | 'headerLabel'>

/**
 * `fastify.idempotency`. An interface, not the class: an application whose types load both the
 * ESM and the CommonJS declarations of the package (a `.mts` and a `.cts` file in one program)
 * augments FastifyInstance from both, and two copies of a class with private members never agree.
 */
export interface IdempotencyOperations {
  /** What is held under the key now: absent, in flight, or a stored response (its body only with `{ body: true }`). */
  inspect: (key: string, options?: KeyOptions & { body?: boolean }) => Promise<Inspection>
  /** Remove the key's entry, lease and recovery-point records; a key in flight only with `force`. */
  forget: (key: string, options?: ForgetOptions) => Promise<ForgetResult>
  /** The leases held now, oldest first. */
  inFlight: (options?: InFlightOptions) => Promise<InFlightListing>
  /** Delete expired entries, where the store needs it. */
  purge: (options?: PurgeOptions) => Promise<{
    /** How many expired entries went. */
    purged: number
  }>
}

export class KeyOperations implements IdempotencyOperations {
  readonly #settings: Settings
  readonly #audit: Audit

  constructor (settings: Settings, log: AuditLog, via: IdempotencyOperationEvent['via'] = 'app') {
    this.#settings = settings
    this.#audit = new Audit(log, via, storeNameOf(settings.storage))
  }

  /** What is held under the key now: absent, in flight, or a stored response (its body only with `{ body: true }`). */
  async inspect (key: string, options: KeyOptions & { body?: boolean } = {}): Promise<Inspection> {
    return await this.#run('inspect', options, key, { body: options.body === true }, async (checked) => {
      const ref = checked!
      const storageKey = this.#storageKey(ref)
      const found = await this.#offering('inspect', 'inspect').inspect(storageKey)
      if (found.state === 'absent') return { ...ref, state: 'absent' as const }
      if (found.state === 'in-flight') {
        return { ...ref, state: 'in-flight' as const, since: found.since, lockExpiresAt: found.lockExpiresAt, ...fingerprintInfo(found.fingerprint) }
      }
      return this.#stored(ref, storageKey, found, options.body === true)
    }, (result) => ({ fields: { state: result.state }, message: result.state }))
  }

  /**
   * Remove what is held under the key, and the records of its recovery points, so that the same
   * key runs afresh. A key in flight is refused (nothing changes) unless `force` is set.
   */
  async forget (key: string, options: ForgetOptions = {}): Promise<ForgetResult> {
    const force = options.force === true
    return await this.#run('forget', options, key, { force }, async (checked): Promise<ForgetResult> => {
      const ref = checked!
      const storageKey = this.#storageKey(ref)
      const result = await this.#offering('forget', 'forget').forget(storageKey, { force, relatedPrefix: stepRecordPrefix(storageKey) })
      if (result.outcome === 'refused') return { ...ref, outcome: 'refused', lockExpiresAt: result.lockExpiresAt }
      return { ...ref, outcome: 'forgotten', previous: result.previous === 'completed' ? 'stored' : result.previous, recoveryPoints: result.related }
    }, (result) => result.outcome === 'refused'
      ? { fields: { outcome: 'refused' }, message: `refused: the key is in flight until ${new Date(result.lockExpiresAt).toISOString()} (force removes it)` }
      : {
          fields: { outcome: 'forgotten', previous: result.previous, recoveryPoints: result.recoveryPoints },
          message: `forgotten (it was ${result.previous}; ${result.recoveryPoints} recovery-point records removed)`
        })
  }

  /** The leases held now, oldest first, as far as the store can list them. */
  async inFlight (options: InFlightOptions = {}): Promise<InFlightListing> {
    return await this.#run('in-flight', options, undefined, {}, async () => {
      const olderThan = options.olderThan === undefined ? 0 : toMilliseconds(options.olderThan, 'olderThan', 'inFlight options', true)
      const limit = options.limit ?? DEFAULT_LIMIT
      if (!Number.isSafeInteger(limit) || limit < 1) throw new TypeError('fastify-idempotency: invalid inFlight options: limit must be a positive integer')
      const listing = await this.#offering('in-flight', 'listInFlight').listInFlight({ limit: STORE_LISTING_LIMIT })
      const now = Date.now()
      const held = listing.leases
        .filter((lease) => !isStepRecordKey(lease.key) && (olderThan === 0 || (lease.since !== null && now - lease.since >= olderThan)))
        .map((lease): HeldKey => ({
          ...(storageKeyParts(lease.key) ?? { key: null, scope: null }),
          storageKey: lease.key,
          since: lease.since,
          heldMs: lease.since === null ? null : Math.max(0, now - lease.since),
          lockExpiresAt: lease.lockExpiresAt,
          ...fingerprintInfo(lease.fingerprint)
        }))
        // Oldest first; leases whose start is unknown last.
        .sort((a, b) => (a.since ?? Infinity) - (b.since ?? Infinity) || a.lockExpiresAt - b.lockExpiresAt)
      return { leases: held.slice(0, limit), complete: listing.complete && held.length <= limit }
    }, (result) => ({ fields: { listed: result.leases.length, complete: result.complete }, message: `${result.leases.length} listed${result.complete ? '' : ' (there may be more)'}` }))
  }

  /** Delete expired entries, for stores that do not drop them themselves (KnexStorage); how many went. */
  async purge (options: PurgeOptions = {}): Promise<{ purged: number }> {
    const { batchSize, onProgress, signal } = options
    let purged = 0
    const progress = (count: number): void => {
      purged = count
      onProgress?.(count)
    }
    // MemoryStorage and RedisStorage drop expired entries themselves: they have no purge, and need none.
    return await this.#run('purge', options, undefined, {}, async () => {
      const store = this.#offering('purge', 'purgeExpired')
      return { purged: await store.purgeExpired({ ...(batchSize === undefined ? {} : { batchSize }), onProgress: progress, ...(signal === undefined ? {} : { signal }) }) }
    }, (result) => ({ fields: { purged: result.purged }, message: `${result.purged} expired entries deleted` }),
    // A purge that fails or is stopped midway has deleted what its finished batches deleted.
    () => ({ fields: { purged }, message: `after ${purged} expired entries deleted` }))
  }

  /**
   * An operation, audited whatever happens: its input is checked inside, so a refused key or an
   * operation the store does not offer is reported too. `key` as given; the call gets it checked.
   */
  async #run<T> (operation: IdempotencyOperation, options: KeyOptions, key: string | undefined, fields: Partial<IdempotencyOperationEvent>,
    call: (ref: KeyRef | null) => Promise<T>, outcome: (result: T) => Outcome, partial?: () => Outcome): Promise<T> {
    const given = key === undefined ? null : { key: String(key), scope: options.scope ?? null }
    const subject = given === null ? {} : { idempotencyKey: given.key, scope: given.scope }
    const actor = options.actor === undefined ? null : String(options.actor)
    return await this.#audit.run(operation, actor, { ...subject, ...fields }, given === null ? '' : describe(given),
      async () => await call(key === undefined ? null : this.#ref(key, options.scope)), outcome, partial)
  }

  /** The key checked as the header is checked; the scope as given. */
  #ref (key: string, scope: string | null | undefined): KeyRef {
    const { headerLabel, maxKeyLength } = this.#settings
    if (typeof key !== 'string') throw new TypeError('fastify-idempotency: the key must be a string')
    if (scope !== undefined && scope !== null && typeof scope !== 'string') throw new TypeError('fastify-idempotency: the scope must be a string')
    return { key: readIdempotencyKey(key, headerLabel, maxKeyLength)!, scope: scope ?? null }
  }

  #storageKey (ref: KeyRef): string {
    return storageKey(ref.key, ref.scope, this.#settings.cipher)
  }

  /** The store, when it has `method`; otherwise the operation is refused before anything is done. */
  #offering<M extends 'inspect' | 'forget' | 'listInFlight' | 'purgeExpired'> (operation: string, method: M): IdempotencyStorage & Required<Pick<IdempotencyStorage, M>> {
    const { storage } = this.#settings
    if (typeof storage[method] !== 'function') throw new IdempotencyOperationNotSupportedError(operation, storeNameOf(storage), method)
    return storage as IdempotencyStorage & Required<Pick<IdempotencyStorage, M>>
  }

  /** A stored entry as reported: opened with the configured keys when it is sealed. */
  #stored (ref: KeyRef, storageKey: string, found: StoredCompleted, withBody: boolean): StoredInspection {
    const { cipher } = this.#settings
    const base = { ...ref, state: 'stored' as const, statusCode: found.response.statusCode, storedAt: found.storedAt, expiresAt: found.expiresAt, ...fingerprintInfo(found.fingerprint) }
    let response = found.response
    if (cipher !== null) {
      try {
        response = cipher.open(storageKey, found.response)
      } catch (error) {
        if (!(error instanceof UnreadableEntryError)) throw error
        return { ...base, contentType: null, headers: null, bodyBytes: null, bodyOmitted: null, unreadable: error.message }
      }
    }
    const bodyOmitted = response.bodyOmitted === true
    const stored: StoredInspection = { ...base, contentType: response.contentType, headers: response.headers, bodyBytes: response.body.length, bodyOmitted }
    if (withBody) stored.body = Buffer.from(response.body)
    return stored
  }
}

function fingerprintInfo (fingerprint: string): FingerprintInfo {
  return { fingerprint, fingerprintOptions: fingerprintOptionsOf(fingerprint) }
}

/** ` of key "k" (scope "s")`, for the audit line. */
function describe (ref: KeyRef): string {
  return ` of key ${JSON.stringify(ref.key)}${ref.scope === null ? '' : ref.scope === NO_CALLER_SCOPE ? ' (no caller)' : ` (scope ${JSON.stringify(ref.scope)})`}`
}
