/**
 * Turning what Fastify is about to send (the onSend payload and the reply's headers) into a
 * StoredResponse, without changing a byte of what the client receives.
 */
import { Readable } from 'node:stream'
import type { ReadableStream as WebReadableStream } from 'node:stream/web'
import type { FastifyReply } from 'fastify'
import type { StoredResponse } from '../storage/types.js'
import { asSentWithBody } from './head-bytes.js'

/**
 * The payload as bytes, `null` for a stream or anything else that is not already in memory. A
 * string becomes a slice of Node's shared pool, the cheapest Buffer to make: a store copies what
 * it keeps (MemoryStorage copies it to memory of its own, a slice would keep the pool's whole
 * slab alive).
 */
export function payloadBytes (payload: unknown): Buffer | null {
  if (typeof payload === 'string') return Buffer.from(payload)
  if (Buffer.isBuffer(payload)) return payload
  if (payload === null || payload === undefined) return Buffer.alloc(0)
  return null
}

export function isNodeStream (payload: unknown): payload is Readable {
  return payload !== null && typeof payload === 'object' && typeof (payload as Readable).pipe === 'function'
}

type HeaderValues = Record<string, number | string | string[] | undefined>

/**
 * Status, content type and replayable headers of the reply as it stands, with `body`; with
 * `null`, the outcome of a response whose body could not be kept. `headWithBody`: Node writes this
 * answer's head with its body, in UTF-8 (see head-bytes.ts).
 */
export function snapshotResponse (reply: FastifyReply, excludedHeaders: ReadonlySet<string>, body: Buffer | null, headWithBody = false): StoredResponse {
  return outcome(reply.statusCode, reply.getHeaders(), excludedHeaders, body, headWithBody ? reply : null)
}

/** The body of a response whose body is kept as text (Ending's `text`): empty, one for all. */
export const TEXT_BODY: Buffer = Buffer.alloc(0)

/** An outcome taken with `snapshotResponse(..., null)`, now with its whole body. */
export function withBody (head: StoredResponse, body: Buffer): StoredResponse {
  return { statusCode: head.statusCode, contentType: head.contentType, headers: head.headers, body }
}

/**
 * A web `Response` or `ReadableStream` payload as Fastify would send it, done here instead of after
 * the onSend hooks, so that what is stored (and whether it is) is what is sent: a Response's status
 * and headers applied to the reply as Fastify applies them, and its body, like a web stream, as a
 * Node stream whose bytes can be captured. A consumed body or a locked stream is left as it is:
 * Fastify refuses it. Anything else is returned unchanged.
 */
export function adoptWebPayload (reply: FastifyReply, payload: unknown): unknown {
  if (typeof payload !== 'object' || payload === null) return payload
  if (isResponse(payload)) {
    if (payload.body !== null && (payload.bodyUsed || payload.body.locked)) return payload
    reply.code(payload.status)
    for (const [name, value] of payload.headers) reply.header(name, value)
    return payload.body === null ? null : Readable.fromWeb(payload.body as WebReadableStream)
  }
  if (isWebStream(payload) && !payload.locked) return Readable.fromWeb(payload)
  return payload
}

function isWebStream (payload: unknown): payload is WebReadableStream {
  return payload !== null && typeof payload === 'object' && typeof (payload as WebReadableStream).getReader === 'function'
}

/** The outcome of a hijacked reply: what was written on the raw response, without its body. */
export function hijackedOutcome (reply: FastifyReply, excludedHeaders: ReadonlySet<string>): StoredResponse {
  return outcome(reply.raw.statusCode, reply.raw.getHeaders(), excludedHeaders, null, null)
}

/**
 * HTTP/2 pseudo-headers (`:status`): once an HTTP/2 response's head is written, Node lists its
 * `:status` among the response's headers. It is the status, kept apart; setting it as a header
 * throws.
 */
export function isPseudoHeader (name: string): boolean {
  return name.charCodeAt(0) === 58 // ':'
}

function isResponse (payload: unknown): payload is Response {
  return payload !== null && typeof payload === 'object' && Object.prototype.toString.call(payload) === '[object Response]'
}

/**
 * The headers of every response that keeps none (most JSON answers: their content type is kept
 * apart): one object, frozen, where each would otherwise be one more object a store keeps.
 */
const NO_HEADERS: Readonly<Record<string, string | string[]>> = Object.freeze({})

/** A header value as stored: as its bytes went out when `headWithBody`'s head went with its body (head-bytes.ts). */
function headerText (value: unknown, headWithBody: FastifyReply | null): string {
  return headWithBody === null ? String(value) : asSentWithBody(headWithBody, String(value))
}

/** `headWithBody`: the reply, when Node writes its head in one UTF-8 write with its body; otherwise `null`. */
function outcome (statusCode: number, all: HeaderValues, excludedHeaders: ReadonlySet<string>, body: Buffer | null, headWithBody: FastifyReply | null): StoredResponse {
  let headers: Record<string, string | string[]> | null = null
  for (const name in all) {
    const value = all[name]
    if (value === undefined || excludedHeaders.has(name) || isPseudoHeader(name)) continue
    ;(headers ??= {})[name] = Array.isArray(value) ? value.map((item) => headerText(item, headWithBody)) : headerText(value, headWithBody)
  }
  const contentType = all['content-type']
  const response: StoredResponse = { statusCode, contentType: contentType === undefined ? null : headerText(contentType, headWithBody), headers: headers ?? NO_HEADERS, body: body ?? Buffer.alloc(0) }
  if (body === null) response.bodyOmitted = true
  return response
}

