/**
 * The Fastify hooks of a guarded route: the only code that touches `request`, `reply` and `done`.
 * What to do is decided by the engine (engine/acquire.ts, engine/settle.ts), which moves the
 * request through its phases (engine/request-state.ts); these hooks turn HTTP into its inputs and
 * its outcomes back into HTTP, in the order Fastify calls them:
 *
 *   onRequest      read and validate the key (a 400 is sent from preHandler)         keyed
 *   preValidation  the body as it arrived, before validation and the route's preHandler hooks
 *   preHandler     fingerprint, scope, then `acquire`: replay, refuse, or run   -> replayed, refused,
 *                                                                                  unprotected, running
 *   onError        a refusal's retry headers go on the reply; a failed request is never stored
 *   onSend         capture the response, then `settle` it (settle-response.ts) -> settling -> ended
 *   'close'        a hijacked reply, which never reaches onSend, is settled there
 *
 * onError, onSend and 'close' (from the handler on) are in response-hooks.ts. Hooks are created per
 * route from that route's settings, so nothing here looks options up.
 */
import type { FastifyReply, FastifyRequest, onErrorHookHandler, onRequestHookHandler, onSendHookHandler, preHandlerHookHandler, preValidationHookHandler } from 'fastify'
import { acquire, type Acquisition } from '../engine/acquire.js'
import { holdingConnection } from '../engine/held-connection.js'
import { isPromise, type MaybePromise } from '../engine/maybe-promise.js'
import type { InFlight } from '../engine/in-flight.js'
import { createRouteEngine, stopRouteEngine } from '../engine/route-engine.js'
import { checkKey, storageKey } from '../engine/storage-key.js'
import { IdempotencyKeyMissingError } from '../errors.js'
import type { PluginSettings, RouteSettings } from '../options.js'
import { readIdempotencyKey } from './key.js'
import { RawBodyHash } from './raw-body.js'
import { kState, HttpRequestState, type GuardedRequest, type GuardedRoute } from './request-context.js'
import { takeArrivedBody, takeFingerprint, unparsedBodyHash } from './request-fingerprint.js'
import { replayResponse } from './replay.js'
import { hasCredentials, resolveScope } from './scope.js'
import { finalOnSend, onError, onSend, run } from './response-hooks.js'

export { kState, type IdempotencyRequestContext } from './request-context.js'

export interface RouteHooks {
  onRequest: onRequestHookHandler
  /** Takes the body before validation or a preHandler hook of the route changes it. */
  preValidation: preValidationHookHandler
  preHandler: preHandlerHookHandler
  onSend: onSendHookHandler
  /** Placed last among the route's onSend hooks when others run after `onSend`: settles what waits for the payload Fastify sends. */
  finalOnSend: onSendHookHandler
  /** Say whether onSend hooks of the route's options run after `onSend` (and `finalOnSend` is placed). */
  laterOnSend: (later: boolean) => void
  onError: onErrorHookHandler
  /** Stop renewing this route's leases (the server is closing). */
  stop: () => void
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
  // A body sent as a string stays one up to the store that keeps text, or up to the seal, which
  // writes it into the plaintext: no Buffer of it is made on the way.
  const textBodies = (engine.door.keepsText || engine.door.cipher !== null) && settings.storeIf === null && settings.redact === null
  const route: GuardedRoute = { engine, plugin, settings, url, credentialsWarned: settings.scope !== null, textBodies, laterOnSend: false }
  return {
    onRequest: onRequestHook(route, safeMethods),
    preValidation: preValidationHook(route),
    preHandler: preHandlerHook(route),
    onSend: onSend as onSendHookHandler,
    finalOnSend: finalOnSend as onSendHookHandler,
    laterOnSend: (later) => { route.laterOnSend = later },
    onError,
    stop: () => { stopRouteEngine(engine) }
  }
}

