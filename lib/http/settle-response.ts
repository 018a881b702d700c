/**
 * The end of a request that ran its handler, in HTTP terms. What Fastify is about to send (onSend),
 * or what a hijacked reply wrote ('close'), becomes an `Ending` for the engine's `settle`: store
 * this response, or give the key back for this reason. A success the engine says must not reach
 * the client (transaction mode: its writes were rolled back) is then withheld as far as its
 * payload still allows (`withholdSuccess`).
 */
import type { Readable } from 'node:stream'
import type { FastifyReply } from 'fastify'
import { isPromise, type MaybePromise } from '../engine/maybe-promise.js'
import { settle, type Ending, type Settlement } from '../engine/settle.js'
import { IdempotencyStoreUnavailableError } from '../errors.js'
import type { RouteSettings } from '../options.js'
import type { StoredResponse } from '../storage/types.js'
import { adoptWebPayload, captureStream, hijackedOutcome, isNodeStream, payloadBytes, snapshotResponse, TEXT_BODY, withBody, type Captured } from './capture.js'
import { headWrittenWithBody, responseAsSentWithBody } from './head-bytes.js'
import type { HttpRequestState } from './request-context.js'
import { collectTrailers, replyTrailers, withTrailers } from './trailers.js'

const NOT_MODIFIED = 304

/**
 * How a response reaches the client, which decides what can still be done about a success that
 * must not reach it: `bytes` are not sent yet, a `stream` is under way, a `hijacked` reply was
 * written by the handler itself.
 */
export type Delivery = 'bytes' | 'stream' | 'hijacked'

/**
 * onSend, for a request in phase `running`: move it to `settling` at once (a second send of the
 * reply must not settle it again), then store the response or give the key back. Resolves with
 * the payload to hand on, which is `sent` unless it is captured on its way.
 */
export function settleResponse (reply: FastifyReply, http: HttpRequestState, sent: unknown): MaybePromise<unknown> {
  http.state.startSettling()
  const { settings } = http.route
  // A Response's own status is the one sent: it decides whether the answer is kept.
  const payload = adoptWebPayload(reply, sent)
  const statusCode = reply.statusCode
  const stream = isNodeStream(payload)
  if (http.failed || !isStorable(settings, statusCode)) {
    return then(end(reply, http, { kind: 'give-back', statusCode, reason: http.failed ? 'failed' : 'not-cacheable' }, stream ? 'stream' : 'bytes'), payload)
  }
  const trailers = replyTrailers(reply)
  // Whether Node writes the head with the body, in UTF-8, is known from the payload Fastify sends:
  // when onSend hooks of the route run after this one (@fastify/compress registered after the
  // plugin makes a stream of a string), only the route's last onSend hook knows it (settleFinal).
  const final = trailers === null && http.route.laterOnSend
  const headWithBody = !final && headWrittenWithBody(reply, payload)
  let ending: Ending | null = null
  // In a transaction the bytes are written with the handler's writes: a text body is text only outside one.
  if (typeof payload === 'string' && http.route.textBodies && http.state.transaction === null) {
    ending = fitsAsText(payload, settings.maxResponseBytes) ? storedText(reply, http, payload, headWithBody) : tooLarge(reply, http, headWithBody)
  } else {
    const bytes = payloadBytes(payload)
    if (bytes !== null) ending = bytes.length > settings.maxResponseBytes ? tooLarge(reply, http, headWithBody) : stored(reply, http, bytes, headWithBody)
  }
  if (ending !== null) {
    if (trailers !== null) {
      afterTrailers(reply, http, trailers, ending)
      return payload
    }
    if (final) {
      http.finalEnding = ending
      return payload
    }
    return then(end(reply, http, ending, 'bytes'), payload)
  }
  if (stream) return captured(reply, http, payload, trailers)
  // Anything else (a Response whose body was read already, a locked web stream, an object that
  // is not bytes): Fastify refuses to send it, and answers 500 instead. Nothing was answered, so
  // nothing is kept, as for an error.
  return then(end(reply, http, { kind: 'give-back', statusCode, reason: 'failed' }, 'bytes'), payload)
}

/**
 * The route's last onSend hook, for a response whose settle waits for it (`finalEnding`): the
 * payload is now the one Fastify sends, which says how its head goes out (head-bytes.ts).
 */
