/**
 * The Fastify hooks of a guarded route: the only code that touches `request`, `reply` and `done`.
 * What to do is decided by the engine (engine/acquire.ts, engine/settle.ts); these hooks turn
 * HTTP into its inputs and its outcomes back into HTTP:
 *
 *   onRequest   read and validate the key (400 before anything else happens)
 *   preValidation  (a route with a body schema) the body as it arrived, before validation
 *   preHandler  fingerprint, scope, then `acquire`: replay, refuse, or run the handler
 *   onSend      capture the response, then `settle`: store it, or give the key back
 *   onError     a refusal's retry headers go on the reply; a failed request is never stored
 *   'close'     a hijacked reply, which never reaches onSend, is settled there
 *
 * Hooks are created per route from that route's settings, so nothing here looks options up.
 */
import type { FastifyError, FastifyReply, FastifyRequest, onErrorHookHandler, onRequestHookHandler, onSendHookHandler, preHandlerAsyncHookHandler, preValidationHookHandler } from 'fastify'
import { adoptWebPayload, captureStream, hijackedOutcome, isNodeStream, payloadBytes, snapshotResponse } from './capture.js'
import { acquire } from '../engine/acquire.js'
import type { InFlight } from '../engine/in-flight.js'
import { RequestState } from '../engine/request-state.js'
import { createRouteEngine, type RouteEngine } from '../engine/route-engine.js'
import { settle, type NotStoredReason } from '../engine/settle.js'
import { runStep, type StepFunction } from '../engine/steps.js'
import { storageKey } from '../engine/storage-key.js'
import { IdempotencyKeyMissingError, IdempotencyStoreUnavailableError, isIdempotencyError } from '../errors.js'
import { readIdempotencyKey } from './key.js'
import { RawBodyHash } from './raw-body.js'
import { takeArrivedBody, takeFingerprint, unparsedBodyHash } from './request-fingerprint.js'
import { replayResponse } from './replay.js'
import { hasCredentials, resolveScope } from './scope.js'
import type { PluginSettings, RouteSettings } from '../options.js'
import type { StoredResponse } from '../storage/types.js'

/** Where the per-request state lives (a request decoration, so request objects keep one shape). */
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
   * A recovery point: run `fn` once for this key and record its result (JSON-serializable, or a
   * Buffer). When the handler runs again for the same key and fingerprint after a run that stored
   * no response, a step that completed returns its recorded result without calling `fn`. See
   * docs/recovery-points.md.
   */
  step: <T>(name: string, fn: StepFunction<T>) => Promise<T>
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

  async step<T> (name: string, fn: StepFunction<T>): Promise<T> {
    return await runStep(this.#engine, this.#state, name, fn)
  }
}

type GuardedRequest = FastifyRequest & { [kState]: RequestState | null, idempotency: IdempotencyRequestContext | null }

export interface RouteHooks {
  onRequest: onRequestHookHandler
  /** For a route with a body schema: takes the body before validation changes it. */
  preValidation: preValidationHookHandler
  preHandler: preHandlerAsyncHookHandler
  onSend: onSendHookHandler
  onError: onErrorHookHandler
  /** Stop renewing this route's leases (the server is closing). */
  stop: () => void
}

const NOT_MODIFIED = 304

/** One guarded route: its engine and its settings. */
interface Route {
  engine: RouteEngine
  plugin: PluginSettings
  settings: RouteSettings
}

/**
 * Safe methods are never guarded: the IETF draft scopes the key to non-idempotent methods, and a
 * client that sends a key on every request (some SDKs do) must not read a stored GET for a day.
 */
export const SAFE_METHODS: ReadonlySet<string> = new Set(['GET', 'HEAD', 'OPTIONS'])

/**
 * `safeMethods`: the route also answers GET, HEAD or OPTIONS, whose requests are never guarded.
 * `inFlight`: the registration's requests in flight, which closing the app waits for.
 */
