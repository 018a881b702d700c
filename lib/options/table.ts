/**
 * Every option, once: the field of the settings it makes, its JSON Schema, and how it is
 * normalized (durations to milliseconds, defaults, what JSON Schema cannot check). The JSON
 * Schemas of the options and of a route's config, and the settings' types, are read from it.
 * Adding an option is one entry here and one property of its public type (types.ts).
 */
import { ResponseCipher } from '../encryption.js'
import { normalizeFingerprint } from '../fingerprint/fingerprint.js'
import { ALWAYS_EXCLUDED_HEADERS } from '../http/excluded-headers.js'
import { checkFunction, checkStorage, checkTransaction, toMilliseconds } from './checks.js'
import { fieldsOf, propertiesOf, type FieldContext, type SettingsOf } from './field.js'
import { anything, boolean, duration, fingerprintSchema, invalid, statusCodes, token, tokens } from './schema.js'
import type { IsolationLevel } from '../storage/types.js'
import type { IdempotencyOptions, IdempotencyRouteOptions } from './types.js'

/**
 * The status codes whose responses are stored by default (`cacheableStatusCodes`).
 * 302 and 303 are the answers of Post/Redirect/Get (`reply.redirect` sends 302): the operation
 * was done and the client is sent to its result, so a retry whose redirect was lost must get the
 * redirect, not run the operation again. 301, 307 and 308 say "do it elsewhere": not kept.
 */
export const DEFAULT_CACHEABLE_STATUS_CODES: readonly number[] = [200, 201, 202, 204, 302, 303]
const DEFAULT_LOCK_TIMEOUT = '60s'
const DEFAULT_MAX_LOCK_HOLD = 10 * 60_000
const DEFAULT_WAIT_TIMEOUT = 10_000
const DEFAULT_HEADER_NAME = 'Idempotency-Key'

const routeField = fieldsOf<IdempotencyRouteOptions>()
const pluginField = fieldsOf<IdempotencyOptions>()

function lockTimeoutOf (options: Pick<IdempotencyRouteOptions, 'lockTimeout'>, context: FieldContext<unknown>): number {
  return toMilliseconds(options.lockTimeout ?? DEFAULT_LOCK_TIMEOUT, 'lockTimeout', context.name)
}

/** `maxLockHold` as given, or the default (10 minutes, or lockTimeout when that is longer). */
function maxLockHoldOf (options: Pick<IdempotencyRouteOptions, 'lockTimeout' | 'maxLockHold'>, context: FieldContext<unknown>): number {
  const lockTimeout = lockTimeoutOf(options, context)
  if (options.maxLockHold === undefined) return Math.max(DEFAULT_MAX_LOCK_HOLD, lockTimeout)
  const maxLockHold = toMilliseconds(options.maxLockHold, 'maxLockHold', context.name)
  if (maxLockHold < lockTimeout) {
    throw invalid(context.name, `maxLockHold (${maxLockHold} ms) must not be shorter than lockTimeout (${lockTimeout} ms)`)
  }
  return maxLockHold
}

/** The status codes stored: the defaults, then each layer's additions and removals in turn. */
function cacheableOf (layers: ReadonlyArray<Pick<IdempotencyRouteOptions, 'addCacheableStatusCodes' | 'removeCacheableStatusCodes'>>): ReadonlySet<number> {
  const set = new Set(DEFAULT_CACHEABLE_STATUS_CODES)
  for (const layer of layers) {
    for (const code of layer.addCacheableStatusCodes ?? []) set.add(code)
    for (const code of layer.removeCacheableStatusCodes ?? []) set.delete(code)
  }
  return set
}

function waitTimeoutOf (options: Pick<IdempotencyRouteOptions, 'wait' | 'waitTimeout'>, context: FieldContext<Pick<IdempotencyRouteOptions, 'waitTimeout'>>): number {
  const wait = options.wait === true
  // A waitTimeout where nothing waits is a mistake worth a start-up error, not a silent no-op.
  if (!wait && context.layer.waitTimeout !== undefined) {
    throw invalid(context.name, 'waitTimeout is set but wait is not true')
  }
  return wait ? toMilliseconds(options.waitTimeout ?? DEFAULT_WAIT_TIMEOUT, 'waitTimeout', context.name) : 0
}

