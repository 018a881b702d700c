/**
 * What a registration of the plugin does to each route of its context and the contexts below it:
 * give the route the hooks of its final `config.idempotency`, whatever set that config (the route's
 * options, or an `onRoute` hook of the app, of @fastify/autoload's per-folder autohooks, of any
 * plugin, added before or after this one).
 *
 * How Fastify builds a route, in 5 and in 6 alike (lib/route.js): it runs the route's `onRoute`
 * hooks in the order they were added, makes the route's context, with a copy of the config as
 * the hooks left it, right after the last one, queues an `after` of its own, and reads the route's
 * lifecycle hooks from its options only when the app starts (at avvio's `preReady`, in that
 * `after`). So this registration's `onRoute` hook does two things. A config the route has already
 * is read at once: a bad one throws where the route is added, and the hooks go where the route's
 * own and those of plugins registered earlier can run first. Then, because a hook that runs after
 * this one may still set, change or take away the config, it queues an `after` of its own (one for
 * the routes a context adds in a row), which runs once every `onRoute` hook of those routes has and
 * before the app starts: it reads the config again, and when it is not the one the route's hooks
 * were made from, it takes them away and adds those of the final config, or none. Routes without the flag get no hook: their requests cost what they cost
 * without the plugin. Registered again in a child context, the innermost registration (whose
 * `onRoute` hook runs last) is the one that guards: a route never goes through the plugin twice.
 */
import type { FastifyBaseLogger, FastifyInstance, RouteOptions } from 'fastify'
import type { InFlight } from '../engine/in-flight.js'
import { copyOf, routeSettings, type PluginSettings } from '../options.js'
import { createRouteHooks, SAFE_METHODS, type RouteHooks } from './hooks.js'
import { recordDocumentation } from './openapi.js'
import { routeName } from './registration.js'

/** One registration of the plugin, as its routes need it. */
export interface Registration {
  readonly settings: PluginSettings
  readonly inFlight: InFlight
  /** The hooks of the routes it guards, whose timers stop when the server closes. */
  readonly hooks: Set<RouteHooks>
  /** Tell the app-wide check that the route is guarded (`true`), or no longer (`false`). */
  readonly mark: (routeOptions: RouteOptions, guarded: boolean) => void
  readonly log: FastifyBaseLogger
  /** Tell the start-up check that a guarded route waits for keys in flight (its signal is then proven). */
  readonly waits: () => void
}

/** On a route's options: which registration guards it, from which config, with which hooks. */
const kGuard = Symbol('fastify-idempotency.guard')
/** On a route's options: the innermost registration that saw it, the one that decides. */
const kOwner = Symbol('fastify-idempotency.owner')

interface Guard {
  readonly registration: Registration
  /** The config the hooks were made from, and a copy of its data, to tell a change made in place. */
  readonly config: unknown
  readonly data: unknown
  readonly hooks: RouteHooks
}

type Route = RouteOptions & { [kGuard]?: Guard, [kOwner]?: Registration }

type HookName = 'onRequest' | 'preValidation' | 'preHandler' | 'onSend' | 'onError'

/** A route waiting for its final config: its name and URL as it was added (see registration.ts). */
interface Pending {
  readonly route: Route
  readonly name: string
  readonly url: string
}

/** Guard the routes `fastify`'s context and those below it add from now on. */
export function guardRoutes (fastify: FastifyInstance, registration: Registration): void {
  // Per context, the routes added since its last look: one `after` looks at all of them, since
  // routes are usually added many in a row (an `after` costs avvio a turn of its queue).
  const waiting = new WeakMap<FastifyInstance, Pending[]>()
  fastify.addHook('onRoute', function (routeOptions) {
    const route = routeOptions as Route
    const methods = Array.isArray(route.method) ? route.method : [route.method]
    const name = routeName(route)
    if (methods.every((method) => SAFE_METHODS.has(method))) {
      warnOfSafeMethods(registration, route, methods, name)
      return
    }
    route[kOwner] = registration
    const url = route.url
    if (route.config?.idempotency !== undefined) guard(registration, route, name, url)
    let pending = waiting.get(this)
    if (pending === undefined) {
      const routes: Pending[] = pending = []
      waiting.set(this, routes)
      // A zero-argument function: avvio passes on an error of the plugins before it, and fails the
      // start with one it rejects with. It runs once the routes added in a row are, each with all
      // its onRoute hooks run, and before the app starts.
      this.after(async () => {
        waiting.delete(this)
        for (const { route, name, url } of routes) {
          if (route[kOwner] !== registration) continue
          guard(registration, route, name, url)
          const current = route[kGuard]
          if (current !== undefined) placeLast(route, current.hooks)
        }
      })
    }
    pending.push({ route, name, url })
  })
}

function warnOfSafeMethods (registration: Registration, route: Route, methods: string[], name: string): void {
  const config: unknown = route.config?.idempotency
  // Fastify's automatic HEAD route of a GET route comes here too, with the GET's config.
  if (config === undefined || config === false || methods.every((method) => method === 'HEAD')) return
  registration.log.warn(`fastify-idempotency: route ${name} is not guarded: ${methods.join(', ')} requests are safe to retry as they are, so their Idempotency-Key is ignored`)
}

