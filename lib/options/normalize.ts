/**
 * Normalizing options once, at register time and at route time, so that a typo fails at
 * start-up with a clear message, never at a request. The plugin's options and a route's
 * `config.idempotency` go through the same fields (table.ts): a route is a layer over the plugin.
 */
import type { IdempotencyStorage } from '../storage/types.js'
import { checkFields, normalizeFields } from './field.js'
import { invalid, schemaCheck } from './schema.js'
import { optionsSchema, pluginFields, routeConfigSchema, routeFields, type PluginSettings, type RouteSettings } from './table.js'
import type { IdempotencyOptions, IdempotencyRouteOptions } from './types.js'

const checkOptions = schemaCheck(optionsSchema, 'options')
const checkRouteConfig = schemaCheck(routeConfigSchema, 'config.idempotency')
const routeOptionNames = Object.keys(routeConfigSchema.properties)

/**
 * The plugin's route options of each registration, by its default route settings: what a route's
 * options are laid over. A copy, so that changing the options object after registering changes
 * nothing, kept out of the settings, which hold only what requests use.
 */
const pluginLayers = new WeakMap<RouteSettings, IdempotencyRouteOptions>()

/**
 * Normalize the plugin options once, at register time, for `storage` (the one given in the
 * options, or the default store the plugin's entry created). Throws a TypeError naming the problem.
 */
export function normalizeOptions (options: IdempotencyOptions, storage: IdempotencyStorage): PluginSettings {
  const context = { name: 'options', storage }
  checkOptions(options, context.name)
  checkFields(routeFields, options, context)
  checkFields(pluginFields, options, context)
  const layers = [options]
  const settings = { ...normalizeFields(pluginFields, layers, null, context), defaults: normalizeFields(routeFields, layers, null, context) }
  pluginLayers.set(settings.defaults, copyOf(Object.fromEntries(routeOptionNames.map((name) => [name, (options as Record<string, unknown>)[name]]))))
  return settings
}

/**
 * The settings of one route, from the plugin's and its `config.idempotency`; `null` when the
 * route is not guarded. Throws a TypeError naming the route and the problem.
 */
export function routeSettings (plugin: PluginSettings, config: unknown, routeName: string): RouteSettings | null {
  if (config === false) return null
  if (config === true) return plugin.defaults
  const context = { name: `config.idempotency of route ${routeName}`, storage: plugin.storage }
  if (config === null || typeof config !== 'object' || Array.isArray(config)) {
    throw invalid(context.name, 'it must be true, false or an object of route options')
  }
  checkRouteConfig(config, context.name)
  const route = config as IdempotencyRouteOptions
  checkFields(routeFields, route, context)
  return normalizeFields(routeFields, [pluginLayers.get(plugin.defaults)!, route], plugin.defaults, context)
}

/** The route options a registration was given (not their defaults): what `run` tells apart from a default. */
export function givenRouteOptions (plugin: PluginSettings): Readonly<IdempotencyRouteOptions> {
  return pluginLayers.get(plugin.defaults)!
}

/** A copy of options' data (arrays and plain objects); functions are kept as they are. */
export function copyOf<T> (value: T): T {
  if (Array.isArray(value)) return value.map(copyOf) as T
  if (value === null || typeof value !== 'object' || Object.getPrototypeOf(value) !== Object.prototype) return value
  return Object.fromEntries(Object.entries(value).map(([name, item]) => [name, copyOf(item)])) as T
}
