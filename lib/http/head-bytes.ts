/**
 * The bytes a response's head goes out as, so that a replay's head carries the first answer's.
 *
 * A header value may hold characters U+0080 to U+00FF (`filename="café.csv"`), and Node writes them
 * in one of two ways. Over HTTP/1, a head written alone goes out in latin1 (one byte each); but a
 * head whose body is a string written whole with it (`res.end(string)`, what Fastify does for a
 * string or JSON answer) is joined to that string and written in one write, in UTF-8 (two bytes
 * each). A replay is sent from stored bytes, so its head always goes alone, in latin1: a value of
 * an answer whose head went in UTF-8 is stored as the text whose latin1 bytes are what was sent,
 * and a client gets the same bytes twice. Nothing changes for a value in ASCII, the usual case.
 */
import { Socket } from 'node:net'
import type { FastifyReply } from 'fastify'
import type { StoredResponse } from '../storage/types.js'
import { replyTrailers } from './trailers.js'

const BEYOND_ASCII = /[\u0080-\u00ff]/

/**
 * Whether Node writes this answer's head in one UTF-8 write with `payload`, the payload Fastify is
 * about to send: a string that is not empty, on a response that has a body, over a real HTTP/1
 * connection (`app.inject` writes no bytes, and HTTP/2 sends its headers in frames of their own).
 */
export function headWrittenWithBody (reply: FastifyReply, payload: unknown): boolean {
  if (typeof payload !== 'string' || payload.length === 0) return false
  const status = reply.statusCode
  if (status < 200 || status === 204 || status === 304) return false
  return reply.request.raw.httpVersionMajor === 1 && reply.raw.socket instanceof Socket
}

/**
 * `value` as stored for a head written in UTF-8 (see above): unchanged when it is all ASCII, the
 * usual case, which costs one test; otherwise the text whose latin1 bytes are its UTF-8 bytes,
 * unless the answer has trailers (`reply.trailer()`), which Fastify sends in chunked encoding: its
 * first write then is a chunk's length, in latin1, and the head goes with it.
 */
export function asSentWithBody (reply: FastifyReply, value: string): string {
  if (!BEYOND_ASCII.test(value) || replyTrailers(reply) !== null) return value
  return Buffer.from(value, 'utf8').toString('latin1')
}

/**
 * `response`, taken with its values as they were set, as stored for a head written in UTF-8 with
 * its body (see above): used when only the final payload, after the onSend hooks of plugins
 * registered after this one (@fastify/compress), says how the head goes out.
 */
export function responseAsSentWithBody (reply: FastifyReply, response: StoredResponse): StoredResponse {
  const headers: Record<string, string | string[]> = {}
  for (const name in response.headers) {
    const value = response.headers[name]!
    headers[name] = Array.isArray(value) ? value.map((item) => asSentWithBody(reply, item)) : asSentWithBody(reply, value)
  }
  return { ...response, headers, contentType: response.contentType === null ? null : asSentWithBody(reply, response.contentType) }
}
