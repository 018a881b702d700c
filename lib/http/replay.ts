/**
 * Sending a stored response to a retry. The stored status, headers and body are the first
 * answer's, with two exceptions that belong to the retry itself:
 *
 * - Trailers are sent again with the values the first answer sent (trailers.ts).
 * - Headers the current request's own hooks have set already (CORS, request ids, rate limits, set
 *   in onRequest or preHandler before the replay) win over stored ones.
 * - A body stored encoded (when @fastify/compress ran before this plugin's onSend) is decoded when
 *   the retry's Accept-Encoding does not accept that coding, so every retry gets what it asked
 *   for whatever the order in which the plugins were registered.
 */
import { promisify } from 'node:util'
import { brotliDecompress, gunzip, inflate } from 'node:zlib'
import { negotiate } from '@fastify/accept-negotiator'
import type { FastifyReply, FastifyRequest } from 'fastify'
import { isPseudoHeader } from './capture.js'
import { TRAILER_PREFIX } from './trailers.js'
import type { StoredResponse } from '../storage/types.js'

/** Marks a replay of an answer whose body was not kept (see StoredResponse.bodyOmitted). */
export const BODY_OMITTED_HEADER = 'Idempotent-Body-Omitted'

const DECODERS: Readonly<Record<string, (body: Buffer) => Promise<Buffer>>> = {
  gzip: promisify(gunzip),
  'x-gzip': promisify(gunzip),
  deflate: promisify(inflate),
  br: promisify(brotliDecompress)
}

/**
 * Set `reply` up to answer with `response` and send it. Returns a promise only when the body has
 * to be decoded first (a replay of anything else costs no promise): it resolves once it is sent.
 */
export function replayResponse (request: FastifyRequest, reply: FastifyReply, response: StoredResponse, replayHeader: string | null): Promise<void> | undefined {
  reply.code(response.statusCode)
  const { headers } = response
  for (const name in headers) {
    if (isPseudoHeader(name)) {
      // The first answer's trailers, with the values it sent (trailers.ts). Any other such entry (one
      // stored before pseudo-headers were left out could hold `:status`) is skipped: setting it throws.
      if (name.startsWith(TRAILER_PREFIX)) replayTrailer(reply, name.slice(TRAILER_PREFIX.length), headers[name]!)
    } else if (!reply.hasHeader(name)) {
      reply.header(name, headers[name])
    }
  }
  if (response.contentType !== null) reply.header('content-type', response.contentType)
  if (replayHeader !== null) reply.header(replayHeader, 'true')
  if (response.bodyOmitted === true) {
    // The outcome of an answer whose body was not kept: its status and headers, and no body.
    reply.header(BODY_OMITTED_HEADER, 'true').send(response.body)
    return undefined
  }
  const coding = headers['content-encoding']
  if (typeof coding === 'string') return acceptable(request, reply, coding, response.body).then((body) => { reply.send(body) })
  reply.send(response.body)
  return undefined
}

/** A stored trailer, sent again as the first answer sent it; one the handler of the retry's hooks set already is theirs. */
function replayTrailer (reply: FastifyReply, name: string, value: string | string[]): void {
  if (reply.hasTrailer(name)) return
  reply.trailer(name, (_reply: FastifyReply, _payload: unknown, done: (error: Error | null, value: string) => void) => { done(null, String(value)) })
}

/**
 * `body` as stored, if the request accepts `coding`; otherwise decoded (and the header dropped).
 * A stored body that does not decode is sent as stored, with its coding, rather than not at all.
 */
async function acceptable (request: FastifyRequest, reply: FastifyReply, coding: string, body: Buffer): Promise<Buffer> {
  const decode = DECODERS[coding.trim().toLowerCase()]
  const accepted = request.headers['accept-encoding']
  // No Accept-Encoding: send identity, as @fastify/compress does (RFC 9110 would allow any coding,
  // but a client that sends none, curl say, usually cannot decode one).
  if (decode === undefined || (typeof accepted === 'string' && negotiate(accepted, [coding, 'identity']) === coding)) return body
  try {
    const decoded = await decode(body)
    reply.removeHeader('content-encoding')
    return decoded
  } catch {
    return body
  }
}