export function settleFinal (reply: FastifyReply, http: HttpRequestState, payload: unknown): MaybePromise<unknown> {
  let ending = http.finalEnding!
  http.finalEnding = null
  if (ending.kind === 'store' && headWrittenWithBody(reply, payload)) ending = { ...ending, response: responseAsSentWithBody(reply, ending.response) }
  return then(end(reply, http, ending, 'bytes'), payload)
}

/**
 * A response whose settle waited for the route's last onSend hook, which it will not reach: an
 * onSend hook after the plugin's failed (onError), or hijacked the reply ('close'). The handler
 * did answer, so its answer is settled as the plugin's onSend took it (its head as if written on
 * its own): kept for a retry, as when the plugin's onSend is the route's last. What the client gets
 * is no longer that answer, so nothing is withheld.
 */
export function settleWithoutFinal (reply: FastifyReply, http: HttpRequestState): MaybePromise<void> {
  const ending = http.finalEnding!
  http.finalEnding = null
  const ended = end(reply, http, ending, 'hijacked')
  // Settling reports its own failures; one that escapes it must still not go unhandled.
  return isPromise(ended) ? ended.catch((error: unknown) => { reply.log.error({ err: error }, 'fastify-idempotency: settling a response an onSend hook did not hand on failed') }) : ended
}

/**
 * A response with trailers is settled once their values are known, and they reach the client once
 * it is (trailers.ts). Its body is on its way by then: a success that must not be delivered is cut.
 */
function afterTrailers (reply: FastifyReply, http: HttpRequestState, trailers: NonNullable<ReturnType<typeof replyTrailers>>, ending: MaybePromise<Ending>): void {
  const collected = http.trailers = collectTrailers(reply, trailers)
  // A key given back (a stream that failed, whose trailers Fastify never asks for) is at once.
  const settled = Promise.resolve(ending).then(async (known) => {
    await end(reply, http, known.kind === 'store' ? { ...known, response: withTrailers(known.response, await collected.values) } : known, 'stream')
  })
  collected.holdUntil(settled)
  // Settling reports its own failures; one that escapes it must still not go unhandled.
  settled.catch((error: unknown) => { reply.log.error({ err: error }, 'fastify-idempotency: settling a response with trailers failed') })
}

/** `value` once `settled` has settled: at once when it has. */
function then<T> (settled: MaybePromise<void>, value: T): MaybePromise<T> {
  return isPromise(settled) ? settled.then(() => value) : value
}

/**
 * 'close' of a reply that was sent without onSend (hijacked, or ended by hand), for a request in
 * phase `running`: the body was never seen; what was written on the raw response is the outcome.
 */
export function settleHijacked (reply: FastifyReply, http: HttpRequestState): void {
  http.state.startSettling()
  const { settings, plugin } = http.route
  const statusCode = reply.raw.statusCode
  const keep = settings.keepUnstorable && !http.failed && isStorable(settings, statusCode)
  void end(reply, http, keep ? { kind: 'store', statusCode, response: hijackedOutcome(reply, plugin.excludedHeaders) } : { kind: 'give-back', statusCode, reason: 'hijacked' }, 'hijacked')
}

/**
 * What the client gets instead of a success that must not reach it (`settlement.deliverable` is
 * false: in transaction mode, its writes were rolled back).
 */
export function withholdSuccess (reply: FastifyReply, key: string, delivery: Delivery): void {
  switch (delivery) {
    case 'bytes':
      // Nothing is sent yet: the error answers instead (503).
      throw new IdempotencyStoreUnavailableError(key, new Error('transaction not committed'))
    case 'stream':
      // Too late for another status: cut the response, so the client never sees a clean success.
      reply.raw.destroy(new Error('fastify-idempotency: transaction not committed'))
      break
    case 'hijacked':
      // The handler wrote it itself: nothing can be taken back. The engine said why it was not kept.
      break
  }
}

/** The one way a request that ran ends: settle it, then withhold a success that must not be delivered. */
function end (reply: FastifyReply, http: HttpRequestState, ending: Ending, delivery: Delivery): MaybePromise<void> {
  const settlement = settle(http.route.engine, http.state, ending)
  if (isPromise(settlement)) return settlement.then((settled) => { withheld(reply, http, settled, delivery) })
  withheld(reply, http, settlement, delivery)
}

function withheld (reply: FastifyReply, http: HttpRequestState, settlement: Settlement, delivery: Delivery): void {
  if (!settlement.deliverable) withholdSuccess(reply, http.key, delivery)
}

