/**
 * Options and route config: their JSON Schema, and normalizing them once, at register time and
 * at route time, so that a typo fails at start-up with a clear message, never at a request.
 */
import { parse as parseDuration } from '@lukeed/ms'
import { Ajv, type ErrorObject } from 'ajv'
import type { FastifyRequest } from 'fastify'
import { ResponseCipher, type EncryptionOptions } from './encryption.js'
import { ALWAYS_EXCLUDED_HEADERS } from './http/excluded-headers.js'
import { normalizeFingerprint, type FingerprintOptions, type FingerprintSettings } from './fingerprint/fingerprint.js'
import type { Scope } from './http/scope.js'
import type { IdempotencyStorage, StoredResponse, TransactionalStorage } from './storage/types.js'

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
  /** Status codes to store besides 200, 201, 202 and 204. */
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
   * it (KnexStorage).
   */
  transaction?: boolean
  /** Namespace keys by caller (the signed-in user's id, say; `undefined`: none), so one never receives another's response. */
  scope?: Scope
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
}

/** What the plugin's options fix for every route, normalized once at register time. */
export interface PluginSettings {
  /** The store every route of this registration uses. */
  storage: IdempotencyStorage
  /** The key header's name, lower-cased, for lookups. */
  headerName: string
  /** The same as the user wrote it, for messages. */
  headerLabel: string
  maxKeyLength: number
  replayHeader: string | null
  /** Response headers never stored nor replayed, lower-cased. */
  excludedHeaders: ReadonlySet<string>
  /** Seals stored responses and hashes storage keys; `null` without `encryption`. */
  cipher: ResponseCipher | null
  /** The route settings a route with `config.idempotency: true` gets, and an object overrides. */
  defaults: RouteSettings
}

/** What may differ from route to route, normalized once when the route is added. */
export interface RouteSettings {
  required: boolean
  expiration: number
  lockTimeout: number
  maxLockHold: number
  storeTimeout: number
  /** `maxLockHold` as the options gave it (`null`: the default), for a route's lockTimeout to be checked against. */
  maxLockHoldOption: number | null
  cacheable: ReadonlySet<number>
  fingerprint: FingerprintSettings
  /** The options `fingerprint` was built from, for a route's override to merge over. */
  fingerprintOptions: FingerprintOptions
  maxResponseBytes: number
  /** Store the outcome of a response whose body cannot be kept, instead of freeing the key. */
  keepUnstorable: boolean
  mismatchStatusCode: 409 | 422
  failOpen: boolean
  /** Open a StorageTransaction for the handler (transaction mode). */
  transaction: boolean
  /** Milliseconds a duplicate of an in-flight request waits; 0 answers 409 at once. */
  waitTimeout: number
  scope: Scope | null
  redact: Redact | null
  storeIf: StoreIf | null
}

const DEFAULT_WAIT_TIMEOUT = 10_000

export const DEFAULT_CACHEABLE_STATUS_CODES: readonly number[] = [200, 201, 202, 204]

const TOKEN = "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
const duration = { type: ['integer', 'string'], minimum: 1 }
const statusCodes = { type: 'array', items: { type: 'integer', minimum: 100, maximum: 599 } }
const pointers = { type: 'array', items: { type: 'string', pattern: '^/' } }

export const fingerprintSchema = {
  type: 'object',
  additionalProperties: false,
  properties: {
    body: {
      anyOf: [
        { type: 'boolean' },
        { const: 'raw' },
        {
          type: 'object',
          additionalProperties: false,
          minProperties: 1,
          maxProperties: 1,
          properties: { include: { ...pointers, minItems: 1 }, exclude: { ...pointers, minItems: 1 } }
        }
      ]
    },
    method: { type: 'boolean' },
    path: { type: 'boolean' },
    query: { type: 'boolean' },
    contentType: { type: 'boolean' },
    headers: { type: 'array', items: { type: 'string', pattern: TOKEN } }
  }
} as const

