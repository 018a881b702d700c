/**
 * Which registration of the plugin guards which route, checked across the whole app at `ready`.
 *
 * A registration's `onRoute` hook sees only the routes added after it, in its own context and the
 * contexts below it. A route that sets `config.idempotency` anywhere else would run unguarded with
 * no error and no warning: in a sibling context (the plugin registered inside an encapsulated
 * plugin, such as a file of @fastify/autoload's plugins folder without fastify-plugin), or in the
 * registration's own context but added before it (no `await` on `register`). So every route of
 * the app is watched from its root context, and an app where such a route exists fails to start,
 * naming the route and the fix.
 *
 * Routes are watched from the app's creation when this module was loaded before it (Fastify's
 * `fastify.initialization` diagnostics channel), and otherwise from the first registration on, in
 * the contexts that exist between the root and the registration and every context created later.
 * Every route that answers a method other than GET, HEAD or OPTIONS is watched, and its config is
 * read at `ready`: an `onRoute` hook that runs after the watcher (the app's, or one of a plugin or
 * of @fastify/autoload's autohooks) may set it. State lives under `Symbol.for` keys on Fastify's
 * own objects, so that the ESM and CommonJS builds, both loaded in one process, share it.
 */
import diagnostics from 'node:diagnostics_channel'
import type { FastifyInstance, RouteOptions } from 'fastify'

/** Methods whose requests are never guarded (see hooks.ts): a route of only these is never checked. */
const SAFE = new Set(['GET', 'HEAD', 'OPTIONS'])

/** On a context: a registration of the plugin in that very context. */
const kRegistered = Symbol.for('fastify-idempotency.registered')
/** On a context: the route watcher is one of its own onRoute hooks. */
const kWatching = Symbol.for('fastify-idempotency.watching')
/** On the root context: the app's watched routes. */
const kAppRoutes = Symbol.for('fastify-idempotency.appRoutes')
/** On a route's options: watched already; and a registration guards it. */
const kWatched = Symbol.for('fastify-idempotency.watched')
const kGuarded = Symbol.for('fastify-idempotency.guarded')

type Context = FastifyInstance & { [kRegistered]?: true, [kWatching]?: true, [kAppRoutes]?: AppRoutes }
type Watched = RouteOptions & { [kWatched]?: true, [kGuarded]?: boolean }

interface WatchedRoute {
  options: Watched
  /** Its name when it was added (Fastify changes `url` for the twin of a prefix's '/' route). */
  name: string
  /** The context the route was added in. */
  context: object
  /** A registration in its context (or above) came after it. */
  before: boolean
}

interface AppRoutes {
  routes: WatchedRoute[]
  /** The app's check at ready is installed. */
  checked: boolean
}

/** The root context: Fastify makes each child context with Object.create(parent). */
function rootOf (context: Context): Context {
  let root = context
  for (let parent = Object.getPrototypeOf(root) as Context | null; typeof parent?.addHook === 'function'; parent = Object.getPrototypeOf(parent) as Context | null) root = parent
  return root
}

function appRoutes (context: Context): AppRoutes {
  const root = rootOf(context)
  return (root[kAppRoutes] ??= { routes: [], checked: false })
}

function methodsOf (routeOptions: RouteOptions): string[] {
  return Array.isArray(routeOptions.method) ? routeOptions.method : [routeOptions.method]
}

/** How messages name a route, as the plugin's others do. */
export function routeName (routeOptions: RouteOptions): string {
  return `${methodsOf(routeOptions).join(',')} ${routeOptions.url}`
}

/** An onRoute hook: remember every route that could ask to be guarded, by the time the app starts. */
function watchRoute (this: Context, routeOptions: Watched): void {
  if (routeOptions[kWatched] === true) return
  if (methodsOf(routeOptions).every((method) => SAFE.has(method))) return
  routeOptions[kWatched] = true
  appRoutes(this).routes.push({ options: routeOptions, name: routeName(routeOptions), context: this, before: false })
}

function watch (context: Context): void {
  if (Object.hasOwn(context, kWatching)) return
  context[kWatching] = true
  context.addHook('onRoute', watchRoute)
}

/** Subscribed to Fastify's `fastify.initialization` channel: each app is watched from its creation. */
export function watchNewApp (message: unknown): void {
  watch((message as { fastify: Context }).fastify)
}

diagnostics.subscribe('fastify.initialization', watchNewApp)

/** Refuse to start when a route asks to be guarded and no registration guards it. */
function check (app: AppRoutes): void {
  const problems: string[] = []
  for (const { options, name, before } of app.routes) {
    const config: unknown = options.config?.idempotency
    if (config === undefined || config === false) continue
    if (before) {
      problems.push(`route ${name} was added before the plugin was registered in its context, so that registration does not guard it: register the plugin (with await) before the routes`)
    } else if (options[kGuarded] !== true) {
      problems.push(`route ${name} sets config.idempotency, but no registration of the plugin is in its context or above it: register the plugin on the root instance, or in a context that holds the route (a file of @fastify/autoload's plugins folder that registers it needs fastify-plugin: export default fp(...))`)
    }
  }
  // Nothing can be added after ready.
  app.routes.length = 0
  if (problems.length > 0) throw new Error(`fastify-idempotency: ${problems.length} route(s) would run unguarded:\n- ${problems.join('\n- ')}`)
}

/**
 * A registration of the plugin in `context`: refused if one is there already; from now on every
 * route of the app is watched, and the app checked at ready. Returns what the registration calls
 * for each route it guards (`true`), or no longer guards (`false`).
 */
export function registerIn (context: FastifyInstance): (routeOptions: RouteOptions, guarded: boolean) => void {
  const self = context as Context
  if (Object.hasOwn(self, kRegistered)) {
    throw new Error('fastify-idempotency: the plugin is registered twice in the same context; both would guard the same routes. Register it once per context (a child context may register it again with options of its own)')
  }
  self[kRegistered] = true
  const app = appRoutes(self)
  for (let at: Context | null = self; typeof at?.addHook === 'function'; at = Object.getPrototypeOf(at) as Context | null) watch(at)
  for (const route of app.routes) {
    if (route.context === self || Object.prototype.isPrototypeOf.call(self, route.context)) route.before = true
  }
  if (!app.checked) {
    app.checked = true
    rootOf(self).addHook('onReady', function checkRoutes (done) {
      try {
        check(app)
        done()
      } catch (error) {
        done(error as Error)
      }
    })
  }
  return (routeOptions, guarded) => { (routeOptions as Watched)[kGuarded] = guarded }
}