/**
 * What a stream capture kept: the whole body, or nothing and why: `too-large` (it outgrew the
 * limit), `failed` (the stream failed, or was destroyed before its end), `unfinished` (its client
 * had gone and it did not end in the time it was given, see `StreamCapture.stop`).
 */
export type Captured = { body: Buffer } | { body: null, reason: 'too-large' | 'failed' | 'unfinished' }

export interface StreamCapture {
  /** What to send instead of the source: the same bytes. */
  readonly stream: Readable
  /**
   * Resolves once: with the whole body after the last chunk, or with `null` as soon as the body
   * outgrows `maxBytes`, when the stream fails, or when `stop` is called.
   */
  readonly captured: Promise<Captured>
  /**
   * Resolves when the client went away before the end of the body (what was sent is destroyed):
   * the source is still read, to its end, and kept up to `maxBytes`.
   */
  readonly clientGone: Promise<void>
  /** Hold the end of the response until `settled`: the store is up to date before the client sees the end. */
  holdEndUntil: (settled: Promise<unknown>) => void
  /** Stop reading a source whose client has gone: it is destroyed, and `captured` says `unfinished`. */
  stop: () => void
}

/** A chunk of a stream as bytes: Readable.from() of strings and web streams give strings and Uint8Arrays. */
function chunkBytes (chunk: unknown): Buffer {
  if (Buffer.isBuffer(chunk)) return chunk
  if (typeof chunk === 'string') return Buffer.from(chunk)
  if (chunk instanceof Uint8Array) return Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength)
  throw new TypeError(`fastify-idempotency: a stream payload gave a chunk that is not bytes (${chunk === null ? 'null' : typeof chunk})`)
}

/**
 * Pass a stream through unchanged while keeping a copy of up to `maxBytes` of it. `length`: the
 * response's Content-Length, whose client has the whole answer with its last byte, before the end:
 * the chunk that completes it waits for the end's gate too.
 *
 * The source is read here, not piped to the client: when the client goes away (Fastify destroys
 * what it was sending), the handler has done its work and is producing its answer, so the source
 * is read on to its end and kept, and a retry replays it instead of running the handler again.
 * Only a source whose copy can no longer be kept (it outgrew `maxBytes`, or `stop`) is destroyed
 * once its client has gone, as Fastify destroys it without the plugin.
 */
export function captureStream (source: Readable, maxBytes: number, length = Number.NaN): StreamCapture {
  let chunks: Buffer[] | null = []
  let size = 0
  let sent = 0
  let last: Buffer | undefined
  let ended = false
  let gone = false
  let resolveCaptured!: (captured: Captured) => void
  let done = false
  const captured = new Promise<Captured>((resolve) => { resolveCaptured = resolve })
  let resolveGone!: () => void
  const clientGone = new Promise<void>((resolve) => { resolveGone = resolve })
  const finish = (result: Captured): void => {
    if (done) return
    done = true
    resolveCaptured(result)
  }
  // Until told otherwise the end waits for the capture only; a settle that began mid-stream (the
  // body outgrew the limit) is waited for too, so a client retrying at once finds the key free.
  let gate: Promise<unknown> = captured
  const out = new Readable({ read () { source.resume() } })
  // The client sees the response cut only once the key is given back: a retry at once runs.
  let failed = false
  const fail = (error: Error): void => {
    if (failed) return
    failed = true
    if (done) {
      out.destroy(error)
      return
    }
    finish({ body: null, reason: 'failed' })
    const cut = (): void => { out.destroy(error) }
    gate.then(cut, cut)
  }
  source.on('data', (chunk: unknown) => {
    let bytes: Buffer
    try {
      bytes = chunkBytes(chunk)
    } catch (error) {
      source.destroy(error as Error)
      return
    }
    if (chunks !== null) {
      size += bytes.length
      if (size > maxBytes) {
        chunks = null
        finish({ body: null, reason: 'too-large' })
        // Nobody reads it any more and nothing more of it can be kept.
        if (gone) source.destroy()
      } else {
        chunks.push(bytes)
      }
    }
    if (gone) return
    sent += bytes.length
    let next: Buffer | undefined = bytes
    if (sent >= length) {
      next = last
      last = bytes
    }
    if (next !== undefined && !out.push(next)) source.pause()
  })
  source.once('end', () => {
    ended = true
    finish(chunks === null ? { body: null, reason: 'too-large' } : { body: Buffer.concat(chunks, size) })
    const close = (): void => {
      if (out.destroyed) return
      if (last !== undefined) out.push(last)
      out.push(null)
    }
    gate.then(close, close)
  })
  source.once('error', fail)
  source.once('close', () => { if (!ended) fail(new Error('fastify-idempotency: the stream payload was destroyed before its end')) })
  out.once('close', () => {
    if (ended || done) {
      // Ended, or failed: nothing more to read. A source that outgrew the limit is not read on.
      if (!ended && chunks === null) source.destroy()
      return
    }
    gone = true
    resolveGone()
    source.resume()
  })
  return {
    stream: out,
    captured,
    clientGone,
    holdEndUntil: (settled) => { gate = settled },
    stop: () => {
      finish({ body: null, reason: 'unfinished' })
      source.destroy()
    }
  }
}
