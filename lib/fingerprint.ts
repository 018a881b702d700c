/**
 * The request fingerprint: SHA-256 over an unambiguous encoding of the parts that
 * `FingerprintOptions` selects.
 *
 * Unambiguous: every part is written as a type letter, its byte length and its bytes, so no two
 * different requests can produce the same byte stream. Versioned: the stream starts with a tag
 * naming the encoding version and the enabled option set, so two routes (or two deployments)
 * fingerprinting differently never produce equal fingerprints for the same request.
 */
import { createHash, hash } from 'node:crypto'
import canonicalizeModule from 'canonicalize'
import type { FastifyRequest } from 'fastify'
import { canonicalValue } from './canonical-value.js'

/** Which parts of a request make up its fingerprint. Plain data, validated at register time. */
export interface FingerprintOptions {
  /**
   * The request body (default `true`). JSON bodies are canonicalized (RFC 8785: key order and
   * white space do not matter); other bodies count by their bytes; a body another parser made
   * (a form, multipart with `attachFieldsToBody`) by a canonical form of its value, file bytes
   * included. An object selects JSON members by JSON Pointer (RFC 6901): `include` fingerprints
   * only those, `exclude` all but those. `'raw'` hashes the request's bytes as they came over the
   * wire, before any parser: for uploads read by the handler (multipart in stream mode) and
   * custom parsers.
   */
  body?: boolean | 'raw' | { include?: string[], exclude?: string[] }
  /** The HTTP method (default `false`). */
  method?: boolean
  /** The request path, without the query string (default `false`). */
  path?: boolean
  /** The query string, as parameters sorted by name (default `false`). */
  query?: boolean
  /** The `Content-Type` header, lower-cased (default `false`). */
  contentType?: boolean
  /** Request headers to include, by name, case-insensitive (default none). */
  headers?: string[]
}

/** FingerprintOptions normalized once, at register or route time. */
export interface FingerprintSettings {
  body: boolean
  /** `body: 'raw'`: the body counts by a hash of its raw bytes (see raw-body.ts). */
  raw: boolean
  include: string[][] | null
  exclude: string[][] | null
  method: boolean
  path: boolean
  query: boolean
  contentType: boolean
  headers: string[]
  /** Version and option set, hashed first. */
  tag: string
  /** `tag` as its encoded part, computed once. */
  tagPart: string
}

// A CommonJS module typed with `export default`: under Node its default import is the function.
const canonicalize = canonicalizeModule as unknown as (input: unknown) => string | undefined

const VERSION = 'fastify-idempotency/fingerprint/v1'

/** RFC 6901: '/a~1b/c~0d' -> ['a/b', 'c~d']. Pointers are checked by the options schema. */
function parsePointer (pointer: string): string[] {
  return pointer.split('/').slice(1).map((token) => token.replaceAll('~1', '/').replaceAll('~0', '~'))
}

export function normalizeFingerprint (options: FingerprintOptions = {}): FingerprintSettings {
  const bodyOption = options.body ?? true
  const include = typeof bodyOption === 'object' && bodyOption.include !== undefined ? [...bodyOption.include].sort() : null
  const exclude = typeof bodyOption === 'object' && bodyOption.exclude !== undefined ? [...bodyOption.exclude].sort() : null
  const headers = [...new Set((options.headers ?? []).map((name) => name.toLowerCase()))].sort()
  const settings = {
    body: bodyOption !== false,
    raw: bodyOption === 'raw',
    include: include?.map(parsePointer) ?? null,
    exclude: exclude?.map(parsePointer) ?? null,
    method: options.method ?? false,
    path: options.path ?? false,
    query: options.query ?? false,
    contentType: options.contentType ?? false,
    headers
  }
  // `raw` only when set, so the tags (and fingerprints) of every other option set stay as they were.
  const tag = JSON.stringify([VERSION, settings.raw ? 'raw' : settings.body, include, exclude, settings.method, settings.path, settings.query, settings.contentType, headers])
  return { ...settings, tag, tagPart: `t${Buffer.byteLength(tag)}:${tag}` }
}

/**
 * Collects the encoded parts. Text-only requests (the usual JSON body) are hashed in one shot
 * over one string, which costs a fraction of feeding a Hash object part by part; a Buffer body
 * switches to the incremental Hash. Both digest the same byte stream.
 */
class Encoder {
  text = ''
  buffers: Array<string | Buffer> | null = null

  raw (data: string): void {
    if (this.buffers === null) this.text += data
    else this.buffers.push(data)
  }

  part (type: string, data: string | Buffer): void {
    if (typeof data === 'string') {
      this.raw(`${type}${Buffer.byteLength(data)}:${data}`)
      return
    }
    this.buffers ??= [this.text]
    this.buffers.push(`${type}${data.length}:`, data)
  }

