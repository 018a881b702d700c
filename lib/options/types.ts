/**
 * The options a user writes: the plugin's, and a route's `config.idempotency`. What they become
 * once normalized is in table.ts.
 */
import type { FastifyRequest } from 'fastify'
import type { EncryptionOptions } from '../encryption.js'
import type { FingerprintOptions } from '../fingerprint/fingerprint.js'
import type { Scope } from '../http/scope.js'
import type { IdempotencyStorage, IsolationLevel, StoredResponse } from '../storage/types.js'

/** Transaction mode, with the isolation level its transaction is opened at (`transaction: { isolationLevel }`). */
export interface IdempotencyTransactionOptions {
  /**
   * The level the plugin opens the transaction at, before the handler's first statement (the
   * database's default when absent; a route's `transaction: true` keeps the plugin's level).
   * PostgreSQL and MySQL/MariaDB run it at this level; SQLite, whose transactions are all
   * serializable, begins IMMEDIATE for `'serializable'` (the write lock taken at once) and
   * DEFERRED for the others. What each level buys on each store: docs/transactions.md.
   */
  isolationLevel?: IsolationLevel
}

/** What a route may set in `config.idempotency` (and what the plugin options set for every route). */
export interface IdempotencyRouteOptions {
  /** Refuse requests without a key with 400 (default `false`: they pass through unprotected). */
  required?: boolean
  /** How long a stored response is replayed: milliseconds or a duration string (default `'24h'`). */
  expiration?: number | string
  /** How long a request holds its key before a retry may take over (default `'60s'`). Renewed while the handler runs. */
  lockTimeout?: number | string
  /**
   * The longest a request may keep renewing its lease, handler and storing its response together
   * (default `'10m'`, or `lockTimeout` if that is longer). Past it renewal stops, so no hung
   * handler and no store that keeps refusing the response can hold a key for ever.
   */
  maxLockHold?: number | string
  /**
   * The longest the plugin waits for any one call to its store (default `'5s'`), whatever the
   * client library's own settings: past it, a request not yet run gets 503, and storing a response
   * is retried. A hung store never holds a request for longer.
   */
  storeTimeout?: number | string
  /** Status codes to store besides 200, 201, 202, 204, 302 and 303. */
  addCacheableStatusCodes?: number[]
  /** Status codes not to store. */
  removeCacheableStatusCodes?: number[]
  /** Which parts of a request make up its fingerprint; a route's object is merged over the plugin's. */
  fingerprint?: FingerprintOptions
  /** Largest response body stored, in bytes (default 1 MiB); a larger one is sent, and only its outcome stored. */
  maxResponseBytes?: number
  /**
   * A response whose body cannot be kept (larger than `maxResponseBytes`, a web stream, a
   * `Response`, a hijacked reply): `'outcome'` (default) stores its status and headers, so a retry
   * gets them (with an empty body and `Idempotent-Body-Omitted: true`) and the handler does not
   * run again; `'release'` stores nothing and frees the key, so a retry runs the handler again.
   */
  unstorableResponse?: 'outcome' | 'release'
  /** Status of a fingerprint mismatch: 409 (default, Stripe's) or 422 (the IETF draft's). */
  mismatchStatusCode?: 409 | 422
  /** When the store is unreachable, run the handler without protection instead of answering 503 (default `false`). */
  failOpen?: boolean
  /**
   * A duplicate of a request still in flight waits for it to finish and gets its response (or,
   * if it ended without storing one, runs the handler itself), instead of an immediate 409
   * (default `false`).
   */
  wait?: boolean
  /** With `wait`, how long a duplicate waits before it gets the 409 after all (default `'10s'`). */
  waitTimeout?: number | string
  /**
   * Run the handler's writes and the stored response in one database transaction, handed to the
   * handler as `request.idempotency.transaction` (default `false`). Needs a storage that supports
   * it (KnexStorage). `true` opens it at the database's default isolation level; an object sets
   * the level (see IdempotencyTransactionOptions and docs/transactions.md).
   */
  transaction?: boolean | IdempotencyTransactionOptions
  /** Namespace keys by caller (the signed-in user's id, say; `undefined`: none), so one never receives another's response. */
  scope?: Scope
  /**
   * Where the key comes from, instead of the `Idempotency-Key` header: a function of the request
   * (a webhook's event id: `(request) => request.headers['webhook-id']`, or a member of its body).
   * It runs in `preHandler`, after the route's own hooks (a signature check, authentication), on a
   * validated body; `undefined` or `null`: the request has no key. See docs/jobs.md#webhooks.
   */
  key?: KeySource
  /**
   * Called with each response about to be stored (a copy); returns what to store instead: the
   * same response with secrets taken out, or with `bodyOmitted: true` to keep only its status and
   * headers. The client that caused it still gets the response in full; retries get what was
   * stored. Its status cannot be changed. If it throws, only the status is stored.
   */
  redact?: Redact
  /**
   * Keep this answer? Called with a copy of each answer of a cacheable status, before `redact`;
   * `false` frees the key (a retry runs again). A throw, a non-boolean or a timeout keeps it.
   */
  storeIf?: StoreIf
}

/** See `IdempotencyRouteOptions.key`. */
export type KeySource = (request: FastifyRequest) => string | null | undefined | Promise<string | null | undefined>
/** See `IdempotencyRouteOptions.redact`. */
export type Redact = (response: StoredResponse, request: FastifyRequest) => StoredResponse | Promise<StoredResponse>
/** See `IdempotencyRouteOptions.storeIf`. */
export type StoreIf = (response: StoredResponse, request: FastifyRequest) => boolean | Promise<boolean>

export interface IdempotencyOptions extends IdempotencyRouteOptions {
  /** Where responses and leases live (default: a new `MemoryStorage`). */
  storage?: IdempotencyStorage
  /** Request header carrying the key (default `'Idempotency-Key'`). */
  headerName?: string
  /** Longest key accepted, in characters (default 255). */
  maxKeyLength?: number
  /** Response header marking a replay, with the value `true` (default `'Idempotent-Replayed'`); `false` sends none. */
  replayHeader?: string | false
  /** Replay `Set-Cookie` headers too (default `false`: cookies are per response, not per operation). */
  replaySetCookie?: boolean
  /** More response headers never to store or replay (names, case-insensitive). */
  excludeHeaders?: string[]
  /**
   * Encryption at rest (see docs/security.md): stored responses sealed with AES-256-GCM, and keys
   * and scopes stored as a keyed hash. Default: none.
   */
  encryption?: EncryptionOptions
  /** How long `app.close()` waits for guarded requests in flight to settle (default `'5s'`; see docs/shutdown.md). */
  closeTimeout?: number | string
  /**
   * When the app starts, ask the store whether it can work (reachable, its table there) and fail
   * `app.ready()` with the reason when it cannot (default `true`). `false` starts the app anyway:
   * requests then get 503 (or run unprotected with `failOpen`) until the store works.
   */
  checkStore?: boolean
}
