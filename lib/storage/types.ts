/**
 * The storage contract every provider implements (the seed's `IIdempotencyStorage`).
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
  state: 'acquired'
  /** Fencing token: `complete`, `release` and `renew` only act while this token holds the lease. */
  token: string
}

/** Another request holds the lease for this key. */
export interface BeginInFlight {
  state: 'in-flight'
  /** Fingerprint of the request that holds the lease. */
  fingerprint: string
  /** When the lease lapses unless renewed, in epoch milliseconds. */
  lockExpiresAt: number
}

/** A live stored response exists for this key. */
export interface BeginCompleted {
  state: 'completed'
  /** Fingerprint of the request whose response was stored. */
  fingerprint: string
  response: StoredResponse
}

export type BeginResult = BeginAcquired | BeginInFlight | BeginCompleted

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
  commit (): Promise<void>
  rollback (): Promise<void>
}

/** A provider that can open a StorageTransaction (KnexStorage). */
export interface TransactionalStorage extends IdempotencyStorage {
  transaction (): Promise<StorageTransaction>
  /**
   * An open transaction holds the only connection (SQLite through knex), so no second
   * transaction, and no store call, can run beside it: recovery points, which commit a
   * transaction of their own while the request's is open, are refused in transaction mode.
   */
  readonly singleConnection?: boolean
}
