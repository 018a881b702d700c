/**
 * `fingerprint: { body: 'raw' }`: a hash of the request's bytes exactly as they came over the
 * wire, before any parser, for bodies the plugin cannot see once parsed (multipart uploads, custom
 * parsers, `attachFieldsToBody`). Whatever the options, a body no parser made a value of (one
 * nobody has read, a stream a parser handed on as `request.body`) is hashed the same way.
 *
 * The bytes are hashed as whoever reads the request reads them (Fastify's content-type parser,
 * @fastify/multipart's busboy, which reads `request.raw` itself): the tap watches the raw stream's
 * 'data' and 'end' events, so nothing is buffered or read twice. If nothing has read the body by the
 * time the fingerprint is needed (multipart in stream mode, whose reader is the handler), the
 * plugin reads it itself, up to the route's body limit, and puts the bytes back into the stream
 * unread, so the handler's reader gets them all as if nobody had been there: the one copy the
 * plugin keeps, for as long as the handler takes to read it.
 *
 * A multipart body's boundary is chosen anew by most clients for every attempt (fetch's FormData
 * does), so the hash leaves it out: the same form sent twice hashes the same.
 */
import { createHash, type Hash } from 'node:crypto'
import { IncomingMessage } from 'node:http'
import type { Readable } from 'node:stream'
import type { FastifyRequest } from 'fastify'
import { FingerprintValueError, isStream } from '../fingerprint/canonical-value.js'
import { shareIdentity } from '../storage/error-identity.js'

type Emit = Readable['emit']

/** A Node stream or a web ReadableStream: a body a parser handed on unread (a proxy's). */
export function isStreamBody (body: unknown): body is object {
  return body !== null && typeof body === 'object' && isStream(body)
}

/**
 * The hash to take of a body that counts by its bytes because no parser made a value of it: a
 * request body nobody has read (multipart in stream mode, whose reader is the handler), or a
 * stream a parser handed on as `request.body` (@fastify/http-proxy's, a custom parser's). `null`
 * for a body some parser made a value of.
 */
export function unparsedBody (request: FastifyRequest): RawBodyHash | null {
  const body = request.body
  const contentType = request.headers['content-type']
  if (body === undefined) return RawBodyHash.unread(request.raw) ? new RawBodyHash(request.raw, contentType) : null
  if (!isStreamBody(body)) return null
  const stream = body as Partial<Readable>
  if (typeof stream.read !== 'function' || typeof stream.unshift !== 'function') {
    throw new FingerprintValueError('the body is a web ReadableStream, whose bytes the plugin cannot read and give back; fingerprint the route with body: \'raw\'')
  }
  if (stream.readableDidRead === true) {
    throw new FingerprintValueError('the body is a stream that was read before the fingerprint could be taken; fingerprint the route with body: \'raw\'')
  }
  return new RawBodyHash(body as Readable, contentType)
}

export class RawBodyHash {
  readonly #raw: Readable
  readonly #hash: BoundaryElidingHash
  #size = 0
  #digest: string | null = null
  /** The tap hashes 'data' events; not while the plugin reads ahead itself. */
  #tapping = false

  /** `raw`: the request's stream, or the stream a parser handed on; `contentType`: the request's. */
  constructor (raw: Readable, contentType: string | undefined) {
    this.#raw = raw
    this.#hash = new BoundaryElidingHash(multipartBoundary(contentType))
  }

  /**
   * Whether the body is still there to be read: it has one and no parser has read it. Such a body
   * that reaches the handler unparsed (request.body undefined) is one the handler reads itself,
   * and is fingerprinted by its raw bytes.
   */
  static unread (raw: IncomingMessage): boolean {
    return hasBody(raw) && !raw.readableEnded && raw.readableDidRead === false
  }

  /** Hash what is read from the stream from now on, by whoever reads it. */
  tap (): this {
    const emit: Emit = this.#raw.emit
    const tap = this
    this.#tapping = true
    // An own property of this request's stream only: the prototype's emit is untouched.
    this.#raw.emit = function (this: Readable, event: string | symbol, ...args: unknown[]): boolean {
      if (tap.#tapping) {
        if (event === 'data') tap.#update(args[0] as Buffer | string)
        else if (event === 'end') tap.#finish()
      }
      return emit.call(this, event, ...args)
    } as Emit
    return this
  }

  /**
   * The hash of the whole body (SHA-256, base64url). Reads the body first if nobody has, and then
   * puts it back; rejects with a 413 error past `limit` bytes, or when the client goes away.
   */
  async digest (limit: number): Promise<string> {
    if (this.#digest === null) await this.#readAhead(limit)
    return this.#digest!
  }

  #update (chunk: Buffer | string): void {
    const bytes = typeof chunk === 'string' ? Buffer.from(chunk) : chunk
    this.#size += bytes.length
    this.#hash.update(bytes)
  }

  #finish (): void {
    this.#tapping = false
    this.#digest = this.#hash.digest()
  }

  async #readAhead (limit: number): Promise<void> {
    const raw = this.#raw
    const chunks: Buffer[] = []
    // Bytes read before (none when nobody read) are hashed already; the rest is hashed here.
    this.#tapping = false
    for (;;) {
      const chunk = raw.read() as Buffer | null
      if (chunk !== null) {
        chunks.push(chunk)
        this.#update(chunk)
        if (this.#size > limit) throw new BodyTooLargeError(limit)
        continue
      }
      // The whole message has arrived and the buffer is empty: that was the last byte. 'end' is
      // not emitted yet, and once the bytes are put back it waits for them to be read.
      if (arrived(raw)) break
      await readable(raw)
    }
    this.#finish()
    if (chunks.length > 0) raw.unshift(Buffer.concat(chunks))
  }
}