const ISOLATION_LEVELS: readonly IsolationLevel[] = ['read committed', 'repeatable read', 'serializable']

/** Transaction mode as its transaction is opened. */
export interface TransactionSettings {
  /** The level it is opened at; the database's default when absent. */
  readonly isolationLevel?: IsolationLevel
}

/**
 * Transaction mode, or `null`. A layer's `true` keeps the level an outer layer named: a route that
 * turns it on inherits the plugin's `isolationLevel`.
 */
function transactionOf (options: Pick<IdempotencyRouteOptions, 'transaction'>, context: FieldContext<Pick<IdempotencyRouteOptions, 'transaction'>>): TransactionSettings | null {
  if (!checkTransaction(options.transaction !== undefined && options.transaction !== false, context.storage, context.name)) return null
  let isolationLevel: IsolationLevel | undefined
  for (const { transaction } of context.layers) {
    if (typeof transaction === 'object' && transaction.isolationLevel !== undefined) isolationLevel = transaction.isolationLevel
  }
  return isolationLevel === undefined ? {} : { isolationLevel }
}

function replayHeaderOf (options: Pick<IdempotencyOptions, 'replayHeader'>): string | null {
  const header = options.replayHeader ?? 'Idempotent-Replayed'
  return header === false ? null : header
}

function excludedHeadersOf (options: Pick<IdempotencyOptions, 'replayHeader' | 'replaySetCookie' | 'excludeHeaders'>): ReadonlySet<string> {
  const excluded = new Set(ALWAYS_EXCLUDED_HEADERS)
  if (options.replaySetCookie !== true) excluded.add('set-cookie')
  const replayHeader = replayHeaderOf(options)
  if (replayHeader !== null) excluded.add(replayHeader.toLowerCase())
  for (const name of options.excludeHeaders ?? []) excluded.add(name.toLowerCase())
  return excluded
}

/** What a route may set, and the plugin's options set for every route, in the schema's order. */
export const routeFields = {
  required: routeField({ options: { required: boolean }, normalize: (options) => options.required ?? false }),
  expiration: routeField({
    options: { expiration: duration },
    normalize: (options, context) => toMilliseconds(options.expiration ?? '24h', 'expiration', context.name)
  }),
  lockTimeout: routeField({ options: { lockTimeout: duration }, normalize: lockTimeoutOf }),
  maxLockHold: routeField({ options: { maxLockHold: duration }, uses: ['lockTimeout'], normalize: maxLockHoldOf }),
  storeTimeout: routeField({
    options: { storeTimeout: duration },
    normalize: (options, context) => toMilliseconds(options.storeTimeout ?? '5s', 'storeTimeout', context.name)
  }),
  cacheable: routeField({
    options: { addCacheableStatusCodes: statusCodes, removeCacheableStatusCodes: statusCodes },
    normalize: (_options, context) => cacheableOf(context.layers)
  }),
  /** A route's `fingerprint` object is merged over the plugin's. */
  fingerprint: routeField({
    options: { fingerprint: fingerprintSchema },
    normalize: (_options, context) => normalizeFingerprint(Object.assign({}, ...context.layers.map((layer) => layer.fingerprint)))
  }),
  maxResponseBytes: routeField({
    options: { maxResponseBytes: { type: 'integer', minimum: 0 } },
    normalize: (options) => options.maxResponseBytes ?? 1024 * 1024
  }),
  /** Store the outcome of a response whose body cannot be kept, instead of freeing the key. */
  keepUnstorable: routeField({
    options: { unstorableResponse: { enum: ['outcome', 'release'] } },
    normalize: (options) => options.unstorableResponse !== 'release'
  }),
  mismatchStatusCode: routeField({
    options: { mismatchStatusCode: { enum: [409, 422] } },
    normalize: (options) => options.mismatchStatusCode ?? 409
  }),
  failOpen: routeField({ options: { failOpen: boolean }, normalize: (options) => options.failOpen ?? false }),
  /** Milliseconds a duplicate of an in-flight request waits; 0 answers 409 at once. */
  waitTimeout: routeField({ options: { wait: boolean, waitTimeout: duration }, normalize: waitTimeoutOf }),
  /** Open a StorageTransaction for the handler (transaction mode), at its isolation level; `null`: not in transaction mode. */
  transaction: routeField({
    options: { transaction: { anyOf: [boolean, { type: 'object', additionalProperties: false, properties: { isolationLevel: { enum: ISOLATION_LEVELS } } }] } },
    normalize: transactionOf
  }),
  /** Where the route's key comes from instead of the header; `null`: the header. */
  key: routeField({
    options: { key: anything },
    check: (layer, context) => checkFunction(layer.key, 'key', context.name),
    normalize: (options) => options.key ?? null
  }),
  scope: routeField({
    options: { scope: anything },
    check: (layer, context) => checkFunction(layer.scope, 'scope', context.name),
    normalize: (options) => options.scope ?? null
  }),
  redact: routeField({
    options: { redact: anything },
    check: (layer, context) => checkFunction(layer.redact, 'redact', context.name),
    normalize: (options) => options.redact ?? null
  }),
  storeIf: routeField({
    options: { storeIf: anything },
    check: (layer, context) => checkFunction(layer.storeIf, 'storeIf', context.name),
    normalize: (options) => options.storeIf ?? null
  })
}

