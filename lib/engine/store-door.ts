/**
 * The engine's one way to the store: every call a guarded operation (a route's requests, a
 * function run with `run`) makes to its store goes through here, bounded by `storeTimeout`, with
 * the lease and expiry times and the cipher of that operation. What the protocol does (acquire,
 * settle, steps) reads as the protocol alone; how a call is made safe is said once, here:
 *
 * - every call is bounded by the deadline (store-deadline.ts), and a store that throws instead of
 *   rejecting is a rejection;
 * - a lease granted to a call the engine gave up on, or granted too late to be relied on, is
 *   given back or renewed first (`begin`);
 * - a lease nothing will run under is given back fenced, and giving back never throws
 *   (`giveBack`);
 * - a transaction opened for a call given up on is rolled back (`openTransaction`).
 *
 * A store measures a lease from some moment after `begin` was sent: a lease taken by a call sent
 * at `s` lasts at least until `s + lockTimeout`, and no longer may be assumed. A store may read
 * its clock before a wait (MySQL and MariaDB do, for the INSERT of a new key that waits for a gap
 * lock another transaction holds), and an answer may travel slowly. Renewal keeps a lease alive
 * when it is held soon enough after `s`; a lease granted later than that is renewed here first,
 * before anything runs under it, and one that lapsed meanwhile (a duplicate may have taken the
 * key over and be running) is not used: the call fails as a store failure does.
 */
import type { ResponseCipher } from '../encryption.js'
import { SYNCHRONOUS_STEPS, storeNameOf, type BeginResult, type IdempotencyStorage, type StorageTransaction, type StoredResponse, type StoredState, type SynchronousSteps, type TransactionalStorage, type TransactionOptions } from '../storage/types.js'
import type { MaybePromise } from './maybe-promise.js'
import { StoreDeadline } from './store-deadline.js'

/** `begin` granted a lease that had lapsed before it could be used. */
export class LeaseLapsedError extends Error {
  constructor (answeredAfter: number, lockTimeout: number) {
    super(`fastify-idempotency: the store granted a lease ${answeredAfter} ms after begin was sent, and it lapsed before it could be used (lockTimeout ${lockTimeout} ms)`)
    this.name = 'LeaseLapsedError'
  }
}

export interface TakenLease {
  result: BeginResult
  /** When the store measures the lease from, at the earliest (epoch ms): where renewal counts from. */
  since: number
}

/** Whether a lease measured from `since` and held from now is renewed in time (LeaseRenewal). */
export interface LeaseClock {
  inTime: (since: number) => boolean
}

/** The times a door's calls carry. */
export interface DoorSettings {
  /** Milliseconds each call may take; 0 bounds nothing. */
  readonly storeTimeout: number
  readonly lockTimeout: number
  readonly expiration: number
}

const noop = (): void => {}
/** How deep `isConflict` looks into an error's causes. */
const MAX_CAUSES = 5

/** The store's steps answered at once, when it has them and its own methods are the ones they stand for. */
function synchronousSteps (storage: IdempotencyStorage): SynchronousSteps | null {
  const steps = (storage as { [SYNCHRONOUS_STEPS]?: SynchronousSteps })[SYNCHRONOUS_STEPS]
  if (steps === undefined) return null
  const { of } = steps
  return storage.begin === of.begin && storage.complete === of.complete && storage.release === of.release ? steps : null
}

export class StoreDoor {
  readonly storage: IdempotencyStorage
  /** Seals what is stored and opens what is replayed; `null` without encryption. */
  readonly cipher: ResponseCipher | null
  readonly #settings: DoorSettings
  readonly #deadline: StoreDeadline
  /** The store's steps answered at once, when it has them: begin, complete and release make no promise. */
  readonly #sync: SynchronousSteps | null

  constructor (storage: IdempotencyStorage, settings: DoorSettings, cipher: ResponseCipher | null = null) {
    this.storage = storage
    this.cipher = cipher
    this.#settings = settings
    this.#sync = synchronousSteps(storage)
    // A store that answers from this process's memory (MemoryStorage) cannot hang: nothing to bound.
    this.#deadline = new StoreDeadline(this.#sync === null ? settings.storeTimeout : 0)
  }

  /** The store's class name, for events and logs. */
  get storeName (): string {
    return storeNameOf(this.storage)
  }

  /**
   * Whether the store keeps what it is given in this process's memory (MemoryStorage), rather than
   * writing its bytes elsewhere: it then takes a body sent as a string as that string (`complete`'s
   * `text`), and no Buffer of it is made unless a replay needs one.
   */
  get keepsText (): boolean {
    return this.#sync !== null
  }

  /** Whether the store signals the end of a lease (`waitFor`), so that waiting need not poll. */
  get signals (): boolean {
    return typeof this.storage.waitFor === 'function'
  }

  /**
   * An open transaction holds the store's only connection (SQLite through knex): no other store
   * call can run beside it.
   */
  get singleConnection (): boolean {
    return (this.storage as Partial<TransactionalStorage>).singleConnection === true
  }

