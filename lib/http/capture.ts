/**
 * Turning what Fastify is about to send (the onSend payload and the reply's headers) into a
 * StoredResponse, without changing a byte of what the client receives.
 */
import { pipeline, Readable, Transform } from 'node:stream'
import type { ReadableStream as WebReadableStream } from 'node:stream/web'
import type { FastifyReply } from 'fastify'
import type { StoredResponse } from '../storage/types.js'

/** The payload as bytes, `null` for a stream or anything else that is not already in memory. */
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
 * `null`, the outcome of a response whose body could not be kept.
 */
export function snapshotResponse (reply: FastifyReply, excludedHeaders: ReadonlySet<string>, body: Buffer | null): StoredResponse {
  return outcome(reply.statusCode, reply.getHeaders(), excludedHeaders, body)
}

/**
 * A web `Response` or `ReadableStream` payload as Fastify would send it, done here instead of after
 * the onSend hooks, so that what is stored (and whether it is) is what is sent: a Response's status
 * and headers applied to the reply as Fastify applies them, and its body, like a web stream, as a
 * Node stream whose bytes can be captured. A consumed body or a locked stream is left as it is:
 * Fastify refuses it. Anything else is returned unchanged.
 */
export function adoptWebPayload (reply: FastifyReply, payload: unknown): unknown {
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
  return outcome(reply.raw.statusCode, reply.raw.getHeaders(), excludedHeaders, null)
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

function outcome (statusCode: number, all: HeaderValues, excludedHeaders: ReadonlySet<string>, body: Buffer | null): StoredResponse {
  const headers: Record<string, string | string[]> = {}
  for (const name in all) {
    const value = all[name]
    if (value === undefined || excludedHeaders.has(name) || isPseudoHeader(name)) continue
    headers[name] = Array.isArray(value) ? value.map(String) : String(value)
  }
  const contentType = all['content-type']
  const response: StoredResponse = { statusCode, contentType: contentType === undefined ? null : String(contentType), headers, body: body ?? Buffer.alloc(0) }
  if (body === null) response.bodyOmitted = true
  return response
}

/** What a stream capture kept: the whole body, or nothing and why. */
export type Captured = { body: Buffer } | { body: null, reason: 'too-large' | 'interrupted' }

export interface StreamCapture {
  /** What to send instead of the source: the same bytes. */
  readonly stream: Transform
  /**
   * Resolves once: with the whole body after the last chunk, or with `null` as soon as the body
   * outgrows `maxBytes`, or when the stream fails or the client goes away.
   */
  readonly captured: Promise<Captured>
  /** Hold the end of the response until `settled`: the store is up to date before the client sees the end. */
  holdEndUntil: (settled: Promise<unknown>) => void
}

/**
 * Pass a stream through unchanged while keeping a copy of up to `maxBytes` of it. `length`: the
 * response's Content-Length, whose client has the whole answer with its last byte, before the end:
 * the chunk that completes it waits for the end's gate too.
 */
export function captureStream (source: Readable, maxBytes: number, length = Number.NaN): StreamCapture {
  let chunks: Buffer[] | null = []
  let size = 0
  let sent = 0
  let last: Buffer | undefined
  let resolveCaptured!: (captured: Captured) => void
  let done = false
  const captured = new Promise<Captured>((resolve) => { resolveCaptured = resolve })
  const finish = (result: Captured): void => {
    if (done) return
    done = true
    resolveCaptured(result)
  }
  // Until told otherwise the end waits for the capture only; a settle that began mid-stream (the
  // body outgrew the limit) is waited for too, so a client retrying at once finds the key free.
  let gate: Promise<unknown> = captured
  const tee = new Transform({
    transform (chunk: Buffer, _encoding, callback) {
      if (chunks !== null) {
        size += chunk.length
        if (size > maxBytes) {
          chunks = null
          finish({ body: null, reason: 'too-large' })
        } else {
          chunks.push(chunk)
        }
      }
      sent += chunk.length
      if (sent < length || Number.isNaN(length)) {
        callback(null, chunk)
        return
      }
      const held = last
      last = chunk
      callback(null, held)
    },
    flush (callback) {
      finish(chunks === null ? { body: null, reason: 'too-large' } : { body: Buffer.concat(chunks, size) })
      gate.then(() => callback(null, last), () => callback(null, last))
    }
  })
  tee.once('close', () => { finish({ body: null, reason: 'interrupted' }) })
  // pipeline carries a source error into `tee` and a destroyed `tee` (client gone) back to the source.
  pipeline(source, tee, () => {})
  return { stream: tee, captured, holdEndUntil: (settled) => { gate = settled } }
}
