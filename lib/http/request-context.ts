/**
 * What the Fastify adapter keeps for one guarded route and for one of its requests that carries a
 * key, beside the engine's own state of that request (engine/request-state.ts): what only HTTP
 * needs (the body as it arrived, the raw body's hash, whether the handler failed, the hand-on of
 * the response to Fastify), and `request.idempotency`, what the handler sees.
 */
import type { FastifyRequest } from 'fastify'
import { RequestState } from '../engine/request-state.js'
import type { ResponseCallbacks } from '../engine/route-callbacks.js'
import type { RouteEngine } from '../engine/route-engine.js'
import type { Ending } from '../engine/settle.js'
import { runStep, type StepFunction } from '../engine/steps.js'
import type { ValueCodec } from '../engine/value-codec.js'
import type { IdempotencyStoreUnavailableError } from '../errors.js'
import type { ArrivedBody } from '../fingerprint/fingerprint.js'
import type { PluginSettings, RouteSettings } from '../options.js'
import type { StoredResponse } from '../storage/types.js'
import type { CollectedTrailers } from './trailers.js'

/** Where the per-request context lives (a request decoration, so request objects keep one shape). */
export const kState = Symbol('fastify-idempotency.state')

/** What a guarded request exposes to its handler as `request.idempotency`. */
export interface IdempotencyRequestContext {
  /** The request's Idempotency-Key (unquoted). */
  readonly key: string
  /**
   * Transaction mode: the database transaction to write through (a knex transaction with
   * KnexStorage; `transactionOf(request)` from 'fastify-idempotency/knex' returns it typed).
   * `undefined` otherwise.
   */
  readonly transaction: unknown
  /**
   * A recovery point: run `fn` once for this key and record its result (plain data, or what
   * devalue keeps: BigInt, Date, Map, Set...; or a Buffer). When the handler runs again for the
   * same key and fingerprint after a run that stored no response, a step that completed returns
   * its recorded result without calling `fn`. `codec` keeps what devalue cannot. A step whose
   * result could not be kept is never run again: a later run reaching it is refused (409
   * #result-not-recorded). See docs/recovery-points.md.
   */
  step: <T>(name: string, fn: StepFunction<T>, codec?: ValueCodec<T>) => Promise<T>
}

/** One guarded route: its engine and its settings, shared by its requests. */
export interface GuardedRoute {
  readonly engine: RouteEngine
  readonly plugin: PluginSettings
  readonly settings: RouteSettings
  /** The route's URL pattern. */
  readonly url: string
  /** Warned once: a signed-in client's request on a route whose keys are shared by everyone. */
  credentialsWarned: boolean
  /**
   * A body sent as a string goes to the store as that string (Ending's `text`): the store keeps
   * text (StoreDoor.keepsText), and nothing on the way reads the bytes (no `storeIf` or `redact`,
   * which are given the response with its bytes; no encryption, which seals the bytes).
   */
  readonly textBodies: boolean
  /**
   * The route has onSend hooks of its options after the plugin's (@fastify/compress registered
   * after it): a response whose head may go out with its body is settled from the route's last
   * onSend hook, which sees the payload Fastify sends (settle-response.ts, `settleFinal`).
   */
  laterOnSend: boolean
}

/** `request.idempotency`: one per request with a key. */
class RequestContext implements IdempotencyRequestContext {
  readonly key: string
  transaction: unknown = undefined
  readonly #engine: RouteEngine
  readonly #state: RequestState

  constructor (key: string, engine: RouteEngine, state: RequestState) {
    this.key = key
    this.#engine = engine
    this.#state = state
  }

  async step<T> (name: string, fn: StepFunction<T>, codec?: ValueCodec<T>): Promise<T> {
    return await runStep(this.#engine, this.#state, name, fn, codec)
  }
}

/**
 * The adapter's context of one guarded request with a key, from onRequest to the end of its
 * response. It hands the engine the route's `storeIf` and `redact` bound to the request.
 */
export class HttpRequestState implements ResponseCallbacks {
  readonly route: GuardedRoute
  /** The request's Idempotency-Key (unquoted). */
  readonly key: string
  /** The engine's state of this request: its phase, its lease, what answers it. */
  readonly state: RequestState
  /** `request.idempotency`. */
  readonly context: RequestContext
  readonly storeIf: ResponseCallbacks['storeIf'] = null
  readonly redact: ResponseCallbacks['redact'] = null
  /** The body as it arrived, taken before validation (preValidation). */
  arrivedBody: ArrivedBody | null = null
  /** With `fingerprint: { body: 'raw' }` or a body no parser read: the hash of the raw body, as it is read. */
  rawBody: { digest: (limit: number) => Promise<string> } | null = null
  /** The handler (or a hook after ours) failed: whatever status the error handler picks, nothing is stored. */
  failed = false
  /** A response whose settle waits for the route's last onSend hook (`GuardedRoute.laterOnSend`). */
  finalEnding: Ending | null = null
  /** A response with trailers: their values, which its settle waits for (trailers.ts). */
  trailers: CollectedTrailers | null = null
  /** Resolves once the response has been handed on to Fastify after settling (onSend). */
  handedOn: Promise<void> | null = null
  /**
   * Transaction mode: the handler failed because its transaction conflicted with another (a
   * serialization failure, a deadlock): answered as a failed commit is, 503 with Retry-After.
   */
  conflict: IdempotencyStoreUnavailableError | null = null

  constructor (route: GuardedRoute, request: FastifyRequest, key: string) {
    this.route = route
    this.key = key
    const { redact, storeIf } = route.settings
    if (redact !== null) this.redact = (response: StoredResponse) => redact(response, request)
    if (storeIf !== null) this.storeIf = (response: StoredResponse) => storeIf(response, request)
    this.state = new RequestState(key, request.method, request.log, this)
    this.context = new RequestContext(key, route.engine, this.state)
  }

  /**
   * This request's state under `key`, read by the route's `key` function once the route's own hooks
   * have run: what was taken of the body before then (its raw bytes' hash, its value as it arrived)
   * goes with it.
   */
  withKey (key: string, request: FastifyRequest): HttpRequestState {
    const keyed = new HttpRequestState(this.route, request, key)
    keyed.arrivedBody = this.arrivedBody
    keyed.rawBody = this.rawBody
    return keyed
  }
}

export type GuardedRequest = FastifyRequest & { [kState]: HttpRequestState | null, idempotency: IdempotencyRequestContext | null }

/** The 503 a request's transaction conflict is answered with (`HttpRequestState.conflict`), or `null`. */
export function transactionConflictOf (request: FastifyRequest): IdempotencyStoreUnavailableError | null {
  return (request as Partial<GuardedRequest>)[kState]?.conflict ?? null
}
