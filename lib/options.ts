/**
 * Options and route config: their types, their JSON Schema, and normalizing them once, at
 * register time and at route time. The option table is lib/options/table.ts.
 */
export type { IdempotencyOptions, IdempotencyRouteOptions, IdempotencyTransactionOptions, KeySource, Redact, StoreIf } from './options/types.js'
export type { PluginSettings, RouteSettings, TransactionSettings } from './options/table.js'
export { DEFAULT_CACHEABLE_STATUS_CODES, optionsSchema, routeConfigSchema } from './options/table.js'
export { fingerprintSchema, isFingerprintOptions } from './options/schema.js'
export { toMilliseconds } from './options/checks.js'
export { copyOf, givenRouteOptions, normalizeOptions, routeSettings } from './options/normalize.js'
