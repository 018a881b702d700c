/**
 * The storage interface every provider implements.
 *
 * A provider knows nothing about HTTP or fingerprints beyond storing them: the plugin decides
 * replay, refusal or execution from what `begin` returns. What a provider must guarantee is
 * atomicity: `begin` is one indivisible step (no read-then-write gap), and `complete` / `release`
 * take effect only while the caller's fencing token still holds the lease.
 *
 * Keys: the plugin passes a store well-formed Unicode strings of 1 to 512 UTF-8 bytes (a longer
 * or ill-formed key is hashed first, see engine/storage-key.ts), which may contain any character,
 * NUL and line feed included. A store must keep every such key apart, byte for byte.
 */

/** A response as it is stored and replayed. */
export interface StoredResponse {
  /** HTTP status code of the original response. */
  statusCode: number
  /** `Content-Type` of the original response, or `null` when it had none. */
  contentType: string | null
  /** Replayable response headers, lower-case names, without `content-type` (kept above). */
  headers: Record<string, string | string[]>
  /** The serialized body, byte for byte (empty when `bodyOmitted`). */
  body: Buffer
  /**
   * The handler answered, but its body could not be kept (larger than `maxResponseBytes`, a web
   * stream, a `Response`, a hijacked reply): status and headers are the outcome, replayed with an
   * empty body. Stores must keep this apart from an empty body. Absent means `false`.
   */
  bodyOmitted?: boolean
}

/** The key was free (or its previous lease or entry had lapsed): the caller now holds the lease. */
export interface BeginAcquired {
  /** Discriminant: the caller now holds the lease. */
  state: 'acquired'
  /** Fencing token: `complete`, `release` and `renew` only act while this token holds the lease. */
  token: string
}

/** Another request holds the lease for this key. */
export interface BeginInFlight {
  /** Discriminant: another request holds the lease. */
  state: 'in-flight'
  /** Fingerprint of the request that holds the lease. */
  fingerprint: string
  /** When the lease lapses unless renewed, in epoch milliseconds. */
  lockExpiresAt: number
}

/** A live stored response exists for this key. */
export interface BeginCompleted {
  /** Discriminant: a live stored response exists. */
  state: 'completed'
  /** Fingerprint of the request whose response was stored. */
  fingerprint: string
  /** The stored response, to replay. */
  response: StoredResponse
}

/** What `begin` found or did: the lease taken, the key in flight, or a stored response. */
export type BeginResult = BeginAcquired | BeginInFlight | BeginCompleted

/**
 * The steps of a request's path as an in-process store answers them: at once, without a promise.
 * A store that offers them under `SYNCHRONOUS_STEPS` (MemoryStorage) lets the engine serve a
 * request without making a promise of its own; the engine still uses the store's promised methods
 * for everything else. Each must do exactly what its promised twin does.
 */
export interface SynchronousSteps {
  begin: (key: string, fingerprint: string, lockTimeout: number) => BeginResult
  /**
   * `text`: the body is this string, as the handler sent it, and `response.body` is left empty:
   * the store keeps the string, and makes its bytes when the entry is first read (a first request
   * then makes no Buffer; see engine/settle.ts, Ending).
   */
  complete: (key: string, token: string, response: StoredResponse, expiration: number, text?: string) => boolean
  release: (key: string, token: string) => boolean
  /**
   * The promised methods these steps stand for. The engine uses the steps only while the store's
   * methods are these: a subclass or a wrapper that replaces one (to count calls, to alter them)
   * is called through its own methods, never around them.
   */
  readonly of: Pick<IdempotencyStorage, 'begin' | 'complete' | 'release'>
}

/** Where a store keeps its SynchronousSteps: a symbol of the global registry, the same in every copy of the package. */
export const SYNCHRONOUS_STEPS = Symbol.for('fastify-idempotency.synchronousSteps')

/**
 * The name events, logs and errors give a store: its `Symbol.toStringTag` when it has one (the
 * built-in stores do, so the name survives a bundler or minifier that renames classes), else its
 * class's name.
 */