  digest (): string {
    if (this.buffers === null) return hash('sha256', this.text, 'base64url')
    const incremental = createHash('sha256')
    for (const piece of this.buffers) incremental.update(piece)
    return incremental.digest('base64url')
  }
}

/** The value at a pointer, or `undefined` when the path does not exist. */
function valueAt (document: unknown, tokens: string[]): unknown {
  let node = document
  for (const token of tokens) {
    if (node === null || typeof node !== 'object' || !Object.hasOwn(node, token)) return undefined
    node = (node as Record<string, unknown>)[token]
  }
  return node
}

/** A copy of `document` without the member at `tokens`, copying only the objects on the path. */
function without (document: unknown, tokens: string[]): unknown {
  if (tokens.length === 0) return undefined
  if (document === null || typeof document !== 'object') return document
  const [head, ...rest] = tokens as [string, ...string[]]
  if (!Object.hasOwn(document, head)) return document
  if (Array.isArray(document)) {
    const copy = [...document]
    // An excluded element becomes null rather than disappearing, so its siblings keep their indexes.
    if (rest.length === 0) copy[Number(head)] = null
    else copy[Number(head)] = without(copy[Number(head)], rest)
    return copy
  }
  const copy: Record<string, unknown> = { ...(document as Record<string, unknown>) }
  if (rest.length === 0) delete copy[head]
  else copy[head] = without(copy[head], rest)
  return copy
}

function selectMembers (body: unknown, settings: FingerprintSettings): unknown {
  if (settings.include !== null) {
    // Each selected pointer keeps its own slot, so a member moving between pointers changes the result.
    return settings.include.map((tokens) => {
      const value = valueAt(body, tokens)
      return value === undefined ? [] : [value]
    })
  }
  if (settings.exclude !== null) {
    return settings.exclude.reduce<unknown>((document, tokens) => without(document, tokens), body)
  }
  return body
}

const JSON_TYPE = /^application\/(?:[\w.+-]+\+)?json\b/i

function writeBody (out: Encoder, body: unknown, contentType: string | undefined, settings: FingerprintSettings): void {
  const json = contentType !== undefined && JSON_TYPE.test(contentType)
  if (body === undefined) {
    out.raw('n')
  } else if (Buffer.isBuffer(body) || (typeof body === 'string' && !json)) {
    // Bytes as received: a text or binary body, or whatever a custom parser left as a Buffer.
    out.part('r', body)
  } else if (json) {
    // A parsed JSON value (a JSON string body included, so it differs from the same text as text/plain).
    out.part('j', canonicalize(selectMembers(body, settings)) ?? '')
  } else {
    // Another parser's value: the same text as canonicalize for what JSON can hold (so a form body
    // fingerprints as it always did), and cycles, Buffers and streams handled.
    out.part('j', canonicalValue(selectMembers(body, settings)))
  }
}

function writeQuery (out: Encoder, url: string): void {
  const mark = url.indexOf('?')
  if (mark === -1 || mark === url.length - 1) {
    out.raw('q0:')
    return
  }
  // Parameters sorted by name (a stable sort keeps the order of a repeated name's values, which
  // can carry meaning); names and values compared decoded, so %41 and A are the same.
  const pairs = [...new URLSearchParams(url.slice(mark + 1))].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
  out.raw(`q${pairs.length}:`)
  for (const [name, value] of pairs) {
    out.part('k', name)
    out.part('v', value)
  }
}

function writeHeader (out: Encoder, value: string | string[] | undefined): void {
  if (value === undefined) {
    out.raw('a')
  } else if (typeof value === 'string') {
    out.part('h', value)
  } else {
    out.raw(`l${value.length}:`)
    for (const item of value) out.part('h', item)
  }
}

/** `rawBody`: the hash of the raw body bytes (raw-body.ts), with `body: 'raw'` or for a body no parser read. */
export function computeFingerprint (request: FastifyRequest, settings: FingerprintSettings, rawBody?: string): string {
  const out = new Encoder()
  out.raw(settings.tagPart)
  if (settings.method) out.part('m', request.method)
  if (settings.path) {
    const mark = request.url.indexOf('?')
    out.part('p', mark === -1 ? request.url : request.url.slice(0, mark))
  }
  if (settings.query) writeQuery(out, request.url)
  const contentType = request.headers['content-type']
  if (settings.contentType) writeHeader(out, contentType?.trim().toLowerCase())
  for (const name of settings.headers) writeHeader(out, request.headers[name])
  if (rawBody !== undefined) out.part('R', rawBody)
  else if (settings.body) writeBody(out, request.body, contentType, settings)
  return out.digest()
}