const routeProperties = {
  required: { type: 'boolean' },
  expiration: duration,
  lockTimeout: duration,
  maxLockHold: duration,
  storeTimeout: duration,
  addCacheableStatusCodes: statusCodes,
  removeCacheableStatusCodes: statusCodes,
  fingerprint: fingerprintSchema,
  maxResponseBytes: { type: 'integer', minimum: 0 },
  unstorableResponse: { enum: ['outcome', 'release'] },
  mismatchStatusCode: { enum: [409, 422] },
  failOpen: { type: 'boolean' },
  wait: { type: 'boolean' },
  waitTimeout: duration,
  transaction: { type: 'boolean' },
  // Functions and objects are checked by hand below: JSON Schema cannot describe them.
  scope: {},
  redact: {},
  storeIf: {}
}

/** JSON Schema of the plugin options. */
export const optionsSchema = {
  type: 'object',
  additionalProperties: false,
  properties: {
    ...routeProperties,
    storage: {},
    headerName: { type: 'string', pattern: TOKEN },
    maxKeyLength: { type: 'integer', minimum: 1, maximum: 8192 },
    replayHeader: { anyOf: [{ const: false }, { type: 'string', pattern: TOKEN }] },
    replaySetCookie: { type: 'boolean' },
    excludeHeaders: { type: 'array', items: { type: 'string', pattern: TOKEN } },
    // Buffers: checked by ResponseCipher.
    encryption: {},
    closeTimeout: duration
  }
} as const

/** JSON Schema of a route's `config.idempotency` when it is an object (it may also be `true` or `false`). */
export const routeConfigSchema = {
  type: 'object',
  additionalProperties: false,
  properties: routeProperties
} as const

const ajv = new Ajv({ allErrors: false, strict: true, allowUnionTypes: true })
const validateOptions = ajv.compile(optionsSchema)
const validateRouteConfig = ajv.compile(routeConfigSchema)
/** Whether an option set read back from a stored fingerprint is one these options allow. */
export const isFingerprintOptions = ajv.compile<FingerprintOptions>(fingerprintSchema)

/** The most telling error: the deepest one, and of two equally deep, not a mere type mismatch of an anyOf branch. */
function mostSpecific (errors: ErrorObject[]): ErrorObject {
  const depth = (error: ErrorObject) => error.instancePath.split('/').length * 2 + (error.keyword === 'type' ? 0 : 1)
  return errors.filter((error) => error.keyword !== 'anyOf').reduce((best, error) => (depth(error) > depth(best) ? error : best), errors[0]!)
}

function describeError (error: ErrorObject, root: string): string {
  const where = error.instancePath === '' ? root : error.instancePath.slice(1).replaceAll('/', '.')
  if (error.keyword === 'additionalProperties') return `${where} has an unknown property '${String(error.params.additionalProperty)}'`
  return `${where} ${error.message ?? 'is invalid'}`
}

function check (valid: boolean, errors: ErrorObject[] | null | undefined, context: string, root: string): void {
  if (!valid) throw new TypeError(`fastify-idempotency: invalid ${context}: ${describeError(mostSpecific(errors!), root)}`)
}

export function toMilliseconds (value: number | string, name: string, context: string): number {
  const ms = typeof value === 'number' ? value : parseDuration(value)
  if (ms === undefined || !Number.isFinite(ms) || ms < 1) {
    throw new TypeError(`fastify-idempotency: invalid ${context}: ${name} must be a positive number of milliseconds or a duration such as '24h' (got ${JSON.stringify(value)})`)
  }
  return Math.round(ms)
}

function checkFunctions (options: IdempotencyRouteOptions, context: string): void {
  for (const name of ['scope', 'redact', 'storeIf'] as const) {
    if (options[name] !== undefined && typeof options[name] !== 'function') {
      throw new TypeError(`fastify-idempotency: invalid ${context}: ${name} must be a function of the request`)
    }
  }
}