  /**
   * Take the lease on `key` (or learn what holds it), so that the engine can rely on it: a lease
   * granted to a call given up on is given back at once; one answered after `renewal.inTime` says
   * renewal would reach it is renewed first, and refused (LeaseLapsedError) when it lapsed meanwhile. A
   * store that answers at once answers here at once (and throws at once), in time by definition.
   */
  begin (key: string, fingerprint: string, renewal: LeaseClock): MaybePromise<TakenLease> {
    if (this.#sync !== null) {
      const since = Date.now()
      return { result: this.#sync.begin(key, fingerprint, this.#settings.lockTimeout), since }
    }
    return this.#beginLater(key, fingerprint, renewal)
  }

  async #beginLater (key: string, fingerprint: string, renewal: LeaseClock): Promise<TakenLease> {
    const { lockTimeout } = this.#settings
    const sentAt = Date.now()
    const result = await this.#deadline.run('begin', () => this.storage.begin(key, fingerprint, lockTimeout), (late) => {
      if (late.state === 'acquired') void this.giveBack(key, late.token)
    })
    if (result.state !== 'acquired' || renewal.inTime(sentAt)) return { result, since: sentAt }
    const renewedAt = Date.now()
    let held: boolean
    try {
      held = await this.renew(key, result.token)
    } catch (error) {
      // Also when given up on: a renewal that goes through later finds the lease released, or is
      // followed by the release.
      void this.giveBack(key, result.token)
      throw error
    }
    if (!held) throw new LeaseLapsedError(renewedAt - sentAt, lockTimeout)
    return { result, since: renewedAt }
  }

  /**
   * Store `response` under the lease `token` holds: `false` when the lease was lost. A call given up
   * on that still goes through tells `late`. At once on a store that answers at once, which is the
   * only one given a `text` body (see Ending and `keepsText`).
   */
  complete (key: string, token: string, response: StoredResponse, late: (stored: boolean) => void = noop, text?: string): MaybePromise<boolean> {
    if (this.#sync !== null) return this.#sync.complete(key, token, response, this.#settings.expiration, text)
    return this.#deadline.run('complete', () => this.storage.complete(key, token, response, this.#settings.expiration), late)
  }

  /** Extend the lease `token` holds by `lockTimeout` from now: `false` when it was lost. */
  renew (key: string, token: string): Promise<boolean> {
    return this.#deadline.run('renew', () => this.storage.renew(key, token, this.#settings.lockTimeout))
  }

  /**
   * Drop the lease `token` holds without storing anything; fails when the store fails. At once on
   * a store that answers at once.
   */
  release (key: string, token: string): MaybePromise<boolean> {
    if (this.#sync !== null) return this.#sync.release(key, token)
    return this.#deadline.run('release', () => this.storage.release(key, token))
  }

  /**
   * Drop a lease nothing will run under, and never fail: fenced, so it never touches another
   * holder's lease, and a lease the store could not drop lapses within `lockTimeout`.
   */
  async giveBack (key: string, token: string): Promise<void> {
    try {
      await this.release(key, token)
    } catch {
      // Lapses within lockTimeout.
    }
  }

  /** Open a transaction (transaction mode); one opened for a call given up on is rolled back. */
  openTransaction (options?: TransactionOptions): Promise<StorageTransaction> {
    return this.#deadline.run('transaction', () => (this.storage as TransactionalStorage).transaction(options), (late) => { late.rollback().catch(noop) })
  }

  /** Renew the lease `token` holds through `transaction`, which holds it (StorageTransaction.renew): `false` when it was lost. */
  renewIn (transaction: StorageTransaction, key: string, token: string): Promise<boolean> {
    return this.#deadline.run('renew', () => transaction.renew!(key, token, this.#settings.lockTimeout))
  }

  /**
   * Whether `error`, thrown in one of the store's transactions, says it conflicted with another
   * (TransactionalStorage.isConflict): the error itself, or one of its causes, as a handler that
   * wraps the driver's error passes it on.
   */
  isConflict (error: unknown): boolean {
    const { isConflict } = this.storage as Partial<TransactionalStorage>
    if (isConflict === undefined) return false
    for (let cause = error, depth = 0; cause !== null && typeof cause === 'object' && depth < MAX_CAUSES; cause = (cause as { cause?: unknown }).cause, depth++) {
      if (isConflict.call(this.storage, cause)) return true
    }
    return false
  }

  /** Store `response` inside `transaction`, under the lease `token` holds: `false` when it was lost. */
  completeIn (transaction: StorageTransaction, key: string, token: string, response: StoredResponse): Promise<boolean> {
    return this.#deadline.run('complete', () => transaction.complete(key, token, response, this.#settings.expiration))
  }

  commit (transaction: StorageTransaction): Promise<void> {
    return this.#deadline.run('commit', () => transaction.commit())
  }

  rollback (transaction: StorageTransaction): Promise<void> {
    return this.#deadline.run('rollback', () => transaction.rollback())
  }

  /**
   * Wait for the store's signal that the lease on `key` may have ended, at most `timeout` ms. Only
   * when `signals`. The deadline bounds the whole wait, not only the store's part of it
   * (subscribing): a round of waiting ends within `storeTimeout` whatever `timeout` says, and the
   * duplicate then asks the store again. So a signal that never comes (a subscriber connection that
   * reconnected meanwhile, a store that cannot tell) costs one `begin` per `storeTimeout`, not the
   * rest of the wait; and closing the app, which stops the deadline, ends every wait at once.
   */
  waitFor (key: string, timeout: number): Promise<void> {
    return this.#deadline.run('waitFor', () => this.storage.waitFor!(key, timeout))
  }

  /** What `key` holds, read without taking it; `null` when the store cannot read without taking. */
  inspect (key: string): Promise<StoredState> | null {
    return this.storage.inspect === undefined ? null : this.#deadline.run('inspect', () => this.storage.inspect!(key))
  }

  /** `begin` without the lease's renewal: for a read of a key by a store without `inspect`. */
  beginOnly (key: string, fingerprint: string): Promise<BeginResult> {
    return this.#deadline.run('begin', () => this.storage.begin(key, fingerprint, this.#settings.lockTimeout))
  }

  /** Give up on every call pending (the server is closing). */
  stop (): void {
    this.#deadline.stop()
  }
}