export function storeNameOf (storage: object): string {
  const tag = (storage as { [Symbol.toStringTag]?: unknown })[Symbol.toStringTag]
  return typeof tag === 'string' && tag !== '' ? tag : storage.constructor.name
}

/**
 * The contract every store implements: MemoryStorage, RedisStorage, KnexStorage, or your own (see
 * docs/stores/custom.md). `begin` is one atomic step; `complete`, `release` and `renew` act only
 * while the caller's fencing token holds the lease.
 */
export interface IdempotencyStorage {
  /**
   * One atomic step: return the live stored response, or report the key in flight, or take the
   * lease for `lockTimeout` ms (recording `fingerprint` with it) and return a new fencing token.
   * An expired entry or a lapsed lease counts as free.
   */
  begin (key: string, fingerprint: string, lockTimeout: number): Promise<BeginResult>

  /**
   * Store `response` for `expiration` ms and drop the lease, only if `token` still holds it.
   * Resolves `false` (and changes nothing) when the lease was lost.
   */
  complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean>

  /** Drop the lease without storing anything, only if `token` still holds it. */
  release (key: string, token: string): Promise<boolean>

  /** Extend the lease to `lockTimeout` ms from now, only if `token` still holds it. */
  renew (key: string, token: string, lockTimeout: number): Promise<boolean>

  /**
   * Optional: resolve once the lease on `key` may have ended (completed, released or lapsed), or
   * after `timeout` ms, whichever comes first. Resolving early is allowed when the key's state may
   * have changed (the caller asks `begin` again), never as a matter of course, which would turn
   * waiting into busy polling. It must not miss an end that happens after the call starts: subscribe first, then
   * check. Providers that can wait on an event (in-process events, Redis pub/sub, PostgreSQL
   * LISTEN/NOTIFY) implement it; without it the plugin polls `begin` with a bounded back-off.
   */
  waitFor? (key: string, timeout: number): Promise<void>

  /** Free what the provider created itself. Never closes a client it was given. */
  close? (): Promise<void>

  /**
   * Optional: check that the store can work (its server reachable, its table or script there),
   * creating what it was asked to create. The plugin calls it once when the app starts
   * (`onReady`), within `storeTimeout`, unless `checkStore: false` or the store has `prove`; a
   * rejection fails `app.ready()`. Reject with an Error whose message says in one line what is
   * wrong and how to fix it.
   */
  ready? (options?: Partial<StoreProofOptions>): Promise<void>

  /**
   * Optional: the start-up proof, check by check: every command, privilege and form the store will
   * use at request time, tried on the server (on a probe that no key can name, left as it was),
   * and the server's settings that would break the plugin's promise. The plugin calls it instead
   * of `ready` when the app starts (a `failed` check fails `app.ready()`, a `warning` is logged),
   * and the `doctor` command prints it. A store that cannot reach its server at all returns that
   * one failed check.
   */
  prove? (options: StoreProofOptions): Promise<StoreCheck[]>

  /*
   * Operations (docs/operations.md): optional. A store without them serves requests as well;
   * `fastify.idempotency` and the command then say the operation is not supported. The
   * conformance suite tests each one a store lists in its `operations` option.
   */

  /** Optional: what is held under `key` now (a live entry or lease), read without changing anything. */
  inspect? (key: string): Promise<StoredState>

  /**
   * Optional: remove the entry under `key`, and every key that starts with
   * `options.relatedPrefix` (the records of the request's recovery points; the plugin derives the
   * prefix so that no other key starts with it). A key in flight (a live lease) is left as it is,
   * related keys included, and reported `refused`, unless `options.force`: then the lease goes
   * too, its holder's token is fenced off, and requests waiting for it are woken.
   */
  forget? (key: string, options: StorageForgetOptions): Promise<StorageForgetResult>

  /**
   * Optional: the live leases, up to `options.limit` of them, in no particular order. `complete`
   * is `false` when there may be more than those returned (over the limit, or a store that
   * stopped a bounded scan early).
   */
  listInFlight? (options: { limit: number }): Promise<LeaseListing>