export function createRouteHooks (plugin: PluginSettings, settings: RouteSettings, url: string, safeMethods: boolean, inFlight: InFlight): RouteHooks {
  const engine = createRouteEngine(plugin.storage, settings, url, plugin.cipher, inFlight)
  const keyedHash = plugin.cipher === null ? undefined : (composed: string) => plugin.cipher!.hashKey(composed)
  // Warned once: a signed-in client's request on a route whose keys are shared by everyone.
  let credentialsWarned = settings.scope !== null
  const route: Route = { engine, plugin, settings }
  const { headerName, headerLabel, maxKeyLength } = plugin

  function onRequest (request: FastifyRequest, _reply: FastifyReply, done: (error?: Error) => void): void {
    if (safeMethods && SAFE_METHODS.has(request.method)) {
      done()
      return
    }
    let key
    try {
      key = readIdempotencyKey(request.headers[headerName], headerLabel, maxKeyLength)
    } catch (error) {
      done(error as Error)
      return
    }
    if (key === undefined) {
      done(settings.required ? new IdempotencyKeyMissingError(headerLabel) : undefined)
      return
    }
    const guarded = request as GuardedRequest
    const state = new RequestState(key, request.method, request.log)
    guarded.idempotency = new RequestContext(key, engine, state)
    if (settings.fingerprint.raw) state.rawBody = new RawBodyHash(request.raw, request.headers['content-type']).tap()
    guarded[kState] = state
    done()
  }

  async function preHandler (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply | undefined> {
    const guarded = request as GuardedRequest
    const state = guarded[kState]
    if (state === null) return undefined
    // A body no parser made a value of (multipart in stream mode, a proxy's stream) counts by its raw bytes.
    if (state.rawBody === null && settings.fingerprint.body) state.rawBody = unparsedBodyHash(request, state.key, url)
    const rawBody = state.rawBody === null ? undefined : await state.rawBody.digest(request.routeOptions.bodyLimit)
    const fingerprint = takeFingerprint(request, settings.fingerprint, state, rawBody, url)
    // Without a scope there is nothing to await: no promise on the path of every request.
    const scope = settings.scope === null ? null : await resolveScope(settings.scope, request, state.key, url)
    if (!credentialsWarned && hasCredentials(request)) {
      credentialsWarned = true
      request.log.warn(`fastify-idempotency: route ${url} received a request with credentials (Authorization or Cookie) and has no scope: every client's keys share one namespace, so a client that reuses another's key and body gets that client's response. Set scope to the signed-in caller, read after your authentication hook, for example scope: (request) => request.user?.id; see docs/security.md`)
    }
    bindRouteCallbacks(settings, state, request)
    const acquisition = await acquire(engine, state, storageKey(state.key, scope, keyedHash), fingerprint)
    switch (acquisition.outcome) {
      case 'run':
        run(route, guarded, reply, state)
        return undefined
      case 'replay': {
        const decoding = replayResponse(request, reply, acquisition.response, plugin.replayHeader)
        if (decoding !== undefined) await decoding
        // Returning the reply tells Fastify the response is under way: without it, Fastify goes on
        // to the handler whenever the send is still pending (any asynchronous onSend hook).
        return reply
      }
      case 'refuse':
        throw acquisition.error
      case 'unprotected':
        guarded[kState] = null
        return undefined
    }
  }

  /**
   * Callback style, not async: most responses (replays, requests without a key, refusals) pass
   * straight through, and an async hook would cost each of them a promise and a microtask.
   */
  function onSend (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: (error: Error | null, payload?: unknown) => void): void {
    const state = (request as GuardedRequest)[kState]
    if (state !== null) {
      if (state.settle()) {
        state.handedOn = settleResponse(route, reply, state, payload).then((sent) => { handOn(reply, done, null, sent) }, (error: Error) => { handOn(reply, done, error) })
        return
      }
      if (state.handedOn !== null) {
        // A second send of the same reply while the first is being stored: Fastify's own, when an
        // async handler called reply.send() without returning reply, and resolved while this hook
        // was storing the response. Without the plugin the first send is written first; so here
        // too (Fastify then warns: 'did you forget to return reply').
        state.handedOn.then(() => { handOn(reply, done, null, payload) })
        return
      }
      // Fastify gives a Buffer without a Content-Type one of its own; the original had none.
      if (state.replayed !== null && state.replayed.contentType === null) reply.removeHeader('content-type')
    }
    done(null, payload)
  }

  function onError (request: FastifyRequest, reply: FastifyReply, error: FastifyError, done: () => void): void {
    // A refusal's retry signals (Retry-After, Stripe-Should-Retry, X-Should-Retry) go on the reply
    // before any error handler runs, so that whichever answers (NestJS's, an app's own mapper) sends them.
    if (isIdempotencyError(error)) reply.headers(error.headers)
    const state = (request as GuardedRequest)[kState]
    if (state !== null) state.failed = true
    done()
  }

  return { onRequest, preValidation: arrivedBodyHook(settings, url), preHandler, onSend: onSend as onSendHookHandler, onError, stop: () => { engine.renewal.stop(); engine.deadline.stop() } }
}

/** preValidation, on a route with a body schema: takes the body as it arrived, before validation changes it. */
function arrivedBodyHook (settings: RouteSettings, url: string): preValidationHookHandler {
  return function preValidation (request: FastifyRequest, _reply: FastifyReply, done: (error?: Error) => void): void {
    const state = (request as GuardedRequest)[kState]
    if (state !== null) {
      try {
        state.arrivedBody = takeArrivedBody(request, settings.fingerprint, state.key, url)
      } catch (error) {
        done(error as Error)
        return
      }
    }
    done()
  }
}

/**
 * Hand the payload on to Fastify from a promise callback. Fastify throws from there when it refuses
 * the payload (a Response whose body was read, say): called from the handler, that throw would
 * have reached its error handler, so it is sent there, or the request would never be answered.
 * When it cannot write because a response was written already (it warns of that itself), the
 * error is kept at debug level: it must never become a rejection nobody handles, which would end
 * the process.
 */
function handOn (reply: FastifyReply, done: (error: Error | null, payload?: unknown) => void, error: Error | null, payload?: unknown): void {
  try {
    done(error, payload)
  } catch (late) {
    if (!reply.raw.headersSent) {
      reply.send(late)
      return
    }
    reply.log.debug({ err: late }, 'fastify-idempotency: a second send of this reply was not written')
  }
}

/** The route's own functions of the response to store (redact, storeIf), bound to this request. */
function bindRouteCallbacks ({ redact, storeIf }: RouteSettings, state: RequestState, request: FastifyRequest): void {
  if (redact !== null) state.redact = (response) => redact(response, request)
  if (storeIf !== null) state.storeIf = (response) => storeIf(response, request)
}

/** The handler is about to run: hand it its transaction, and watch for a hijacked reply. */
function run (route: Route, request: GuardedRequest, reply: FastifyReply, state: RequestState): void {
  const { engine } = route
  if (state.transaction !== null) (request.idempotency as RequestContext).transaction = state.transaction.handle
  if (reply.raw.destroyed) {
    // The client left before the lease was taken: 'close' has fired already and will not again.
    // As below, the lease is not renewed, so a handler that never answers frees the key.
    engine.renewal.drop(state)
    return
  }
  reply.raw.once('close', () => {
    if (state.phase !== 'held') return
    // Hijacked (or ended by hand): onSend will never run, and the body was never seen; what was
    // written on the raw response is the outcome.
    if (reply.sent) {
      if (!state.settle()) return
      const statusCode = reply.raw.statusCode
      const keep = route.settings.keepUnstorable && !state.failed && isStorable(route.settings, statusCode)
      void settle(engine, state, statusCode, keep ? hijackedOutcome(reply, route.plugin.excludedHeaders) : null, 'hijacked')
      return
    }
    // The client went away while the handler runs. The lease stays, so a retry does not run the
    // handler a second time alongside it, and onSend settles it with the handler's outcome (a
    // retry then replays what was done). Renewal stops, though: a handler that never answers
    // frees the key once lockTimeout has passed instead of holding it for ever.
    engine.renewal.drop(state)
  })
}

/** The handler's response: store it (or give the key back) and hand on the payload to send. */
async function settleResponse (route: Route, reply: FastifyReply, state: RequestState, sent: unknown): Promise<unknown> {
  const { engine, settings, plugin: { excludedHeaders } } = route
  // A Response's own status is the one sent: it decides whether the answer is kept.
  const payload = adoptWebPayload(reply, sent)
  const statusCode = reply.statusCode
  if (state.failed || !isStorable(settings, statusCode)) {
    await settle(engine, state, statusCode, null, state.failed ? 'failed' : 'not-cacheable')
    return payload
  }
  // A body that cannot be kept leaves its outcome (status and headers), unless the route frees
  // the key instead: a retry must not run the operation again because its answer was large.
  const unkept = (): StoredResponse | null => settings.keepUnstorable ? snapshotResponse(reply, excludedHeaders, null) : null
  const bytes = payloadBytes(payload)
  if (bytes !== null) {
    const response = bytes.length > settings.maxResponseBytes ? unkept() : snapshotResponse(reply, excludedHeaders, bytes)
    await settleOrRefuse(engine, state, statusCode, response, 'too-large', 'transaction not committed')
    return payload
  }
  if (isNodeStream(payload)) {
    const capture = captureStream(payload, settings.maxResponseBytes, Number(reply.getHeader('content-length') ?? Number.NaN))
    capture.holdEndUntil(capture.captured.then(async (captured) => {
      // A stream that failed or whose client left mid-way is not an outcome: the key is freed.
      const response = captured.body !== null
        ? snapshotResponse(reply, excludedHeaders, captured.body)
        : captured.reason === 'too-large' ? unkept() : null
      const settlement = await settle(engine, state, reply.statusCode, response, captured.body === null ? captured.reason : 'too-large')
      // Too late for another status: cut the response, so the client never sees a clean success.
      if (!settlement.deliverable) reply.raw.destroy(new Error('fastify-idempotency: transaction not committed'))
    }))
    return capture.stream
  }
  // Anything else (a Response whose body was read already, a locked web stream, an object that
  // is not bytes): Fastify refuses to send it, and answers 500 instead. Nothing was answered, so
  // nothing is kept, as for an error.
  await settle(engine, state, statusCode, null, 'failed')
  return payload
}

/**
 * Whether a response with this status is kept. A 304 is, whatever the cacheable set: the handler
 * ran and succeeded, and a conditional-request plugin (@fastify/etag) answered 304 after it.
 * Releasing the key would let a retry run the operation again; the retry gets the 304 the first
 * client got.
 */
function isStorable (settings: RouteSettings, statusCode: number): boolean {
  return settings.cacheable.has(statusCode) || statusCode === NOT_MODIFIED
}

/** Settle, and turn a success that must not reach the client (transaction mode) into a 503. */
async function settleOrRefuse (engine: RouteEngine, state: RequestState, statusCode: number, response: StoredResponse | null, reason: NotStoredReason, refusal: string): Promise<void> {
  const settlement = await settle(engine, state, statusCode, response, reason)
  if (!settlement.deliverable) throw new IdempotencyStoreUnavailableError(state.key, new Error(refusal))
}