/** What only the plugin's options set, in the schema's order. */
export const pluginFields = {
  /** The store every route of this registration uses: the options', or the one the plugin made. */
  storage: pluginField({
    options: { storage: anything },
    check: (_layer, context) => checkStorage(context.storage),
    normalize: (_options, context) => context.storage
  }),
  /** Ask the store at start-up whether it can work, and fail the start when it cannot. */
  checkStore: pluginField({ options: { checkStore: boolean }, normalize: (options) => options.checkStore ?? true }),
  /** The key header's name, lower-cased, for lookups. */
  headerName: pluginField({ options: { headerName: token }, normalize: (options) => (options.headerName ?? DEFAULT_HEADER_NAME).toLowerCase() }),
  /** The same as the user wrote it, for messages. */
  headerLabel: pluginField({ options: {}, uses: ['headerName'], normalize: (options) => options.headerName ?? DEFAULT_HEADER_NAME }),
  maxKeyLength: pluginField({
    options: { maxKeyLength: { type: 'integer', minimum: 1, maximum: 8192 } },
    normalize: (options) => options.maxKeyLength ?? 255
  }),
  replayHeader: pluginField({
    options: { replayHeader: { anyOf: [{ const: false }, token] } },
    normalize: replayHeaderOf
  }),
  /** Response headers never stored nor replayed, lower-cased. */
  excludedHeaders: pluginField({
    options: { replaySetCookie: boolean, excludeHeaders: tokens },
    uses: ['replayHeader'],
    normalize: excludedHeadersOf
  }),
  /** Seals stored responses and hashes storage keys; `null` without `encryption` (its Buffers are checked by ResponseCipher). */
  cipher: pluginField({
    options: { encryption: anything },
    normalize: (options) => options.encryption === undefined ? null : new ResponseCipher(options.encryption)
  })
}

/**
 * Options with a schema here but normalized where what they depend on is known: `closeTimeout`
 * by http/shutdown.ts, against the server's pluginTimeout.
 */
export const normalizedElsewhere = { closeTimeout: duration } as const

/** What may differ from route to route, normalized once when the route is added. */
export type RouteSettings = SettingsOf<typeof routeFields>

/** What the plugin's options fix for every route, normalized once at register time. */
export interface PluginSettings extends SettingsOf<typeof pluginFields> {
  /** The route settings a route with `config.idempotency: true` gets, and an object overrides. */
  defaults: RouteSettings
}

/** JSON Schema of a route's `config.idempotency` when it is an object (it may also be `true` or `false`). */
export const routeConfigSchema = {
  type: 'object',
  additionalProperties: false,
  properties: propertiesOf(routeFields)
} as const

/** JSON Schema of the plugin options. */
export const optionsSchema = {
  type: 'object',
  additionalProperties: false,
  properties: { ...routeConfigSchema.properties, ...propertiesOf(pluginFields), ...normalizedElsewhere }
} as const