/** Give the route the hooks of its config as it stands, unless it has them already. */
function guard (registration: Registration, route: Route, name: string, url: string): void {
  const config: unknown = route.config?.idempotency
  const current = route[kGuard]
  if (current !== undefined && current.registration === registration && current.config === config && sameData(current.data, config)) return
  if (current !== undefined) unguard(route, current)
  if (config === undefined) return
  const settings = routeSettings(registration.settings, config, name)
  if (settings === null) return
  if (settings.waitTimeout > 0) registration.waits()
  const methods = Array.isArray(route.method) ? route.method : [route.method]
  const hooks = createRouteHooks(registration.settings, settings, url, methods.some((method) => SAFE_METHODS.has(method)), registration.inFlight)
  registration.hooks.add(hooks)
  route[kGuard] = { registration, config, data: copyOf(config), hooks }
  registration.mark(route, true)
  recordDocumentation(route, { ...registration.settings, ...settings })
  // Ours go last, so the route's own onRequest/preHandler hooks (authentication, say) run first
  // and a replay is never served to a request they would have refused; placeLast puts them last
  // again once every onRoute hook has run.
  add(route, 'onRequest', hooks.onRequest)
  // The body is fingerprinted as it arrived: before validation changes it, and before the route's
  // own preHandler hooks do (with a schema or without, so that the outcome never depends on it).
  add(route, 'preValidation', hooks.preValidation)
  add(route, 'preHandler', hooks.preHandler)
  add(route, 'onSend', hooks.onSend)
  add(route, 'onError', hooks.onError)
}

/**
 * Once every `onRoute` hook of the route has run (the app's, and those of plugins registered after
 * this one, @fastify/rate-limit's or an auth plugin's, which add theirs at the end of the route's
 * lists): the guard's request hooks are moved to the end of theirs, so that every hook the app
 * attached to the route, in whichever order, runs before the plugin replays, takes a lease or
 * refuses. Fastify runs the hooks of the route's contexts (`addHook`) before those of its options,
 * so those run first anyway. The body is taken in the plugin's preValidation, before validation
 * and before the route's preHandler hooks, whatever set the route's schema (its options, or an
 * `onRoute` hook after this one) and whether it has one.
 * `onSend` and `onError` stay where they were added: what they see of the response is documented
 * by the order of registration (docs/headers.md).
 */
function placeLast (route: Route, hooks: RouteHooks): void {
  // An onRoute hook after this one may have set the route's onSend or onError by assignment
  // (`route.onSend = hook`), taking the plugin's away with the rest: without them no answer would
  // be captured, and a failed request would be stored. They are put back: the onSend before the
  // assigned hooks, which were added after it.
  const sends = hookList(route, 'onSend')
  const restored = sends.includes(hooks.onSend) ? sends : [hooks.onSend, ...sends]
  const errors = hookList(route, 'onError')
  if (!errors.includes(hooks.onError)) (route as Record<HookName, unknown>).onError = [...errors, hooks.onError]
  // When onSend hooks of the route run after the plugin's, the last one settles what needs to see
  // the payload Fastify sends (how the head goes out, head-bytes.ts).
  const others = restored.filter((hook) => hook !== hooks.finalOnSend)
  const later = others[others.length - 1] !== hooks.onSend
  hooks.laterOnSend(later)
  if (later || others.length !== sends.length) (route as Record<HookName, unknown>).onSend = later ? [...others, hooks.finalOnSend] : others
  for (const name of ['onRequest', 'preValidation', 'preHandler'] as const) {
    const existing = hookList(route, name)
    const others = existing.filter((hook) => hook !== hooks[name])
    if (existing[existing.length - 1] === hooks[name] && others.length === existing.length - 1) continue
    ;(route as Record<HookName, unknown>)[name] = [...others, hooks[name]]
  }
}

/** Whether `value` holds the same data as `copy` (made by copyOf): a hook may change a config in place. */
function sameData (copy: unknown, value: unknown): boolean {
  if (copy === value) return true
  if (copy === null || value === null || typeof copy !== 'object' || typeof value !== 'object') return false
  if (Array.isArray(copy)) return Array.isArray(value) && copy.length === value.length && copy.every((item, index) => sameData(item, value[index]))
  const names = Object.keys(copy)
  return names.length === Object.keys(value).length && names.every((name) => Object.hasOwn(value, name) && sameData((copy as Record<string, unknown>)[name], (value as Record<string, unknown>)[name]))
}

/** Take a guard's hooks away from the route. */
function unguard (route: Route, { registration, hooks }: Guard): void {
  route[kGuard] = undefined
  registration.hooks.delete(hooks)
  hooks.stop()
  registration.mark(route, false)
  recordDocumentation(route, null)
  for (const name of ['onRequest', 'preValidation', 'preHandler', 'onSend', 'onError'] as const) {
    const existing = hookList(route, name)
    const kept = existing.filter((hook) => hook !== hooks[name] && hook !== hooks.finalOnSend)
    if (kept.length !== existing.length) (route as Record<HookName, unknown>)[name] = kept
  }
}

/** A route's hook option (absent, one function or an array) as an array. */
function hookList (route: Route, name: HookName): unknown[] {
  const existing: unknown = route[name]
  return existing === undefined ? [] : Array.isArray(existing) ? existing : [existing]
}

function add (route: Route, name: HookName, hook: unknown): void {
  (route as Record<HookName, unknown>)[name] = [...hookList(route, name), hook]
}