/** onRequest: a request with a valid key gets its context (phase `keyed`); one without is let through or refused. */
function onRequestHook (route: GuardedRoute, safeMethods: boolean): onRequestHookHandler {
  const { plugin: { headerName, headerLabel, maxKeyLength }, settings } = route
  return function onRequest (request: FastifyRequest, _reply: FastifyReply, done: (error?: Error) => void): void {
    if (safeMethods && SAFE_METHODS.has(request.method)) {
      done()
      return
    }
    let key
    try {
      // A route whose key comes from a function of its own reads it in preHandler.
      key = settings.key === null ? readIdempotencyKey(request.headers[headerName], headerLabel, maxKeyLength) : PENDING_KEY
    } catch (error) {
      refuseLater(request, error as Error)
      done()
      return
    }
    if (key === undefined) {
      if (settings.required) refuseLater(request, new IdempotencyKeyMissingError(headerLabel))
      done()
      return
    }
    const guarded = request as GuardedRequest
    const http = new HttpRequestState(route, request, key)
    guarded.idempotency = http.context
    if (settings.fingerprint.raw) http.rawBody = new RawBodyHash(request.raw, request.headers['content-type']).tap()
    guarded[kState] = http
    done()
  }
}

/** On a request: the plugin's refusal of its key (missing, invalid), sent from preHandler. */
const kRefusal = Symbol('fastify-idempotency.refusal')

/**
 * A key refused in onRequest, or a body preValidation could not fingerprint, is answered from the
 * plugin's preHandler, the route's last: every hook the app gave the route (authentication in
 * onRequest, preValidation or preHandler, validation of the body) answers first, as for any other
 * answer of the plugin. Only requests refused here get the property.
 */
function refuseLater (request: FastifyRequest, error: Error): void {
  (request as FastifyRequest & { [kRefusal]?: Error })[kRefusal] = error
}

/** The key of a request whose route reads it from a function, until preHandler has. */
const PENDING_KEY = ''

/**
 * preHandler of a route with a `key` function: the request's key, read after the route's own hooks
 * (a webhook's signature check). Its state moves to the key; `null` when the request has none and
 * the route does not require one: it passes through, unguarded.
 */
async function keyFromFunction (route: GuardedRoute, request: GuardedRequest, pending: HttpRequestState): Promise<HttpRequestState | null> {
  const { plugin: { maxKeyLength }, settings, url } = route
  const value = await settings.key!(request)
  if (value === undefined || value === null) {
    if (settings.required) throw new IdempotencyKeyMissingError(`key of route ${url}`)
    request[kState] = null
    request.idempotency = null
    return null
  }
  const http = pending.withKey(checkKey(value, maxKeyLength, `The idempotency key of route ${url}`), request)
  request[kState] = http
  request.idempotency = http.context
  return http
}

/** preValidation: takes the body as it arrived, before validation or a preHandler hook of the route changes it. */
function preValidationHook ({ settings, url }: GuardedRoute): preValidationHookHandler {
  return function preValidation (request: FastifyRequest, _reply: FastifyReply, done: (error?: Error) => void): void {
    const http = (request as GuardedRequest)[kState]
    if (http !== null) {
      try {
        http.arrivedBody = takeArrivedBody(request, settings.fingerprint, http.key, url)
      } catch (error) {
        // Answered from preHandler, after the route's own preHandler hooks (authentication), as
        // every refusal of the plugin is.
        refuseLater(request, error as Error)
      }
    }
    done()
  }
}

/** What the engine answered a request with a key, and its state (another, once a `key` function has read the key). */
interface Asked {
  http: HttpRequestState
  acquisition: Acquisition
}

/**
 * preHandler: fingerprint and scope the request, then ask the engine whether its handler runs.
 * Callback style, and synchronous from start to end whenever nothing needs waiting for (a body
 * read as it arrives, a scope or key function, a store that does not answer at once): a request on
 * MemoryStorage then makes no promise here, which costs every request that makes one.
 */
