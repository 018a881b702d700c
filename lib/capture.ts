/**
 * Turning what Fastify is about to send (the onSend payload and the reply's headers) into a
 * StoredResponse, without changing a byte of what the client receives.
 */
import { pipeline, Transform, type Readable } from 'node:stream'
import type { FastifyReply } from 'fastify'
import type { StoredResponse } from './storage/types.js'

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

/** Status, content type and replayable headers of the reply as it stands, with `body`. */
export function snapshotResponse (reply: FastifyReply, excludedHeaders: ReadonlySet<string>, body: Buffer): StoredResponse {
  const all = reply.getHeaders()
  const headers: Record<string, string | string[]> = {}
  for (const name in all) {
    const value = all[name]
    if (value === undefined || excludedHeaders.has(name)) continue
    headers[name] = Array.isArray(value) ? value.map(String) : String(value)
  }
  const contentType = all['content-type']
  return { statusCode: reply.statusCode, contentType: contentType === undefined ? null : String(contentType), headers, body }
}

/**
 * Pass a stream through unchanged while keeping a copy of up to `maxBytes` of it. `settle` is
 * called exactly once: with the whole body after the last chunk, or with `null` as soon as the
 * body outgrows `maxBytes`, or when the stream fails or the client goes away. The end of the
 * response waits for it either way, so the store is up to date before the client sees the end.
 */
export function captureStream (source: Readable, maxBytes: number, settle: (body: Buffer | null, why: 'too-large' | 'interrupted') => Promise<void>): Transform {
  let chunks: Buffer[] | null = []
  let size = 0
  let settling: Promise<void> | null = null
  // Later calls get the first call's promise, so the response's end still waits for a release
  // that began mid-stream (a client retrying at once then finds the key free).
  const settleOnce = (body: Buffer | null, why: 'too-large' | 'interrupted'): Promise<void> => {
    settling ??= settle(body, why)
    return settling
  }
  const tee = new Transform({
    transform (chunk: Buffer, _encoding, callback) {
      if (chunks !== null) {
        size += chunk.length
        if (size > maxBytes) {
          chunks = null
          void settleOnce(null, 'too-large')
        } else {
          chunks.push(chunk)
        }
      }
      callback(null, chunk)
    },
    flush (callback) {
      settleOnce(chunks === null ? null : Buffer.concat(chunks, size), 'too-large').then(() => callback(), () => callback())
    }
  })
  tee.once('close', () => { void settleOnce(null, 'interrupted') })
  // pipeline carries a source error into `tee` and a destroyed `tee` (client gone) back to the source.
  pipeline(source, tee, () => {})
  return tee
}