function checkStorage (storage: unknown): void {
  const methods = ['begin', 'complete', 'release', 'renew'] as const
  const missing = storage === null || typeof storage !== 'object'
    ? methods
    : methods.filter((name) => typeof (storage as Record<string, unknown>)[name] !== 'function')
  if (missing.length > 0) {
    throw new TypeError(`fastify-idempotency: invalid options: storage must implement IdempotencyStorage (missing ${missing.join(', ')})`)
  }
}

function checkTransaction (transaction: boolean, storage: IdempotencyStorage, context: string): boolean {
  if (transaction && typeof (storage as Partial<TransactionalStorage>).transaction !== 'function') {
    throw new TypeError(`fastify-idempotency: invalid ${context}: transaction mode needs a storage that supports transactions (KnexStorage), not ${storage.constructor.name}`)
  }
  return transaction
}

function cacheableSet (base: Iterable<number>, add: number[] = [], remove: number[] = []): Set<number> {
  const set = new Set(base)
  for (const code of add) set.add(code)
  for (const code of remove) set.delete(code)
  return set
}

/**
 * Normalize the plugin options once, at register time, for `storage` (the one given in the
 * options, or the default store the plugin's entry created). Throws a TypeError naming the problem.
 */
export function normalizeOptions (options: IdempotencyOptions, storage: IdempotencyStorage): PluginSettings {
  const context = 'options'
  check(validateOptions(options), validateOptions.errors, context, 'options')
  checkFunctions(options, context)
  checkStorage(storage)
  checkWaitTimeout(options.wait === true, options.waitTimeout, context)
  const replayHeader = options.replayHeader ?? 'Idempotent-Replayed'
  const excluded = new Set(ALWAYS_EXCLUDED_HEADERS)
  if (options.replaySetCookie !== true) excluded.add('set-cookie')
  if (replayHeader !== false) excluded.add(replayHeader.toLowerCase())
  for (const name of options.excludeHeaders ?? []) excluded.add(name.toLowerCase())
  const lockTimeout = toMilliseconds(options.lockTimeout ?? '60s', 'lockTimeout', context)
  return {
    storage,
    headerName: (options.headerName ?? 'Idempotency-Key').toLowerCase(),
    headerLabel: options.headerName ?? 'Idempotency-Key',
    maxKeyLength: options.maxKeyLength ?? 255,
    replayHeader: replayHeader === false ? null : replayHeader,
    excludedHeaders: excluded,
    cipher: options.encryption === undefined ? null : new ResponseCipher(options.encryption),
    defaults: {
      required: options.required ?? false,
      expiration: toMilliseconds(options.expiration ?? '24h', 'expiration', context),
      lockTimeout,
      storeTimeout: toMilliseconds(options.storeTimeout ?? '5s', 'storeTimeout', context),
      ...lockHold(options.maxLockHold === undefined ? null : toMilliseconds(options.maxLockHold, 'maxLockHold', context), lockTimeout, context),
      cacheable: cacheableSet(DEFAULT_CACHEABLE_STATUS_CODES, options.addCacheableStatusCodes, options.removeCacheableStatusCodes),
      fingerprint: normalizeFingerprint(options.fingerprint),
      fingerprintOptions: options.fingerprint ?? {},
      maxResponseBytes: options.maxResponseBytes ?? 1024 * 1024,
      keepUnstorable: options.unstorableResponse !== 'release',
      mismatchStatusCode: options.mismatchStatusCode ?? 409,
      failOpen: options.failOpen ?? false,
      waitTimeout: options.wait === true ? toMilliseconds(options.waitTimeout ?? DEFAULT_WAIT_TIMEOUT, 'waitTimeout', context) : 0,
      transaction: checkTransaction(options.transaction ?? false, storage, context),
      scope: options.scope ?? null,
      redact: options.redact ?? null,
      storeIf: options.storeIf ?? null
    }
  }
}

const DEFAULT_MAX_LOCK_HOLD = 10 * 60_000