function preHandlerHook (route: GuardedRoute): preHandlerHookHandler {
  return function preHandler (request: FastifyRequest, reply: FastifyReply, done: (error?: Error) => void): void {
    const pending = (request as GuardedRequest)[kState]
    const refusal = (request as FastifyRequest & { [kRefusal]?: Error })[kRefusal]
    if (pending === null || refusal !== undefined) {
      done(refusal)
      return
    }
    let asked: MaybePromise<Asked | null>
    try {
      asked = route.settings.key === null ? prepared(route, request, pending) : keyFromFunction(route, request as GuardedRequest, pending).then((http) => http === null ? null : prepared(route, request, http))
    } catch (error) {
      done(error as Error)
      return
    }
    if (isPromise(asked)) asked.then((answer) => { respond(route, request, reply, answer, done) }, done)
    else respond(route, request, reply, asked, done)
  }
}

/** The request fingerprinted (its raw body read first, when it counts by it) and scoped, then the engine asked. */
function prepared (route: GuardedRoute, request: FastifyRequest, http: HttpRequestState): MaybePromise<Asked> {
  const { settings, url } = route
  // A body no parser made a value of (multipart in stream mode, a proxy's stream) counts by its raw bytes.
  if (http.rawBody === null && settings.fingerprint.body) http.rawBody = unparsedBodyHash(request, http.key, url)
  if (http.rawBody !== null || settings.scope !== null) return preparedLater(route, request, http)
  return askEngine(route, request, http, takeFingerprint(request, settings.fingerprint, http, undefined, url), null)
}

async function preparedLater (route: GuardedRoute, request: FastifyRequest, http: HttpRequestState): Promise<Asked> {
  const { settings, url } = route
  const rawBody = http.rawBody === null ? undefined : await http.rawBody.digest(request.routeOptions.bodyLimit)
  const fingerprinted = takeFingerprint(request, settings.fingerprint, http, rawBody, url)
  const scope = settings.scope === null ? null : await resolveScope(settings.scope, request, http.key, url)
  return await askEngine(route, request, http, fingerprinted, scope)
}

function askEngine (route: GuardedRoute, request: FastifyRequest, http: HttpRequestState, fingerprinted: ReturnType<typeof takeFingerprint>, scope: string | null): MaybePromise<Asked> {
  const { engine } = route
  warnOfSharedKeys(route, request)
  const acquisition = acquire(engine, http.state, storageKey(http.key, scope, engine.door.cipher), fingerprinted.record, fingerprinted)
  return isPromise(acquisition) ? acquisition.then((answer) => ({ http, acquisition: answer })) : { http, acquisition }
}

/** Run the handler, replay, or refuse, as the engine said (`null`: the request has no key after all). */
function respond (route: GuardedRoute, request: FastifyRequest, reply: FastifyReply, asked: Asked | null, done: (error?: Error) => void): void {
  if (asked === null) {
    done()
    return
  }
  const { http, acquisition } = asked
  switch (acquisition.outcome) {
    case 'run':
      run(reply, http)
      // The handler runs inside this call (Fastify calls it from `done`), knowing the connection its transaction holds.
      holdingConnection(route.engine, http.state, done)
      return
    case 'replay': {
      // The reply is sent, and `done` is not called: Fastify then does not go on to the handler.
      let decoding
      try {
        decoding = replayResponse(request, reply, acquisition.response, route.plugin.replayHeader)
      } catch (error) {
        done(error as Error)
        return
      }
      decoding?.catch(done)
      return
    }
    case 'refuse':
      done(acquisition.error)
      return
    case 'unprotected':
      done()
  }
}

function warnOfSharedKeys (route: GuardedRoute, request: FastifyRequest): void {
  if (route.credentialsWarned || !hasCredentials(request)) return
  route.credentialsWarned = true
  request.log.warn(`fastify-idempotency: route ${route.url} received a request with credentials (Authorization or Cookie) and has no scope: every client's keys share one namespace, so a client that reuses another's key and body gets that client's response. Set scope to the signed-in caller, read after your authentication hook, for example scope: (request) => request.user?.id; see docs/security.md`)
}
