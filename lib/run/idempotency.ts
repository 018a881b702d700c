/**
 * `fastify.idempotency` and what `createIdempotency` returns: the operators' methods (inspect,
 * forget, inFlight, purge) and `run`, the engine's guarantees for any function: a job, a message
 * consumer, a scheduled task. One engine per set of run options, made on first use and kept.
 */
import type { InFlight } from '../engine/in-flight.js'
import type { Logger } from '../engine/report.js'
import { createRouteEngine, stopRouteEngine, type RouteEngine } from '../engine/route-engine.js'
import type { ValueCodec } from '../engine/value-codec.js'
import type { IdempotencyOperationEvent } from '../diagnostics.js'
import { givenRouteOptions, routeSettings, type IdempotencyRouteOptions, type PluginSettings, type RouteSettings } from '../options.js'
import type { AuditLog } from '../operations/audit.js'
import { KeyOperations, type IdempotencyOperations } from '../operations/index.js'
import { runScope } from '../engine/storage-key.js'
import { runFunction, type RunFunction } from './function-run.js'
import { RUN_ROUTE } from './input-fingerprint.js'

/** The options of one `run` call; each one unset is the registration's (or `createIdempotency`'s). */
export interface RunOptions<T = unknown> extends Pick<IdempotencyRouteOptions,
'expiration' | 'lockTimeout' | 'maxLockHold' | 'storeTimeout' | 'maxResponseBytes' | 'failOpen' | 'wait' | 'waitTimeout' | 'transaction'> {
  /**
   * The namespace of the key: the tenant, the queue, the webhook's provider. Two scopes never
   * share an entry. Default: none.
   */
  scope?: string | null
  /** Keep results your own way (default: JSON, or devalue for what JSON cannot keep exactly). */
  codec?: ValueCodec<T>
  /**
   * Keep the entry where a request with this key (and, with `scope`, a route whose scope returns
   * it) keeps its own, so that each meets the other's result or lease. Default `false`: the keys
   * of `run` are a namespace of their own, which no request's key can reach.
   */
  sharedWithRequests?: boolean
}

/** The run options that shape an engine; `scope`, `codec` and `sharedWithRequests` are per call. */
const ENGINE_OPTIONS = ['expiration', 'lockTimeout', 'maxLockHold', 'storeTimeout', 'maxResponseBytes', 'failOpen', 'wait', 'waitTimeout', 'transaction'] as const
const RUN_OPTIONS = new Set<string>([...ENGINE_OPTIONS, 'scope', 'codec', 'sharedWithRequests'])

export interface IdempotencyApi extends IdempotencyOperations {
  /**
   * Run `fn` once for `key` and `input`, and return its result; a later call with the same key and
   * input returns the kept result without running `fn`. See docs/jobs.md.
   */
  run: <T>(key: string, input: unknown, fn: RunFunction<T>, options?: RunOptions<T>) => Promise<T>
}

export class Idempotency extends KeyOperations implements IdempotencyApi {
  readonly #plugin: PluginSettings
  readonly #inFlight: InFlight
  readonly #log: Logger
  readonly #engines = new Map<string, RouteEngine>()

  constructor (settings: PluginSettings, audit: AuditLog, log: Logger, inFlight: InFlight, via: IdempotencyOperationEvent['via'] = 'app') {
    super(settings, audit, via)
    this.#plugin = settings
    this.#inFlight = inFlight
    this.#log = log
  }

  async run<T> (key: string, input: unknown, fn: RunFunction<T>, options: RunOptions<T> = {}): Promise<T> {
    checkRunOptions(options)
    const scope = options.scope ?? null
    if (scope !== null && (typeof scope !== 'string' || scope.length === 0)) throw new TypeError('fastify-idempotency: run: scope must be a non-empty string, or null for none')
    const shared = options.sharedWithRequests ?? false
    if (typeof shared !== 'boolean') throw new TypeError('fastify-idempotency: run: sharedWithRequests must be true or false')
    return await runFunction(this.#engine(options), this.#log, key, { scope: shared ? scope : runScope(scope), shared }, input, fn, this.#plugin.maxKeyLength, options.codec)
  }

  /** Stop the engines' timers (the app is closing). */
  stop (): void {
    for (const engine of this.#engines.values()) stopRouteEngine(engine)
  }

  #engine (options: Omit<RunOptions, 'codec'>): RouteEngine {
    const config: Record<string, unknown> = {}
    for (const name of ENGINE_OPTIONS) if (options[name] !== undefined) config[name] = options[name]
    const id = JSON.stringify(config)
    let engine = this.#engines.get(id)
    if (engine === undefined) {
      const settings = routeSettings(this.#plugin, Object.keys(config).length === 0 ? true : config, RUN_ROUTE)!
      engine = createRouteEngine(this.#plugin.storage, this.#heldAsLongAsItRuns(settings, config), RUN_ROUTE, this.#plugin.cipher, this.#inFlight)
      this.#engines.set(id, engine)
    }
    return engine
  }

  /**
   * A job's lease is renewed as long as its function runs, unless a `maxLockHold` was given (to
   * this call, or to the registration or `createIdempotency`): the default of requests (10
   * minutes) would let a longer job's key go while it runs, and a redelivery run it alongside.
   */
  #heldAsLongAsItRuns (settings: RouteSettings, config: Record<string, unknown>): RouteSettings {
    if (config.maxLockHold !== undefined || givenRouteOptions(this.#plugin).maxLockHold !== undefined) return settings
    return { ...settings, maxLockHold: Infinity }
  }
}

/** Options `run` does not know are refused with their name: a misspelt `scope` would share keys. */
function checkRunOptions (options: unknown): void {
  if (options === null || typeof options !== 'object' || Array.isArray(options)) throw new TypeError('fastify-idempotency: run: options must be an object')
  const unknown = Object.keys(options).filter((name) => !RUN_OPTIONS.has(name))
  if (unknown.length > 0) throw new TypeError(`fastify-idempotency: run: unknown option${unknown.length > 1 ? 's' : ''} ${unknown.map((name) => JSON.stringify(name)).join(', ')} (run takes ${[...RUN_OPTIONS].join(', ')})`)
}