/**
 * A stream payload: passed on while its bytes are captured; it ends once the response is settled.
 * Its head (status, headers) is taken now, as it is sent: what Fastify does with the reply later
 * (its error handling of a payload whose client left answers 500 to nobody) is not the answer.
 * A client that leaves mid-body does not end it: the handler did its work and is producing its
 * answer, so the source is read on and kept (a retry gets 409 in progress meanwhile, then the
 * replay). A source that has not ended `lockTimeout` after its client left is stopped, and its
 * outcome kept without the body, as for one too large.
 */
function captured (reply: FastifyReply, http: HttpRequestState, payload: Readable, trailers: ReturnType<typeof replyTrailers>): Readable {
  const { maxResponseBytes, lockTimeout } = http.route.settings
  const head = snapshotResponse(reply, http.route.plugin.excludedHeaders, null)
  const capture = captureStream(payload, maxResponseBytes, Number(reply.getHeader('content-length') ?? Number.NaN))
  void capture.clientGone.then(() => {
    const timer = setTimeout(capture.stop, lockTimeout)
    timer.unref()
    void capture.captured.then(() => { clearTimeout(timer) })
  })
  if (trailers === null) {
    capture.holdEndUntil(capture.captured.then(async (result) => { await end(reply, http, streamEnding(http, head, result), 'stream') }))
  } else {
    // Fastify asks for the trailers once the body has ended: the trailers, not the body's end, wait
    // for the settle.
    afterTrailers(reply, http, trailers, capture.captured.then((result) => streamEnding(http, head, result)))
  }
  return capture.stream
}

/** A stream that failed is the handler's failure: the key is freed. One that could not be kept whole keeps its outcome. */
function streamEnding (http: HttpRequestState, head: StoredResponse, result: Captured): Ending {
  if (result.body !== null) return { kind: 'store', statusCode: head.statusCode, response: withBody(head, result.body) }
  if (result.reason === 'failed') return { kind: 'give-back', statusCode: head.statusCode, reason: 'failed' }
  return unkept(http, head, result.reason === 'unfinished' ? 'interrupted' : 'too-large')
}

/** `headWithBody`: Node writes the head in one write with the body (head-bytes.ts). */
function stored (reply: FastifyReply, http: HttpRequestState, body: Buffer, headWithBody: boolean): Ending {
  return { kind: 'store', statusCode: reply.statusCode, response: snapshotResponse(reply, http.route.plugin.excludedHeaders, body, headWithBody) }
}

/** A body larger than `maxResponseBytes`: its outcome is kept without it, or the key freed. */
function tooLarge (reply: FastifyReply, http: HttpRequestState, headWithBody: boolean): Ending {
  return unkept(http, snapshotResponse(reply, http.route.plugin.excludedHeaders, null, headWithBody), 'too-large')
}

/**
 * Whether `text` is at most `limit` bytes once encoded: UTF-8 takes at least one byte per UTF-16
 * unit and at most three, so only a length between the two is encoded to be measured.
 */
function fitsAsText (text: string, limit: number): boolean {
  if (text.length > limit) return false
  return text.length * 3 <= limit || Buffer.byteLength(text) <= limit
}

function storedText (reply: FastifyReply, http: HttpRequestState, text: string, headWithBody: boolean): Ending {
  return { kind: 'store', statusCode: reply.statusCode, response: snapshotResponse(reply, http.route.plugin.excludedHeaders, TEXT_BODY, headWithBody), text }
}

/**
 * A body that cannot be kept leaves its outcome (`head`: status and headers), unless the route
 * frees the key instead: a retry must not run the operation again because its answer was large,
 * or because its client left before a stream ended.
 */
function unkept ({ route }: HttpRequestState, head: StoredResponse, reason: 'too-large' | 'interrupted'): Ending {
  return route.settings.keepUnstorable
    ? { kind: 'store', statusCode: head.statusCode, response: head }
    : { kind: 'give-back', statusCode: head.statusCode, reason }
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

/**
 * Hand the payload on to Fastify from a promise callback. Fastify throws from there when it refuses
 * the payload (a Response whose body was read, say): called from the handler, that throw would
 * have reached its error handler, so it is sent there, or the request would never be answered.
 * When it cannot write because a response was written already (it warns of that itself), the
 * error is kept at debug level: it must never become a rejection nobody handles, which would end
 * the process.
 */
export function handOn (reply: FastifyReply, done: (error: Error | null, payload?: unknown) => void, error: Error | null, payload?: unknown): void {
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
