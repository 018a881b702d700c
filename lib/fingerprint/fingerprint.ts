/**
 * The request fingerprint: SHA-256 over an unambiguous encoding of the parts that
 * `FingerprintOptions` selects.
 *
 * Unambiguous: every part is written as a type letter, its byte length and its bytes, so no two
 * different requests can produce the same byte stream under one option set. What the store keeps
 * is a record of the digest with its version, route and option set (record.ts), and a stored
 * digest is only ever compared with one computed under the record's own version and options.
 *
 * Version 3 (this one) hashes the parts alone. Versions 1 and 2 began the stream with a tag naming
 * the version and the option set: about 90 bytes, more than a small body, hashed on every request
 * to say what the record now says beside the digest. Version 2 (0.2.0's pre-releases) fingerprints
 * the body as version 3 does: as it arrived (request-fingerprint.ts), every value JSON cannot hold
 * as a token of its own (canonical-value.ts), a member selection saying what it selected from
 * what. Versions 1 (0.1.0) and 2 are still computed, to compare a request with the entries they
 * stored.
 */
import { createHash, hash } from 'node:crypto'
import type { FastifyRequest } from 'fastify'
import { canonicalValue, IncomparableValueError, isPlainObject } from './canonical-value.js'
import { canonicalMediaType } from './media-type.js'

/** Which parts of a request make up its fingerprint. Plain data, validated at register time. */
export interface FingerprintOptions {
  /**
   * The request body (default `true`), as it arrived: before schema validation coerces, fills
   * in or transforms it. JSON bodies are canonicalized (RFC 8785: key order and white space do
   * not matter); other bodies count by their bytes; a body another parser made (a form, multipart
   * with `attachFieldsToBody`) by a canonical form of its value, file bytes included; a stream
   * (a proxy's) by its bytes. An object selects JSON members by JSON Pointer (RFC 6901):
   * `include` fingerprints only those, `exclude` all but those. `'raw'` hashes the request's bytes
   * as they came over the wire, before any parser: for uploads read by the handler (multipart in
   * stream mode) and custom parsers.
   */
  body?: boolean | 'raw' | {
    /** JSON Pointers of the members that count; the rest is left out. */
    include?: string[]
    /** JSON Pointers of the members left out; the rest counts. */
    exclude?: string[]
  }
  /** The HTTP method (default `false`). */
  method?: boolean
  /** The request path, without the query string (default `false`). */
  path?: boolean
  /** The query string, as parameters sorted by name (default `false`). */
  query?: boolean
  /**
   * The `Content-Type` header (default `false`): its media type and parameters, case and spacing
   * aside, a multipart body's `boundary` left out (see docs/fingerprinting.md).
   */
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
  /** The body is the only part (no method, path, query, content type or header). */
  bodyOnly: boolean
  /** The option set as the record carries it: JSON of the options that differ from the defaults. */
  options: string
  /** The first encoded part of versions 1 and 2: the version and the option set (version 3 has none). */
  tagParts: readonly [version1: string, version2: string]
}

/** The encoding versions: 1 (0.1.0), 2 (0.2.0's pre-releases), 3 (this one, which new fingerprints use). */
export type FingerprintVersion = 1 | 2 | 3

/** The encoding version a new fingerprint is written in. */
export const FINGERPRINT_VERSION = 3

const TAG = ['fastify-idempotency/fingerprint/v1', 'fastify-idempotency/fingerprint/v2']

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
  // Only what differs from the defaults, in a fixed order: one option set, one text.
  const described: FingerprintOptions = {}
  if (bodyOption !== true) described.body = include !== null ? { include } : exclude !== null ? { exclude } : bodyOption
  for (const name of ['method', 'path', 'query', 'contentType'] as const) if (settings[name]) described[name] = true
  if (headers.length > 0) described.headers = headers
  return {
    ...settings,
    bodyOnly: settings.body && !settings.method && !settings.path && !settings.query && !settings.contentType && headers.length === 0,
    options: JSON.stringify(described),
    tagParts: [tagPart(settings, include, exclude, 1), tagPart(settings, include, exclude, 2)]
  }
}

function tagPart (settings: Omit<FingerprintSettings, 'bodyOnly' | 'options' | 'tagParts'>, include: string[] | null, exclude: string[] | null, version: 1 | 2): string {
  // `raw` only when set, so the tags of version 1's other option sets stay as they were.
  const tag = JSON.stringify([TAG[version - 1], settings.raw ? 'raw' : settings.body, include, exclude, settings.method, settings.path, settings.query, settings.contentType, settings.headers])
  return `t${Buffer.byteLength(tag)}:${tag}`
}

