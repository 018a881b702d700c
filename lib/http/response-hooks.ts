/**
 * The hooks of a guarded route from the handler on (hooks.ts has those before it): the handler's
 * start (`run`), the reply's 'close', onSend (the response captured and settled, settle-response.ts),
 * the route's last onSend hook where other hooks follow the plugin's, and onError.
 */
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify'
import { isPromise, type MaybePromise } from '../engine/maybe-promise.js'
import { IdempotencyStoreUnavailableError, isIdempotencyError } from '../errors.js'
import { kState, type GuardedRequest, type HttpRequestState } from './request-context.js'
import { handOn, settleFinal, settleHijacked, settleResponse, settleWithoutFinal } from './settle-response.js'

/** How an onSend hook hands its payload on. */
type SendDone = (error: Error | null, payload?: unknown) => void

/** The handler is about to run (phase `running`): hand it its transaction, and watch for a hijacked reply. */
export function run (reply: FastifyReply, http: HttpRequestState): void {
  const { state } = http
  if (state.transaction !== null) http.context.transaction = state.transaction.handle
  if (reply.raw.destroyed) {
    // The client left before the lease was taken: 'close' has fired already and will not again.
    // As below, the lease is not renewed, so a handler that never answers frees the key.
    clientGone(reply, http)
    return
  }
  // `on`, not `once`: a response closes once, and `once` would wrap the listener in another
  // (a bound function and its state) on every request.
  reply.raw.on('close', () => { onClose(reply, http) })
}

/** The reply's 'close', while the handler may still be running, or its answer waits for the route's last onSend hook. */
function onClose (reply: FastifyReply, http: HttpRequestState): void {
  if (http.finalEnding !== null) {
    // The response ended without reaching the route's last onSend hook: one after the plugin's
    // hijacked the reply (one that failed is settled in onError). The handler answered: its answer
    // is settled as the plugin's onSend took it, rather than left to a lease that lapses into a
    // second run.
    void settleWithoutFinal(reply, http)
    return
  }
  if (http.state.phase !== 'running') return
  // Hijacked, ended by hand, or written by hand (@fastify/sse writes its events on reply.raw):
  // onSend will never run for what was written. With its head out, the handler has answered, so
  // its outcome is what it wrote, also when its client went away mid-body: kept, never run again.
  if (reply.sent || reply.raw.headersSent) {
    settleHijacked(reply, http)
    return
  }
  clientGone(reply, http)
}

/**
 * The client went away while the handler runs. The lease stays, so a retry does not run the
 * handler a second time alongside it, and onSend settles it with the handler's outcome (a retry
 * then replays what was done). Renewal stops, though: a handler that never answers frees the key
 * once lockTimeout has passed instead of holding it for ever.
 */
function clientGone (reply: FastifyReply, http: HttpRequestState): void {
  http.route.engine.renewal.drop(http.state)
  // A handler that answers by hand on the response its client left (Node emits 'prefinish', not
  // 'close' again, when it is ended) never reaches onSend either: its outcome is what it wrote.
  reply.raw.once('prefinish', () => { if (http.state.phase === 'running') settleHijacked(reply, http) })
}

/**
 * Callback style, not async: most responses (replays, requests without a key, refusals) pass
 * straight through, and an async hook would cost each of them a promise and a microtask.
 */
export function onSend (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: SendDone): void {
  const http = (request as GuardedRequest)[kState]
  if (http === null) {
    done(null, payload)
    return
  }
  switch (http.state.phase) {
    case 'running':
      respondSettled(reply, http, payload, done)
      return
    case 'settling':
    case 'storing':
    case 'ended':
      if (http.handedOn === null) break
      // A second send of the same reply while the first is being stored: Fastify's own, when an
      // async handler called reply.send() without returning reply, and resolved while this hook
      // was storing the response. Without the plugin the first send is written first; so here
      // too (Fastify then warns: 'did you forget to return reply').
      http.handedOn.then(() => { handOn(reply, done, null, payload) })
      return
    case 'replayed':
      // Fastify gives a Buffer without a Content-Type one of its own; the original had none.
      if (http.state.replayed!.contentType === null) reply.removeHeader('content-type')
      break
  }
  // A refusal, or the response of a handler run unprotected: it passes through.
  done(null, payload)
}

