/**
 * A canonical text for a request body that some parser other than JSON's made: a form parser, a
 * custom parser, @fastify/multipart with `attachFieldsToBody`. Such a body may hold what JSON
 * cannot: Buffers (an uploaded file's bytes), streams, functions, and cycles (multipart's file
 * entries point back at the body through `fields`).
 *
 * For a value JSON can represent, the text is RFC 8785's, exactly what `canonicalize` writes, so a
 * plain form body fingerprints as it always did. Everything else is written as a token that starts
 * with a NUL character, which canonical JSON never contains (it escapes control characters in
 * strings), so no JSON value can produce it:
 *
 *   Buffer or typed array   \0b<length>:<SHA-256 of the bytes, base64url>
 *   stream                  \0s            its bytes are not known here (see `body: 'raw'`)
 *   back-reference          \0r<depth>     to the enclosing object that many levels up
 *   Date                    as JSON.stringify writes it
 *
 * Functions, symbols and `undefined` members are left out, as JSON.stringify leaves them out.
 */
import { hash } from 'node:crypto'
import canonicalizeModule from 'canonicalize'

// A CommonJS module typed with `export default`: under Node its default import is the function.
const canonicalize = canonicalizeModule as unknown as (input: unknown) => string | undefined

/** Deeper than any real body: a limit that turns a stack overflow into a clear error. */
export const MAX_DEPTH = 1000

export class BodyNestedTooDeeplyError extends Error {
  constructor () {
    super(`the body is nested more than ${MAX_DEPTH} levels deep`)
    this.name = 'BodyNestedTooDeeplyError'
  }
}

export function canonicalValue (value: unknown): string {
  const out: string[] = []
  write(value, [], out)
  return out.join('')
}

function isStream (value: object): boolean {
  return typeof (value as { pipe?: unknown }).pipe === 'function' || typeof (value as { getReader?: unknown }).getReader === 'function'
}

function write (value: unknown, path: object[], out: string[]): boolean {
  if (value === null || typeof value !== 'object') {
    // Primitives as canonicalize writes them; functions, symbols and undefined are not written.
    const text = typeof value === 'function' || typeof value === 'symbol' ? undefined : canonicalize(value)
    if (text === undefined) return false
    out.push(text)
    return true
  }
  const back = path.lastIndexOf(value)
  if (back !== -1) {
    out.push(`\u0000r${path.length - back}`)
    return true
  }
  if (ArrayBuffer.isView(value)) {
    const bytes = Buffer.from(value.buffer, value.byteOffset, value.byteLength)
    out.push(`\u0000b${bytes.length}:${hash('sha256', bytes, 'base64url')}`)
    return true
  }
  if (isStream(value)) {
    out.push('\u0000s')
    return true
  }
  if (typeof (value as { toJSON?: unknown }).toJSON === 'function') return write((value as { toJSON: () => unknown }).toJSON(), path, out)
  if (path.length >= MAX_DEPTH) throw new BodyNestedTooDeeplyError()
  path.push(value)
  if (Array.isArray(value)) {
    out.push('[')
    value.forEach((item, index) => {
      if (index > 0) out.push(',')
      // JSON writes a member it cannot represent in an array as null.
      if (!write(item, path, out)) out.push('null')
    })
    out.push(']')
  } else {
    out.push('{')
    let first = true
    // RFC 8785 orders members by their UTF-16 code units, which is what a plain sort compares.
    for (const name of Object.keys(value).sort()) {
      const mark = out.length
      out.push(first ? '' : ',', JSON.stringify(name), ':')
      if (write((value as Record<string, unknown>)[name], path, out)) first = false
      else out.length = mark
    }
    out.push('}')
  }
  path.pop()
  return true
}