/**
 * Whether a request has a body: over HTTP/1.1, a length above 0 or chunked encoding; over HTTP/2,
 * which needs neither (and forbids chunked), a stream that did not end with its headers. A request
 * that came through neither parser (`app.inject` with a stream payload, which sends no length)
 * may have one whatever its headers say: reading it tells.
 */
function hasBody (raw: IncomingMessage): boolean {
  const length = raw.headers['content-length']
  if (length !== undefined) return length !== '0'
  if (raw.headers['transfer-encoding'] !== undefined) return true
  const stream = http2Stream(raw)
  if (stream !== undefined) return !stream.endAfterHeaders
  return !(raw instanceof IncomingMessage)
}

/**
 * Whether the whole body has arrived (all of it pushed into `raw`): HTTP/1.1's parser sets
 * `complete`; an HTTP/2 request's `complete` waits for 'end', which comes only once the body is
 * read, so there the stream under it tells: it has ended. Other requests (`app.inject`'s, which
 * @fastify/aws-lambda and the like answer with) have neither: there the stream's own state tells
 * that its end has been pushed, which Node keeps in `_readableState.ended` and exposes no other way.
 */
function arrived (raw: Readable): boolean {
  if ((raw as Partial<IncomingMessage>).complete === true || http2Stream(raw)?.readableEnded === true) return true
  return (raw as { _readableState?: { ended?: boolean } })._readableState?.ended === true
}

/** The HTTP/2 stream under a request of Fastify's `http2: true` server; `undefined` over HTTP/1.1. */
function http2Stream (raw: Readable): { endAfterHeaders: boolean, readableEnded: boolean } | undefined {
  return (raw as { stream?: { endAfterHeaders: boolean, readableEnded: boolean } }).stream
}

/** The delimiter of a multipart body (`--` and the boundary), from its Content-Type; `null` for other bodies. */
function multipartBoundary (contentType: string | undefined): Buffer | null {
  if (contentType === undefined || !/^multipart\//i.test(contentType)) return null
  const match = /;\s*boundary=(?:"([^"]+)"|([^;\s]+))/i.exec(contentType)
  const boundary = match?.[1] ?? match?.[2]
  return boundary === undefined ? null : Buffer.from(`--${boundary}`)
}

/**
 * SHA-256 of a byte stream with every occurrence of `elide` left out, wherever the chunks happen
 * to cut it: the last `elide.length - 1` bytes of each chunk wait for the next one.
 */
class BoundaryElidingHash {
  readonly #hash: Hash = createHash('sha256')
  readonly #elide: Buffer | null
  #carry: Buffer = Buffer.alloc(0)

  constructor (elide: Buffer | null) {
    this.#elide = elide
  }

  update (chunk: Buffer): void {
    const elide = this.#elide
    if (elide === null) {
      this.#hash.update(chunk)
      return
    }
    const data = this.#carry.length === 0 ? chunk : Buffer.concat([this.#carry, chunk])
    let from = 0
    for (let at = data.indexOf(elide, from); at !== -1; at = data.indexOf(elide, from)) {
      this.#hash.update(data.subarray(from, at))
      from = at + elide.length
    }
    // Keep what could be the start of a delimiter the next chunk completes.
    const keep = Math.max(from, data.length - (elide.length - 1))
    this.#hash.update(data.subarray(from, keep))
    this.#carry = Buffer.from(data.subarray(keep))
  }

  digest (): string {
    this.#hash.update(this.#carry)
    return this.#hash.digest('base64url')
  }
}

/** Resolves when more of the body can be read; rejects if the request ends without it. */
function readable (raw: Readable): Promise<void> {
  return new Promise((resolve, reject) => {
    const done = (error?: Error): void => {
      raw.off('readable', onReadable)
      raw.off('close', onClose)
      if (error === undefined) resolve()
      else reject(error)
    }
    const onReadable = (): void => { done() }
    const onClose = (): void => { done(arrived(raw) ? undefined : new Error('the client went away before the request body was complete')) }
    raw.once('readable', onReadable)
    raw.once('close', onClose)
  })
}

/** The body outgrew the route's limit while the plugin read it for its fingerprint. */
export class BodyTooLargeError extends Error {
  /** 413 Content Too Large. */
  readonly statusCode = 413
  /** Fastify's own code for a body over `bodyLimit`. */
  readonly code = 'FST_ERR_CTP_BODY_TOO_LARGE'
  constructor (limit: number) {
    super(`Request body is too large: over ${limit} bytes`)
    this.name = 'BodyTooLargeError'
  }
}
shareIdentity(BodyTooLargeError, 'BodyTooLargeError')