/**
 * Settle a request that ran, then hand its payload on to Fastify: at once when settling needed no
 * waiting (the store answered at once), otherwise once it is done.
 */
function respondSettled (reply: FastifyReply, http: HttpRequestState, payload: unknown, done: SendDone): void {
  handOnceSettled(reply, http, done, () => settleResponse(reply, http, payload), true)
}

/** The route's last onSend hook, where onSend hooks run after the plugin's: a settle that waits for the payload Fastify sends. */
export function finalOnSend (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: SendDone): void {
  const http = (request as GuardedRequest)[kState]
  if (http === null || http.finalEnding === null) {
    done(null, payload)
    return
  }
  handOnceSettled(reply, http, done, () => settleFinal(reply, http, payload), false)
}

/**
 * Hand the payload `settle` gives on to Fastify, at once or once it is done. `atOnce`: a response
 * handed on at once says so (`handedOn`), so that a second send of the reply goes on at once too.
 */
function handOnceSettled (reply: FastifyReply, http: HttpRequestState, done: SendDone, settle: () => MaybePromise<unknown>, atOnce: boolean): void {
  let sent: MaybePromise<unknown>
  try {
    sent = settle()
  } catch (error) {
    if (atOnce) http.handedOn = HANDED_ON
    handOn(reply, done, error as Error)
    return
  }
  if (isPromise(sent)) {
    http.handedOn = sent.then((settled) => { handOn(reply, done, null, settled) }, (error: Error) => { handOn(reply, done, error) })
    return
  }
  if (atOnce) http.handedOn = HANDED_ON
  handOn(reply, done, null, sent)
}

/** A response handed on at once: a second send of the reply goes on at once too. */
const HANDED_ON = Promise.resolve()

export function onError (request: FastifyRequest, reply: FastifyReply, error: FastifyError, done: () => void): void {
  // A refusal's retry signals (Retry-After, Stripe-Should-Retry, X-Should-Retry) go on the reply
  // before any error handler runs, so that whichever answers (NestJS's, an app's own mapper) sends them.
  if (isIdempotencyError(error)) reply.headers(error.headers)
  const http = (request as GuardedRequest)[kState]
  if (http !== null) {
    http.failed = true
    if (http.state.transaction !== null && http.route.engine.door.isConflict(error)) transactionConflict(request, reply, http, error)
    // An onSend hook after the plugin's failed on an answer with trailers whose client left before
    // it: Fastify writes nothing more to it, and never asks for them; 'close' came already.
    if (http.trailers !== null && reply.raw.destroyed) http.trailers.abandon()
    if (http.finalEnding !== null) {
      // An onSend hook after the plugin's failed: the handler did answer, and the error's answer
      // may never reach the route's last onSend hook (Fastify answers a second failure without
      // them, and writes nothing to a client that left), so the answer is settled now (see
      // onClose), and the error answered once it is, as any answer is once stored.
      const settled = settleWithoutFinal(reply, http)
      if (isPromise(settled)) {
        void settled.then(() => { done() })
        return
      }
    }
  }
  done()
}

/**
 * The handler failed because its transaction conflicted with another: nothing is kept (its writes
 * are rolled back), and a retry may well succeed. It is answered as a failed commit is, 503 with
 * Retry-After: the status and headers go on the reply for any error handler (Fastify's own keeps
 * them), and idempotencyErrorHandler answers it as #store-unavailable.
 */
function transactionConflict (request: FastifyRequest, reply: FastifyReply, http: HttpRequestState, error: Error): void {
  const conflict = http.conflict = new IdempotencyStoreUnavailableError(http.key, error)
  reply.code(conflict.statusCode).headers(conflict.headers)
  request.log.warn({ err: error, idempotencyKey: http.key }, 'idempotency transaction conflicted with another: rolled back, answered 503 with Retry-After')
}
