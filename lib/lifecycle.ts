/**
 * The request lifecycle of a guarded route, top to bottom:
 *
 *   onRequest   read and validate the key (400 before anything else happens)
 *   preHandler  fingerprint, then one atomic `begin`: replay, refuse, or take the lease and run
 *   onSend      capture the response and `complete` (store + drop the lease), or `release`
 *   'close'     a hijacked reply, which never reaches onSend, releases there
 *
 * Hooks are created per route from that route's settings, so nothing here looks options up.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { FastifyError, FastifyReply, FastifyRequest, onErrorHookHandler, onRequestHookHandler, onSendHookHandler, preHandlerAsyncHookHandler } from 'fastify'
import { captureStream, isNodeStream, payloadBytes, snapshotResponse } from './capture.js'
import {
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyKeyMissingError,
  IdempotencyRequestInProgressError,
  IdempotencyStoreUnavailableError
} from './errors.js'
import { channels, type IdempotencyEvent, type IdempotencyOutcome } from './diagnostics.js'
import { computeFingerprint } from './fingerprint.js'
import { readIdempotencyKey } from './key.js'
import { LeaseRenewal, type RenewedLease } from './lease-renewal.js'
import type { RouteSettings } from './options.js'
import type { StorageTransaction, StoredResponse, TransactionalStorage } from './storage/types.js'

/** Where the per-request state lives (a request decoration, so request objects keep one shape). */
export const kState = Symbol('fastify-idempotency.state')

type Phase =
  /** Key read; the store not asked yet, or it refused us (replay, mismatch, in progress). */
  | 'idle'
  /** This request holds the lease and its handler is running. */
  | 'held'
  /** Storing or releasing has begun; nothing else may. */
  | 'settling'
  /** A stored response is being replayed. */
  | 'replayed'

interface RequestState extends RenewedLease {
  request: FastifyRequest
  key: string
  phase: Phase
  /** performance.now() when the plugin first went to the store for this request. */
  started: number
  storageKey: string
  token: string
  /** The replayed response had no Content-Type; Fastify adds one to Buffers, so it is taken off again. */
  replayWithoutType: boolean
  /** The handler (or a hook after ours) failed: whatever status the error handler picks, nothing is stored. */
  failed: boolean
  /** Transaction mode: the transaction the handler writes through, committed with the stored response. */
  transaction: StorageTransaction | null
}

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
}

type ContextRequest = FastifyRequest & { idempotency: IdempotencyRequestContext | null }

type StatefulRequest = FastifyRequest & { [kState]: RequestState | null }

export interface RouteHooks {
  onRequest: onRequestHookHandler
  preHandler: preHandlerAsyncHookHandler
  onSend: onSendHookHandler
  onError: onErrorHookHandler
  /** The route's lease renewal, stopped when the server closes. */
  renewal: { stop: () => void }
}

