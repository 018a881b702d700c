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
import { routeSettings, type IdempotencyRouteOptions, type PluginSettings } from '../options.js'
import type { AuditLog } from '../operations/audit.js'
import { KeyOperations, type IdempotencyOperations } from '../operations/index.js'
import { runFunction, type RunFunction } from './function-run.js'
import { RUN_ROUTE } from './input-fingerprint.js'

/** The options of one `run` call; each one unset is the registration's (or `createIdempotency`'s). */
export interface RunOptions<T = unknown> extends Pick<IdempotencyRouteOptions,
'expiration' | 'lockTimeout' | 'maxLockHold' | 'storeTimeout' | 'maxResponseBytes' | 'failOpen' | 'wait' | 'waitTimeout' | 'transaction'> {
  /**
   * The namespace of the key: the tenant, the queue, the webhook's provider. Two scopes never
   * share an entry. Default: none (the namespace of requests without a scope).
   */
  scope?: string | null
  /** Keep results your own way (default: JSON, or devalue for what JSON cannot keep exactly). */
  codec?: ValueCodec<T>
}

/** The run options that shape an engine; `scope` and `codec` are per call. */
const ENGINE_OPTIONS = ['expiration', 'lockTimeout', 'maxLockHold', 'storeTimeout', 'maxResponseBytes', 'failOpen', 'wait', 'waitTimeout', 'transaction'] as const

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
    const scope = options.scope ?? null
    if (scope !== null && (typeof scope !== 'string' || scope.length === 0)) throw new TypeError('fastify-idempotency: run: scope must be a non-empty string, or null for none')
    return await runFunction(this.#engine(options), this.#log, key, scope, input, fn, this.#plugin.maxKeyLength, options.codec)
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
      engine = createRouteEngine(this.#plugin.storage, settings, RUN_ROUTE, this.#plugin.cipher, this.#inFlight)
      this.#engines.set(id, engine)
    }
    return engine
  }
}