/** A part of text as the stream holds it: its type letter, its byte length, and its bytes. */
function textPart (type: string, data: string): string {
  return `${type}${Buffer.byteLength(data)}:${data}`
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
      this.raw(textPart(type, data))
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

/**
 * The body's part of the stream: its type letter and data. `n` no body; `r` its bytes; `R` the
 * hash of its raw bytes; `j` the canonical text of its value; `s` (version 2) of the members it
 * selects.
 */
export type BodyPart = readonly [type: 'n' | 'r' | 'R' | 'j' | 's', data: string | Buffer]

const NO_BODY: BodyPart = ['n', '']

/** The body as it arrived, before validation: its part under the route's options (`null` when it counts otherwise), and the value. */
export interface ArrivedBody {
  readonly part: BodyPart | null
  readonly value: unknown
}

const JSON_TYPE = /^application\/(?:[\w.+-]+\+)?json\b/i

/** The part `body` (a value some parser made, or the raw bytes' hash) makes under `settings`. */
export function bodyPart (body: unknown, contentType: string | undefined, settings: FingerprintSettings, legacy = false): BodyPart {
  // The usual header is compared first: the pattern costs more than the comparison.
  const json = contentType === 'application/json' || (contentType !== undefined && JSON_TYPE.test(contentType))
  if (body === undefined) return NO_BODY
  // Bytes as received: a text or binary body, or whatever a custom parser left as a Buffer. A
  // JSON string body counts by its value, so it differs from the same text as text/plain.
  if (Buffer.isBuffer(body) || (typeof body === 'string' && !json)) return ['r', body]
  const mode = legacy ? (json ? 'json' : 'value') : null
  if (settings.include !== null) {
    const selection = legacy ? legacySelection(body, settings.include) : selectMembers(body, settings.include)
    if (selection !== null) return [legacy ? 'j' : 's', canonicalValue(selection, mode)]
  }
  const document = settings.exclude === null ? body : settings.exclude.reduce<unknown>((value, tokens) => without(value, tokens, legacy), body)
  return ['j', canonicalValue(document, mode)]
}

/** The hash of the raw body as a body part. */
export function rawBodyPart (digest: string): BodyPart {
  return ['R', digest]
}

function isContainer (value: unknown): value is Record<string, unknown> | unknown[] {
  return value !== null && typeof value === 'object' && (Array.isArray(value) || isPlainObject(value))
}

const INDEX = /^(?:0|[1-9]\d*)$/

/**
 * Each pointer's slot: `[kinds, value]` when the member is there, where `kinds` names each
 * container on the way (`o` object, `a` array), so `{"0":5}` and `[5]` differ; `[]` when it is
 * not. `null` when no pointer selects anything: the body then counts whole, so bodies of another
 * shape (`[1]`, `"a"`) never all look alike.
 */
function selectMembers (body: unknown, pointers: string[][]): unknown[] | null {
  let found = false
  const slots = pointers.map((tokens) => {
    let node = body
    let kinds = ''
    for (const token of tokens) {
      if (!isContainer(node)) return []
      const array = Array.isArray(node)
      if (array ? !INDEX.test(token) || Number(token) >= (node as unknown[]).length : !Object.hasOwn(node, token)) return []
      kinds += array ? 'a' : 'o'
      node = (node as Record<string, unknown>)[token]
    }
    found = true
    return [kinds, node]
  })
  return found ? slots : null
}

/**
 * Version 1's selection: `[value]` or `[]` per pointer. It said nothing about the body's shape,
 * so a request whose selection is empty, or whose body is not an object, cannot be compared.
 */
function legacySelection (body: unknown, pointers: string[][]): unknown[] {
  if (!isContainer(body) || Array.isArray(body)) throw new IncomparableValueError('a selection from a body that is not an object')
  const slots = pointers.map((tokens) => {
    let node: unknown = body
    for (const token of tokens) {
      if (node === null || typeof node !== 'object' || !Object.hasOwn(node, token)) return []
      node = (node as Record<string, unknown>)[token]
    }
    return [node]
  })
  if (slots.every((slot) => slot.length === 0)) throw new IncomparableValueError('an empty selection')
  return slots
}

/** A copy of `document` without the member at `tokens` (at least one), copying only the objects on the path. */
function without (document: unknown, tokens: string[], legacy: boolean): unknown {
  if (document === null || typeof document !== 'object') return document
  // A pointer addresses members of objects and arrays: a Map or a class instance is left whole.
  if (!isContainer(document)) {
    if (legacy) throw new IncomparableValueError('a selection inside an object that is not plain')
    return document
  }
  const [head, ...rest] = tokens as [string, ...string[]]
  if (!Object.hasOwn(document, head)) return document
  if (Array.isArray(document)) {
    const copy = [...document]
    // An excluded element becomes null rather than disappearing, so its siblings keep their indexes.
    if (rest.length === 0) copy[Number(head)] = null
    else copy[Number(head)] = without(copy[Number(head)], rest, legacy)
    return copy
  }
  const copy: Record<string, unknown> = { ...document }
  if (rest.length === 0) delete copy[head]
  else copy[head] = without(copy[head], rest, legacy)
  return copy
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

/** The request's Content-Type in its canonical form (media-type.ts); versions 1 and 2 count it trimmed and lower-cased. */
function mediaType (request: FastifyRequest): string | undefined {
  const header = request.headers['content-type']
  return header === undefined ? undefined : canonicalMediaType(header)
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

/**
 * The digest of a request under `settings`: `body` is the body's part (`null` when the options
 * leave the body out), computed as `version` did.
 */
export function fingerprintDigest (request: FastifyRequest, settings: FingerprintSettings, body: BodyPart | null, version: FingerprintVersion = FINGERPRINT_VERSION): string {
  // The default option set, a body of text: its one part hashed as it stands (what Encoder writes).
  if (settings.bodyOnly && version === 3 && body !== null && body !== NO_BODY && typeof body[1] === 'string') {
    return hash('sha256', textPart(body[0], body[1]), 'base64url')
  }
  const out = new Encoder()
  if (version !== 3) out.raw(settings.tagParts[version - 1]!)
  if (settings.method) out.part('m', request.method)
  if (settings.path) {
    const mark = request.url.indexOf('?')
    out.part('p', mark === -1 ? request.url : request.url.slice(0, mark))
  }
  if (settings.query) writeQuery(out, request.url)
  if (settings.contentType) writeHeader(out, version === 3 ? mediaType(request) : request.headers['content-type']?.trim().toLowerCase())
  // The Content-Type named among the headers counts as `contentType` does, its boundary left out.
  for (const name of settings.headers) writeHeader(out, name === 'content-type' && version === 3 ? mediaType(request) : request.headers[name])
  if (body === NO_BODY) out.raw('n')
  else if (body !== null) out.part(body[0], body[1])
  return out.digest()
}
