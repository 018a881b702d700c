/**
 * The plugin (the default export), `idempotencyErrorHandler`, `MemoryStorage`, the errors with
 * their type guards, the diagnostics channels, and the types of the options and of the storage
 * interface. See docs/README.md.
 *
 * @module fastify-idempotency
 */
/**
 * fastify-idempotency: the plugin. Options are normalized once here; `onRoute` gives each route
 * that sets `config.idempotency` its own hooks, and routes without it carry none.
 */
import type { FastifyPluginAsync, RouteOptions } from 'fastify'
import fp from 'fastify-plugin'
import { createRouteHooks, kState, SAFE_METHODS, type IdempotencyRequestContext } from './http/hooks.js'
import { InFlight } from './engine/in-flight.js'
import { documentRoute } from './http/openapi.js'
import { loggerAudit } from './operations/audit.js'
import { Idempotency, type IdempotencyApi } from './run/idempotency.js'
import { normalizeOptions, routeSettings, type IdempotencyOptions, type IdempotencyRouteOptions } from './options.js'
import { registerIn, routeName } from './http/registration.js'
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

/** The hooks a registration of the plugin put on a route, so a later registration can replace them. */
const kRouteHooks = Symbol('fastify-idempotency.routeHooks')
type GuardedRoute = RouteOptions & { [kRouteHooks]?: unknown[] }

/** A route's hook option (absent, one function or an array) with ours added last and `replaced` taken out. */
function appendHook<T> (existing: T | T[] | undefined, hook: T, replaced: unknown[] = []): T[] {
  const hooks = existing === undefined ? [] : Array.isArray(existing) ? existing : [existing]
  return [...hooks.filter((item) => !replaced.includes(item)), hook]
}

const plugin: FastifyPluginAsync<IdempotencyOptions> = async (fastify, options) => {
  // Without a store in the options, the plugin makes the default one, and so owns it: it closes it
  // with the server. A store given in the options belongs to whoever made it.
  const ownStorage = options.storage === undefined ? new MemoryStorage() : null
  const settings = normalizeOptions(options, options.storage ?? ownStorage!)
  const closeTimeout = closeTimeoutOption(options.closeTimeout, fastify.initialConfig.pluginTimeout ?? 0)
  const guard = registerIn(fastify)
  if (settings.checkStore) checkStoreWhenReady(fastify, settings.storage, settings.defaults.storeTimeout)
  // A second registration (in another encapsulated context, say) shares the decoration.
  if (!fastify.hasRequestDecorator(kState as unknown as string)) {
    fastify.decorateRequest(kState as unknown as string, null)
    fastify.decorateRequest('idempotency', null)
  }
  // Every guarded route's hooks (and `run`'s engines), whose timers stop when the server closes.
  const guarded: Array<{ stop: () => void }> = []
  const inFlight = new InFlight()
  waitForRequestsOnClose(fastify, inFlight, closeTimeout)
  if (!fastify.hasDecorator('idempotency')) {
    const api = new Idempotency(settings, loggerAudit(fastify.log), fastify.log, inFlight)
    guarded.push(api)
    fastify.decorate('idempotency', api)
  }

  fastify.addHook('onRoute', function (routeOptions) {
    const config = routeOptions.config?.idempotency
    if (config === undefined) return
    guard(routeOptions)
    const methods = Array.isArray(routeOptions.method) ? routeOptions.method : [routeOptions.method]
    const name = routeName(routeOptions)
    const route = routeSettings(settings, config, name)
    if (route === null) return
    const safe = methods.filter((method) => SAFE_METHODS.has(method))
    if (safe.length === methods.length) {
      // Fastify's automatic HEAD route of a GET route comes here too, with the GET's config.
      if (!methods.every((method) => method === 'HEAD')) {
        this.log.warn(`fastify-idempotency: route ${name} is not guarded: ${safe.join(', ')} requests are safe to retry as they are, so their Idempotency-Key is ignored`)
      }
      return
    }
    const hooks = createRouteHooks(settings, route, routeOptions.url, safe.length > 0, inFlight)
    guarded.push(hooks)
    // Only when @fastify/swagger is there to read it: a header schema also means validation work.
    if (this.hasDecorator('swagger')) documentRoute(routeOptions, { ...settings, ...route })
    // Registered again in a child context, the innermost registration (whose onRoute runs last)
    // replaces the outer one's hooks: a route must never go through the plugin twice.
    const guardedRoute = routeOptions as GuardedRoute
    const replaced = guardedRoute[kRouteHooks] ?? []
    guardedRoute[kRouteHooks] = [hooks.onRequest, hooks.preValidation, hooks.preHandler, hooks.onSend, hooks.onError]
    // Ours go last, so the route's own onRequest/preHandler hooks (authentication, say) run first
    // and a replay is never served to a request they would have refused.
    routeOptions.onRequest = appendHook(routeOptions.onRequest, hooks.onRequest, replaced) as RouteOptions['onRequest']
    // The body is fingerprinted as it arrived: where a schema may change it, before validation.
    if (routeOptions.schema?.body !== undefined) routeOptions.preValidation = appendHook(routeOptions.preValidation, hooks.preValidation, replaced) as RouteOptions['preValidation']
    routeOptions.preHandler = appendHook(routeOptions.preHandler, hooks.preHandler, replaced) as RouteOptions['preHandler']
    routeOptions.onSend = appendHook(routeOptions.onSend, hooks.onSend, replaced) as RouteOptions['onSend']
    routeOptions.onError = appendHook(routeOptions.onError, hooks.onError, replaced) as RouteOptions['onError']
  })

  fastify.addHook('onClose', async () => {
    for (const hooks of guarded) hooks.stop()
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
export type { ValueCodec } from './engine/value-codec.js'
export {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyKeyMissingError,
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
export { CHANNEL_PREFIX, channels, operationChannels } from './diagnostics.js'
export type { IdempotencyEvent, IdempotencyOperation, IdempotencyOperationEvent, IdempotencyOutcome } from './diagnostics.js'
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
  TransactionalStorage,
  TransactionLease,
  TransactionOptions
} from './storage/types.js'