export function createRouteHooks (settings: RouteSettings): RouteHooks {
  const { storage, headerLabel } = settings
  const storeName = storage.constructor.name

  /** Publish an outcome; the event object is only built when someone listens. */
  function emit (outcome: IdempotencyOutcome, request: FastifyRequest, state: RequestState, extra?: Partial<IdempotencyEvent>): void {
    const channel = channels[outcome]
    if (!channel.hasSubscribers) return
    channel.publish({
      outcome,
      idempotencyKey: state.key,
      method: request.method,
      route: request.routeOptions.url ?? request.url,
      store: storeName,
      durationMs: performance.now() - state.started,
      ...extra
    } satisfies IdempotencyEvent)
  }

  /** One timer renews the leases of this route's running handlers. */
  const renewal = new LeaseRenewal<RequestState>(settings.lockTimeout, (state) => {
    const { request } = state
    // Through a promise, so a custom store that throws instead of rejecting cannot throw out of
    // the shared timer (which would end the process).
    Promise.resolve().then(() => storage.renew(state.storageKey, state.token, settings.lockTimeout)).then((held) => {
      if (held || state.phase !== 'held') return
      emit('lease-lost', request, state, { phase: 'renew' })
      request.log.warn({ idempotencyKey: state.key }, 'idempotency lease lost while the handler was running')
    }, (error: unknown) => {
      emit('store-error', request, state, { phase: 'renew', error })
      request.log.warn({ err: error, idempotencyKey: state.key }, 'idempotency lease renewal failed')
    })
  })

  function onRequest (request: FastifyRequest, _reply: FastifyReply, done: (error?: Error) => void): void {
    let key
    try {
      key = readIdempotencyKey(request.headers[settings.headerName], headerLabel, settings.maxKeyLength)
    } catch (error) {
      done(error as Error)
      return
    }
    if (key === undefined) {
      done(settings.required ? new IdempotencyKeyMissingError(headerLabel) : undefined)
      return
    }
    (request as ContextRequest).idempotency = { key, transaction: undefined }
    ;(request as StatefulRequest)[kState] = { request, key, phase: 'idle', started: 0, storageKey: '', token: '', replayWithoutType: false, failed: false, transaction: null, renewing: false, renewedAt: 0, previousHeld: null, nextHeld: null }
    done()
  }

  async function scopedKey (request: FastifyRequest, key: string): Promise<string> {
    const scope = await settings.scope!(request)
    if (typeof scope !== 'string') throw new TypeError('fastify-idempotency: scope(request) must return a string')
    // Keys never contain a line feed (they are printable ASCII), so the last one separates the two.
    return `${scope}\n${key}`
  }

  async function preHandler (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply | undefined> {
    const state = (request as StatefulRequest)[kState]
    if (state === null) return undefined
    let fingerprint
    try {
      fingerprint = computeFingerprint(request, settings.fingerprint)
    } catch (error) {
      // Canonicalizing recurses: JSON nested deep enough overflows the stack. A 400, not a 500.
      throw new IdempotencyFingerprintError(state.key, error)
    }
    // Without a scope there is nothing to await: no promise on the path of every request.
    const storageKey = settings.scope === null ? state.key : await scopedKey(request, state.key)
    const waitUntil = settings.waitTimeout > 0 ? Date.now() + settings.waitTimeout : 0
    state.started = performance.now()
    for (let attempt = 0; ; attempt++) {
      let result
      try {
        result = await storage.begin(storageKey, fingerprint, settings.lockTimeout)
      } catch (error) {
        emit('store-error', request, state, { phase: 'begin', failOpen: settings.failOpen, error })
        if (!settings.failOpen) {
          request.log.error({ err: error, idempotencyKey: state.key }, 'idempotency store unavailable: answering 503')
          throw new IdempotencyStoreUnavailableError(state.key, error)
        }
        request.log.warn({ err: error, idempotencyKey: state.key }, 'idempotency store unavailable: running the handler without protection (failOpen)')
        ;(request as StatefulRequest)[kState] = null
        return undefined
      }
      if (attempt > 0) emit('wait', request, state, { waitedMs: performance.now() - state.started })
      if (result.state === 'acquired') {
        state.phase = 'held'
        state.storageKey = storageKey
        state.token = result.token
        if (settings.transaction) await openTransaction(request, state)
        holdLease(request, reply, state)
        return undefined
      }
      // A different request under this key is refused whether the first one finished or not.
      if (result.fingerprint !== fingerprint) {
        emit('mismatch', request, state)
        request.log.debug({ idempotencyKey: state.key }, 'idempotency key reused with another fingerprint')
        throw new IdempotencyFingerprintMismatchError(state.key, settings.mismatchStatusCode)
      }
      if (result.state === 'completed') {
        emit('replay', request, state, { statusCode: result.response.statusCode })
        request.log.debug({ idempotencyKey: state.key }, 'idempotency replay')
        replay(reply, state, result.response)
        // Returning the reply tells Fastify the response is under way: without it, Fastify goes on
        // to the handler whenever the send is still pending (any asynchronous onSend hook).
        return reply
      }
      const now = Date.now()
      if (now >= waitUntil) {
        emit('in-progress', request, state)
        request.log.debug({ idempotencyKey: state.key }, 'idempotency key in progress')
        throw new IdempotencyRequestInProgressError(state.key, (result.lockExpiresAt - now) / 1000)
      }
      await waitForLease(storageKey, Math.min(waitUntil, result.lockExpiresAt) - now, attempt)
    }
  }

  /**
   * Wait for the lease holder to finish: on the store's own signal where it has one, otherwise by
   * polling with a back-off (25 ms doubling to 400 ms) that keeps the store's load bounded.
   */
  async function waitForLease (storageKey: string, timeout: number, attempt: number): Promise<void> {
    if (timeout <= 0) return
    if (storage.waitFor !== undefined) {
      try {
        await storage.waitFor(storageKey, timeout)
        return
      } catch {
        // The store cannot wait right now (say, its subscriber connection is down): poll instead.
      }
    }
    await sleep(Math.min(timeout, 25 * 2 ** Math.min(attempt, 4)))
  }

  function replay (reply: FastifyReply, state: RequestState, response: StoredResponse): void {
    state.phase = 'replayed'
    reply.code(response.statusCode)
    for (const name in response.headers) reply.header(name, response.headers[name])
    if (response.contentType === null) state.replayWithoutType = true
    else reply.header('content-type', response.contentType)
    if (settings.replayHeader !== null) reply.header(settings.replayHeader, 'true')
    reply.send(response.body)
  }

  /**
   * Transaction mode: the lease is already committed on its own (so duplicates see the request in
   * flight); the handler's writes and the stored response go into this transaction.
   */
  async function openTransaction (request: FastifyRequest, state: RequestState): Promise<void> {
    try {
      state.transaction = await (storage as TransactionalStorage).transaction()
    } catch (error) {
      state.phase = 'settling'
      emit('store-error', request, state, { phase: 'begin', failOpen: false, error })
      request.log.error({ err: error, idempotencyKey: state.key }, 'idempotency transaction could not be opened: answering 503')
      await storage.release(state.storageKey, state.token).catch(() => {})
      throw new IdempotencyStoreUnavailableError(state.key, error)
    }
    (request as ContextRequest).idempotency = { key: state.key, transaction: state.transaction.handle }
  }

  /** Keep the lease alive while the handler runs, and let a hijacked reply give it back. */
  function holdLease (request: FastifyRequest, reply: FastifyReply, state: RequestState): void {
    renewal.hold(state)
    reply.raw.once('close', () => {
      if (state.phase !== 'held') return
      // Hijacked (or ended by hand): onSend will never run, so nothing can be stored.
      if (reply.sent) {
        void settle(request, reply, state, null, 'hijacked')
        return
      }
      // The client went away while the handler runs. The lease stays, so a retry does not run the
      // handler a second time alongside it, and onSend settles it with the handler's outcome (a
      // retry then replays what was done). Renewal stops, though: a handler that never answers
      // frees the key once lockTimeout has passed instead of holding it for ever.
      renewal.drop(state)
    })
  }

  type NotStored = NonNullable<IdempotencyEvent['reason']>

  /** The handler ran: say whether its response was stored, and if not, why. */
  function executed (request: FastifyRequest, reply: FastifyReply, state: RequestState, reason: NotStored | undefined): void {
    emit('execute', request, state, { statusCode: reply.statusCode, stored: reason === undefined, ...(reason === undefined ? {} : { reason }) })
  }

  /**
   * Store the response, or with `null` drop the lease (`why` says why). Never throws: the client
   * gets its response whatever the store does. Resolves `false` only in transaction mode, when the
   * response was meant to be kept and was not (its writes were rolled back): the client must not
   * receive it as a success.
   */
  async function settle (request: FastifyRequest, reply: FastifyReply, state: RequestState, response: StoredResponse | null, why: NotStored = 'not-cacheable'): Promise<boolean> {
    state.phase = 'settling'
    renewal.drop(state)
    if (state.transaction !== null) return settleTransaction(request, reply, state, state.transaction, response, why)
    let reason: NotStored | undefined = response === null ? why : undefined
    const phase = response === null ? 'release' : 'complete'
    try {
      if (response === null) {
        await storage.release(state.storageKey, state.token)
      } else if (!await storage.complete(state.storageKey, state.token, response, settings.expiration)) {
        reason = 'lease-lost'
        emit('lease-lost', request, state, { phase })
        request.log.warn({ idempotencyKey: state.key }, 'idempotency lease was lost before the response was stored: this response was not stored')
      }
    } catch (error) {
      if (response !== null) reason = 'store-error'
      emit('store-error', request, state, { phase, error })
      request.log.error({ err: error, idempotencyKey: state.key }, `idempotency store failed after the handler ran: the response was sent but ${response === null ? 'the key stays locked until its lease lapses' : 'not stored'}`)
    }
    executed(request, reply, state, reason)
    return true
  }

  /**
   * Transaction mode: commit the handler's writes with the stored response, or roll both back and
   * free the key. A response that was to be kept but could not be (lease lost, commit failed)
   * resolves `false`.
   */
  async function settleTransaction (request: FastifyRequest, reply: FastifyReply, state: RequestState, transaction: StorageTransaction, response: StoredResponse | null, why: NotStored): Promise<boolean> {
    let reason: NotStored | undefined = response === null ? why : undefined
    try {
      if (response !== null && await transaction.complete(state.storageKey, state.token, response, settings.expiration)) {
        await transaction.commit()
      } else {
        if (response !== null) {
          reason = 'lease-lost'
          emit('lease-lost', request, state, { phase: 'complete' })
          request.log.warn({ idempotencyKey: state.key }, 'idempotency lease was lost before commit: the transaction was rolled back')
        }
        await transaction.rollback()
      }
    } catch (error) {
      reason = response === null ? why : 'store-error'
      emit('store-error', request, state, { phase: 'complete', error })
      request.log.error({ err: error, idempotencyKey: state.key }, 'idempotency transaction failed: rolled back')
      await transaction.rollback().catch(() => {})
    }
    if (reason !== undefined) {
      await storage.release(state.storageKey, state.token).catch((error: unknown) => {
        emit('store-error', request, state, { phase: 'release', error })
        request.log.error({ err: error, idempotencyKey: state.key }, 'idempotency lease could not be released: the key stays locked until its lease lapses')
      })
    }
    executed(request, reply, state, reason)
    // An error answer rolled back is what the client expects; a success whose writes were rolled
    // back (lease lost, commit failed, or a body that cannot be stored) is not.
    return reason === undefined || reason === 'not-cacheable' || reason === 'failed' || reason === 'hijacked'
  }

  /**
   * Callback style, not async: most responses (replays, requests without a key, refusals) pass
   * straight through, and an async hook would cost each of them a promise and a microtask.
   */
  function onSend (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: (error: Error | null, payload?: unknown) => void): void {
    const state = (request as StatefulRequest)[kState]
    if (state !== null && state.phase === 'held') {
      settleResponse(request, reply, state, payload).then((sent) => { done(null, sent) }, done)
      return
    }
    if (state !== null && state.phase === 'replayed' && state.replayWithoutType) reply.removeHeader('content-type')
    done(null, payload)
  }

  /** The handler's response: store it (or drop the lease) and hand on the payload to send. */
  async function settleResponse (request: FastifyRequest, reply: FastifyReply, state: RequestState, payload: unknown): Promise<unknown> {
    if (state.failed || !settings.cacheable.has(reply.statusCode)) {
      await settle(request, reply, state, null, state.failed ? 'failed' : 'not-cacheable')
      return payload
    }
    const bytes = payloadBytes(payload)
    if (bytes !== null) {
      const response = bytes.length > settings.maxResponseBytes ? null : snapshotResponse(reply, settings.excludedHeaders, bytes)
      if (!await settle(request, reply, state, response, 'too-large')) {
        // Transaction mode: the writes were rolled back, so this success must not reach the client.
        throw new IdempotencyStoreUnavailableError(state.key, new Error('transaction not committed'))
      }
      return payload
    }
    if (isNodeStream(payload)) {
      state.phase = 'settling'
      return captureStream(payload, settings.maxResponseBytes, async (body, why) => {
        const kept = await settle(request, reply, state, body === null ? null : snapshotResponse(reply, settings.excludedHeaders, body), why)
        // Too late for another status: cut the response, so the client never sees a clean success.
        if (!kept) reply.raw.destroy(new Error('fastify-idempotency: transaction not committed'))
      })
    }
    // A web stream or a Response: sent as it is, not stored (in transaction mode, refused).
    if (!await settle(request, reply, state, null, 'not-capturable')) {
      throw new IdempotencyStoreUnavailableError(state.key, new Error('response cannot be stored in transaction mode'))
    }
    return payload
  }

  function onError (request: FastifyRequest, _reply: FastifyReply, _error: FastifyError, done: () => void): void {
    const state = (request as StatefulRequest)[kState]
    if (state !== null) state.failed = true
    done()
  }

  return { onRequest, preHandler, onSend: onSend as onSendHookHandler, onError, renewal }
}