/** `maxLockHold` as given, or the default (10 minutes, or lockTimeout when that is longer). */
function lockHold (option: number | null, lockTimeout: number, context: string): { maxLockHold: number, maxLockHoldOption: number | null } {
  if (option !== null && option < lockTimeout) {
    throw new TypeError(`fastify-idempotency: invalid ${context}: maxLockHold (${option} ms) must not be shorter than lockTimeout (${lockTimeout} ms)`)
  }
  return { maxLockHold: option ?? Math.max(DEFAULT_MAX_LOCK_HOLD, lockTimeout), maxLockHoldOption: option }
}

/** A waitTimeout where nothing waits is a mistake worth a start-up error, not a silent no-op. */
function checkWaitTimeout (wait: boolean, waitTimeout: unknown, context: string): void {
  if (!wait && waitTimeout !== undefined) {
    throw new TypeError(`fastify-idempotency: invalid ${context}: waitTimeout is set but wait is not true`)
  }
}

function routeWaitTimeout (base: RouteSettings, route: IdempotencyRouteOptions, context: string): number {
  const wait = route.wait ?? base.waitTimeout > 0
  checkWaitTimeout(wait, route.waitTimeout, context)
  if (!wait) return 0
  if (route.waitTimeout !== undefined) return toMilliseconds(route.waitTimeout, 'waitTimeout', context)
  return base.waitTimeout > 0 ? base.waitTimeout : DEFAULT_WAIT_TIMEOUT
}

/**
 * The settings of one route, from the plugin's and its `config.idempotency`; `null` when the
 * route is not guarded. Throws a TypeError naming the route and the problem.
 */
export function routeSettings (plugin: PluginSettings, config: unknown, routeName: string): RouteSettings | null {
  if (config === false) return null
  const base = plugin.defaults
  if (config === true) return base
  const context = `config.idempotency of route ${routeName}`
  if (config === null || typeof config !== 'object' || Array.isArray(config)) {
    throw new TypeError(`fastify-idempotency: invalid ${context}: it must be true, false or an object of route options`)
  }
  check(validateRouteConfig(config), validateRouteConfig.errors, context, 'config.idempotency')
  const route = config as IdempotencyRouteOptions
  checkFunctions(route, context)
  const fingerprintOptions = { ...base.fingerprintOptions, ...route.fingerprint }
  const lockTimeout = route.lockTimeout === undefined ? base.lockTimeout : toMilliseconds(route.lockTimeout, 'lockTimeout', context)
  return {
    required: route.required ?? base.required,
    expiration: route.expiration === undefined ? base.expiration : toMilliseconds(route.expiration, 'expiration', context),
    lockTimeout,
    storeTimeout: route.storeTimeout === undefined ? base.storeTimeout : toMilliseconds(route.storeTimeout, 'storeTimeout', context),
    ...lockHold(route.maxLockHold === undefined ? base.maxLockHoldOption : toMilliseconds(route.maxLockHold, 'maxLockHold', context), lockTimeout, context),
    cacheable: cacheableSet(base.cacheable, route.addCacheableStatusCodes, route.removeCacheableStatusCodes),
    fingerprint: route.fingerprint === undefined ? base.fingerprint : normalizeFingerprint(fingerprintOptions),
    fingerprintOptions,
    maxResponseBytes: route.maxResponseBytes ?? base.maxResponseBytes,
    keepUnstorable: route.unstorableResponse === undefined ? base.keepUnstorable : route.unstorableResponse !== 'release',
    mismatchStatusCode: route.mismatchStatusCode ?? base.mismatchStatusCode,
    failOpen: route.failOpen ?? base.failOpen,
    waitTimeout: routeWaitTimeout(base, route, context),
    transaction: checkTransaction(route.transaction ?? base.transaction, plugin.storage, context),
    scope: route.scope ?? base.scope,
    redact: route.redact ?? base.redact,
    storeIf: route.storeIf ?? base.storeIf
  }
}
