/**
 * The plugin (the default export), `idempotencyErrorHandler`, `MemoryStorage`, the errors with
 * their type guards, the diagnostics channels, and the types of the options and of the storage
 * interface. See docs/README.md.
 *
 * @module fastify-idempotency
 */
/**
 * fastify-idempotency: the plugin. Options are normalized once here; each route whose final
 * config sets `config.idempotency` gets its own hooks (http/route-guard.ts), and routes without it
 * carry none.
 */
import type { FastifyPluginAsync } from 'fastify'
import fp from 'fastify-plugin'
import { kState, type IdempotencyRequestContext, type RouteHooks } from './http/hooks.js'
import { InFlight } from './engine/in-flight.js'
import { loggerAudit } from './operations/audit.js'
import { Idempotency, type IdempotencyApi } from './run/idempotency.js'
import { normalizeOptions, type IdempotencyOptions, type IdempotencyRouteOptions } from './options.js'
import { registerIn } from './http/registration.js'
import { guardRoutes } from './http/route-guard.js'
import { closeTimeoutOption, waitForRequestsOnClose } from './http/shutdown.js'
import { checkStoreWhenReady } from './http/store-check.js'
import { MemoryStorage } from './storage/memory.js'

declare module 'fastify' {
  interface FastifyContextConfig {
    /** Guard this route: `true` with the plugin's options, or per-route overrides. */
    idempotency?: boolean | IdempotencyRouteOptions
  }
  interface FastifyInstance {
    /**
     * `run`, the plugin's guarantees for any function (a job, a message, docs/jobs.md), and the
     * operations on stored keys (inspect, forget, inFlight, purge, docs/operations.md). The first
     * registration in scope provides it.
     */
    idempotency: IdempotencyApi
  }
  interface FastifyRequest {
    /** On a guarded route, for a request with an Idempotency-Key: its key and, in transaction mode, its transaction. Otherwise `null`. */
    idempotency: IdempotencyRequestContext | null
  }
}

const plugin: FastifyPluginAsync<IdempotencyOptions> = async (fastify, options) => {
  // Without a store in the options, the plugin makes the default one, and so owns it: it closes it
  // with the server. A store given in the options belongs to whoever made it.
  const ownStorage = options.storage === undefined ? new MemoryStorage() : null
  const settings = normalizeOptions(options, options.storage ?? ownStorage!)
  const closeTimeout = closeTimeoutOption(options.closeTimeout, fastify.initialConfig.pluginTimeout ?? 0)
  const mark = registerIn(fastify)
  // Whether any route waits for keys in flight: the store's signal is then proven at start too.
  let waits = settings.defaults.waitTimeout > 0
  if (settings.checkStore) checkStoreWhenReady(fastify, settings.storage, settings.defaults.storeTimeout, () => waits)
  // A second registration (in another encapsulated context, say) shares the decoration.
  if (!fastify.hasRequestDecorator(kState as unknown as string)) {
    fastify.decorateRequest(kState as unknown as string, null)
    fastify.decorateRequest('idempotency', null)
  }
  const inFlight = new InFlight()
  waitForRequestsOnClose(fastify, inFlight, closeTimeout)
  const api = fastify.hasDecorator('idempotency') ? null : new Idempotency(settings, loggerAudit(fastify.log), fastify.log, inFlight)
  if (api !== null) fastify.decorate('idempotency', api)
  // The hooks of every route this registration guards, whose timers (and `run`'s) stop when the server closes.
  const hooks = new Set<RouteHooks>()
  guardRoutes(fastify, { settings, inFlight, hooks, mark, log: fastify.log, waits: () => { waits = true } })

  fastify.addHook('onClose', async () => {
    api?.stop()
    for (const route of hooks) route.stop()
    await ownStorage?.close()
  })
}

/** The plugin, for `fastify.register(idempotency, options)`. */
export const idempotency = fp(plugin, { fastify: '5.x || 6.x', name: 'fastify-idempotency' })
export default idempotency

export type { IdempotencyOptions, IdempotencyRouteOptions, IdempotencyTransactionOptions } from './options.js'
export { DEFAULT_CACHEABLE_STATUS_CODES, optionsSchema, routeConfigSchema } from './options.js'
export type { FingerprintOptions } from './fingerprint/fingerprint.js'
export type { IdempotencyRequestContext } from './http/hooks.js'
export type { StepContext, StepFunction } from './engine/steps.js'
export type { IdempotencyApi, RunOptions } from './run/idempotency.js'
export type { RunContext, RunFunction } from './run/function-run.js'
export { retryDecision, type RetryDecision } from './run/retry-decision.js'
export { runScope } from './engine/storage-key.js'
export type { ValueCodec } from './engine/value-codec.js'
export {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyKeyMissingError,
  IdempotencyLeaseLostError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyScopeError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError,
  isIdempotencyError,
  PROBLEM_TYPE_BASE
} from './errors.js'
export { idempotencyErrorHandler, toProblem } from './error-handler.js'
export { idempotencyTransform } from './http/openapi.js'
export type { TransformInput, TransformResult } from './http/openapi.js'
export {
  BodyNestedTooDeeplyError,
  BodyTooLargeError,
  isBodyNestedTooDeeplyError,
  isBodyTooLargeError,
  isStoreContentionError,
  isStoreTimeoutError,
  isUnreadableEntryError,
  StoreContentionError,
  StoreTimeoutError
} from './error-causes.js'
export type { ErrorHandler, IdempotencyErrorHandlerOptions, IdempotencyProblem } from './error-handler.js'
export { CHANNEL_PREFIX, channels, operationChannels, storeCheckChannel } from './diagnostics.js'
export type { IdempotencyEvent, IdempotencyOperation, IdempotencyOperationEvent, IdempotencyOutcome, IdempotencyStoreCheckEvent } from './diagnostics.js'
export { IdempotencyOperationNotSupportedError } from './operations/index.js'
export type {
  ForgetOptions,
  ForgetResult,
  HeldKey,
  IdempotencyOperations,
  InFlightListing,
  InFlightOptions,
  Inspection,
  InFlightInspection,
  KeyOptions,
  KeyRef,
  OperationOptions,
  PurgeOptions,
  StoredInspection
} from './operations/index.js'
export { scopeByHeader } from './http/scope.js'
export { NO_CALLER_SCOPE } from './engine/storage-key.js'
export type { Scope } from './http/scope.js'
export type { EncryptionOptions } from './encryption.js'
export type { KeySource, Redact, StoreIf } from './options.js'
export { MemoryStorage } from './storage/memory.js'
export { UnreadableEntryError } from './storage/unreadable-entry.js'
export type { MemoryStorageOptions } from './storage/memory.js'
export type {
  BeginAcquired,
  BeginCompleted,
  BeginInFlight,
  BeginResult,
  HeldLease,
  IdempotencyStorage,
  IsolationLevel,
  LeaseListing,
  StorageTransaction,
  StoredCompleted,
  StoredInFlight,
  StoredAbsent,
  StoredResponse,
  StoredState,
  StorageForgetOptions,
  StoragePurgeOptions,
  StorageForgetResult,
  StoreCheck,
  StoreProofOptions,
  TransactionalStorage,
  TransactionLease,
  TransactionOptions
} from './storage/types.js'
