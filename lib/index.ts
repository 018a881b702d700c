/**
 * fastify-idempotency: the plugin. Options are normalized once here; `onRoute` gives each route
 * that sets `config.idempotency` its own hooks, and routes without it carry none.
 */
import type { FastifyPluginAsync, RouteOptions } from 'fastify'
import fp from 'fastify-plugin'
import { createRouteHooks, kState, type IdempotencyRequestContext } from './lifecycle.js'
import { documentRoute } from './openapi.js'
import { normalizeOptions, routeSettings, type IdempotencyOptions, type IdempotencyRouteOptions } from './options.js'

declare module 'fastify' {
  interface FastifyContextConfig {
    /** Guard this route: `true` with the plugin's options, or per-route overrides. */
    idempotency?: boolean | IdempotencyRouteOptions
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
  const base = normalizeOptions(options)
  // A second registration (in another encapsulated context, say) shares the decoration.
  if (!fastify.hasRequestDecorator(kState as unknown as string)) {
    fastify.decorateRequest(kState as unknown as string, null)
    fastify.decorateRequest('idempotency', null)
  }

  // Every route's lease renewal, stopped when the server closes.
  const renewals: Array<{ stop: () => void }> = []

  fastify.addHook('onRoute', function (routeOptions) {
    const config = routeOptions.config?.idempotency
    if (config === undefined) return
    const method = Array.isArray(routeOptions.method) ? routeOptions.method.join(',') : routeOptions.method
    const settings = routeSettings(base, config, `${method} ${routeOptions.url}`)
    if (settings === null) return
    const hooks = createRouteHooks(settings)
    renewals.push(hooks.renewal)
    // Only when @fastify/swagger is there to read it: a header schema also means validation work.
    if (this.hasDecorator('swagger')) documentRoute(routeOptions, settings)
    // Registered again in a child context, the innermost registration (whose onRoute runs last)
    // replaces the outer one's hooks: a route must never go through the plugin twice.
    const route = routeOptions as GuardedRoute
    const replaced = route[kRouteHooks] ?? []
    route[kRouteHooks] = [hooks.onRequest, hooks.preHandler, hooks.onSend, hooks.onError]
    // Ours go last, so the route's own onRequest/preHandler hooks (authentication, say) run first
    // and a replay is never served to a request they would have refused.
    routeOptions.onRequest = appendHook(routeOptions.onRequest, hooks.onRequest, replaced) as RouteOptions['onRequest']
    routeOptions.preHandler = appendHook(routeOptions.preHandler, hooks.preHandler, replaced) as RouteOptions['preHandler']
    routeOptions.onSend = appendHook(routeOptions.onSend, hooks.onSend, replaced) as RouteOptions['onSend']
    routeOptions.onError = appendHook(routeOptions.onError, hooks.onError, replaced) as RouteOptions['onError']
  })

  fastify.addHook('onClose', async () => {
    for (const renewal of renewals) renewal.stop()
    // Close only a store the plugin created itself.
    if (options.storage === undefined) await base.storage.close?.()
  })
}

/** The plugin, for `fastify.register(idempotency, options)`. */
export const idempotency = fp(plugin, { fastify: '5.x', name: 'fastify-idempotency' })
export default idempotency

export type { IdempotencyOptions, IdempotencyRouteOptions } from './options.js'
export { DEFAULT_CACHEABLE_STATUS_CODES, optionsSchema, routeConfigSchema } from './options.js'
export type { FingerprintOptions } from './fingerprint.js'
export type { IdempotencyRequestContext } from './lifecycle.js'
export {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyKeyInvalidError,
  IdempotencyKeyMissingError,
  IdempotencyRequestInProgressError,
  IdempotencyStoreUnavailableError,
  isIdempotencyError,
  PROBLEM_TYPE_BASE
} from './errors.js'
export { idempotencyErrorHandler, toProblem } from './error-handler.js'
export type { ErrorHandler, IdempotencyErrorHandlerOptions, IdempotencyProblem } from './error-handler.js'
export { CHANNEL_PREFIX, channels } from './diagnostics.js'
export type { IdempotencyEvent, IdempotencyOutcome } from './diagnostics.js'
export { MemoryStorage } from './storage/memory.js'
export type { MemoryStorageOptions } from './storage/memory.js'
export type {
  BeginAcquired,
  BeginCompleted,
  BeginInFlight,
  BeginResult,
  IdempotencyStorage,
  StorageTransaction,
  StoredResponse,
  TransactionalStorage
} from './storage/types.js'