  /**
   * Optional: delete expired entries and lapsed leases, for stores that do not drop them
   * themselves; how many went. A store that deletes in batches says how many so far after each
   * (`onProgress`), and stops between two batches once `signal` is aborted (rejecting with its
   * reason); one that cannot may ignore both.
   */
  purgeExpired? (options?: StoragePurgeOptions): Promise<number>
}

/** What `purgeExpired` may be told. */
export interface StoragePurgeOptions {
  /** Rows deleted per statement, where the store deletes in batches. */
  batchSize?: number
  /** Called after each batch with the number deleted so far. */
  onProgress?: (purged: number) => void
  /** Stop between two batches once aborted, rejecting with its reason. */
  signal?: AbortSignal
}

/** What `inspect` finds under a key. */
export type StoredState = StoredAbsent | StoredInFlight | StoredCompleted

/** Nothing live under the key: never used, expired, released or forgotten. */
export interface StoredAbsent {
  /** Discriminant: nothing live under the key. */
  state: 'absent'
}

/** A request holds the lease. */
export interface StoredInFlight {
  /** Discriminant: a request holds the lease. */
  state: 'in-flight'
  /** Fingerprint of the request that holds the lease. */
  fingerprint: string
  /** When the lease lapses unless renewed, epoch ms. */
  lockExpiresAt: number
  /** When the lease was taken, epoch ms, or `null` when the store does not know. */
  since: number | null
}

/** A stored response, as `begin` would replay it. */
export interface StoredCompleted {
  /** Discriminant: a stored response. */
  state: 'completed'
  /** Fingerprint of the request whose response was stored. */
  fingerprint: string
  /** The stored response. */
  response: StoredResponse
  /** When it was stored, epoch ms, or `null` when the store does not know (an entry stored by an earlier version). */
  storedAt: number | null
  /** When it expires, epoch ms. */
  expiresAt: number
}

/** What `forget` is told: whether a live lease goes too, and which related keys go with the key. */
export interface StorageForgetOptions {
  /** Remove a live lease too (a request in flight). */
  force: boolean
  /** Remove every key that starts with this too. */
  relatedPrefix: string
}

/**
 * What `forget` did: removed the key (and what was under it), or refused because the key is in
 * flight.
 */
export type StorageForgetResult =
  | {
    /** Removed. */
    outcome: 'forgotten'
    /** What was under the key. */
    previous: 'completed' | 'in-flight' | 'absent'
    /** How many related keys (starting with `relatedPrefix`) went. */
    related: number
  }
  | {
    /** The key is in flight and `force` was not set: nothing was changed. */
    outcome: 'refused'
    /** When the lease lapses unless renewed, epoch ms. */
    lockExpiresAt: number
  }

/** One live lease, as `listInFlight` lists it. */
export interface HeldLease {
  /** The key as the store was given it. */
  key: string
  /** Fingerprint of the request that holds the lease. */
  fingerprint: string
  /** When the lease lapses unless renewed, epoch ms. */
  lockExpiresAt: number
  /** When the lease was taken, epoch ms, or `null` when the store does not know. */
  since: number | null
}

/** What `listInFlight` returns: the live leases it found, and whether that is all of them. */
export interface LeaseListing {
  /** The live leases, in no particular order. */
  leases: HeldLease[]
  /** `false` when there may be leases that are not listed. */
  complete: boolean
}

/**
 * One database transaction that carries both the handler's writes and the stored response, so
 * they commit together or not at all (transaction mode). Nothing it writes is visible to other
 * requests before `commit`.
 */
export interface StorageTransaction {
  /** What the handler writes through (for KnexStorage, a knex transaction). */
  readonly handle: unknown
  /** Store the response inside the transaction, fenced by `token`; `false` when the lease was lost. */
  complete (key: string, token: string, response: StoredResponse, expiration: number): Promise<boolean>
  /** Commit the handler's writes and the stored response together. */
  commit (): Promise<void>
  /** Roll back the handler's writes; nothing is stored. */
  rollback (): Promise<void>
  /**
   * Present when the lease of the request this transaction was opened for (`TransactionOptions.lease`)
   * is renewed through the transaction itself rather than by the store's `renew`: when the
   * transaction could not store its response over a renewal committed beside it (PostgreSQL's
   * REPEATABLE READ and SERIALIZABLE), or when no other connection is free while it is open
   * (SQLite, a pool of one). Extend the lease `token` holds by `lockTimeout` from now: `false`
   * when it was lost.
   */
  renew?: (key: string, token: string, lockTimeout: number) => Promise<boolean>
}

/**
 * The SQL isolation levels transaction mode can open its transaction at (`transaction: {
 * isolationLevel }`). SQLite's transactions are all serializable; there, `'serializable'` begins
 * them IMMEDIATE (the write lock taken at once) and the others DEFERRED. See docs/transactions.md.
 */
export type IsolationLevel = 'read committed' | 'repeatable read' | 'serializable'

/** The lease a request's transaction is opened under: the key, the token that holds it, its length. */
export interface TransactionLease {
  /** The key whose lease the transaction holds. */
  key: string
  /** The lease's token, as `begin` gave it. */
  token: string
  /** How long the lease lasts from each renewal, in milliseconds. */
  lockTimeout: number
}

/** What a transaction is opened for. */
export interface TransactionOptions {
  /**
   * The request's own transaction, held while its handler runs, and the handler may need more
   * connections meanwhile (a recovery point's record and transaction, the lease's renewals). A
   * store with a bounded pool makes such a transaction wait until holding it leaves a connection
   * for those, so that requests never all hold one connection while each waits for another.
   * Transactions opened without it (a recovery point's) never wait behind these.
   */
  request?: boolean
  /** The isolation level to open it at; the database's default (the session's) when absent. */
  isolationLevel?: IsolationLevel
  /**
   * The request's lease, held while the transaction is open. A store whose transaction must hold
   * the lease itself (see `StorageTransaction.renew`) renews it as soon as the transaction opens,
   * and fails to open when it is lost.
   */
  lease?: TransactionLease
}

/** A provider that can open a StorageTransaction (KnexStorage). */
export interface TransactionalStorage extends IdempotencyStorage {
  /** Open a transaction for one request's handler writes and its stored response (or a recovery point's). */
  transaction (options?: TransactionOptions): Promise<StorageTransaction>
  /**
   * An open transaction holds the only connection (SQLite through knex), so no second
   * transaction, and no store call, can run beside it: recovery points, which commit a
   * transaction of their own while the request's is open, are refused in transaction mode.
   */
  readonly singleConnection?: boolean
  /**
   * Whether `error`, thrown by a statement of one of its transactions (a handler's), says that
   * transaction conflicted with another and may succeed when run again: a serialization failure,
   * a deadlock, a busy database. The plugin then answers 503 with Retry-After, as for a failed
   * commit.
   */
  isConflict?: (error: unknown) => boolean
}

/** What a store's start-up proof (`IdempotencyStorage.prove`) is told. */
export interface StoreProofOptions {
  /**
   * Some route waits for keys in flight (`wait: true`): the store's signal that a lease ended
   * (Redis's PUBLISH and SUBSCRIBE) is proven too.
   */
  wait: boolean
  /**
   * Aborted when the time for the proof is up (the plugin's `storeTimeout`, the command's
   * `--timeout`): a check still waiting gives up and says which it was.
   */
  signal?: AbortSignal
}

/** One check of a store's start-up proof. */
export interface StoreCheck {
  /** What is checked, in a few words: `'EVALSHA'`, `'eviction policy'`, `'DELETE'`. */
  name: string
  /**
   * `passed`: the store can. `failed`: it cannot keep the plugin's promise; the app does not start.
   * `warning`: it can, with a risk its owner accepted or a fallback (waits that poll), said at start.
   */
  outcome: 'passed' | 'failed' | 'warning'
  /** What it found, as a clause: on a failure, the server's own words. */
  found: string
  /** What to do about it, when it did not pass. */
  cure?: string
}
