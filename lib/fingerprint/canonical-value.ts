/**
 * The canonical text of a request body's value: what the fingerprint hashes for a parsed body.
 *
 * For a value JSON can represent, the text is RFC 8785's, exactly what the `canonicalize` package
 * writes. Every other value is written as a token that starts with a NUL character, which
 * canonical JSON never contains (it escapes control characters in strings), so no JSON value can
 * produce it, and no two different values write the same text:
 *
 *   Buffer, Uint8Array            \0b<length>:<SHA-256 of the bytes, base64url>
 *   another typed array, DataView \0b<type>:<length>:<SHA-256>
 *   ArrayBuffer                   \0bArrayBuffer:<length>:<SHA-256>
 *   stream                        \0s            its bytes are not known here (see raw-body.ts)
 *   back-reference                \0r<depth>     to the enclosing object that many levels up
 *   BigInt                        \0n<decimal>
 *   NaN, Infinity, -Infinity      \0f<the number as String() writes it>
 *   Map                           \0M[[key,value],...]   in insertion order
 *   Set                           \0S[value,...]         in insertion order
 *   object with toJSON (Date)     \0o<constructor name>:<its toJSON() value, canonical>
 *
 * Functions, symbols and `undefined` members are left out (written as null in an array), as
 * JSON.stringify leaves them out. An instance of any other class (its data may live in private
 * fields or internal slots no walk can see) is refused with FingerprintValueError, as is a value
 * whose getter or toJSON throws: those come from the server's own parser, hook or schema, never
 * from the client.
 *
 * `legacy` writes what version 1 of the fingerprint (fastify-idempotency 0.1.0) wrote, for
 * comparing a request with an entry that version stored; where version 1 could not tell values
 * apart (a Set and a Map both written `{}`), it throws IncomparableValueError instead.
 */
import { hash } from 'node:crypto'
import { shareIdentity } from '../storage/error-identity.js'

/** Deeper than any real body: objects and arrays nested more than this many levels are refused. */
export const MAX_DEPTH = 1000

/** The client's body is nested more than MAX_DEPTH levels deep. */
export class BodyNestedTooDeeplyError extends Error {
  /** Fastify's error code. */
  readonly code = 'FST_IDEMPOTENCY_BODY_TOO_DEEP'
  constructor () {
    super(`the body is nested more than ${MAX_DEPTH} levels deep`)
    this.name = 'BodyNestedTooDeeplyError'
  }
}
shareIdentity(BodyNestedTooDeeplyError, 'BodyNestedTooDeeplyError')

/**
 * A value of the server's making that has no canonical form, or that threw when read. `path` is
 * where it sits in the body, as a JSON Pointer.
 */
export class FingerprintValueError extends Error {
  readonly reason: string
  #tokens: string[] = []

  constructor (reason: string, options?: ErrorOptions) {
    super(reason, options)
    this.name = 'FingerprintValueError'
    this.reason = reason
  }

  get path (): string {
    return this.#tokens.map((token) => `/${token.replaceAll('~', '~0').replaceAll('/', '~1')}`).join('')
  }

  /** Called on the way out of each level: the member the error came from. */
  within (token: string): this {
    this.#tokens.unshift(token)
    this.message = `${this.reason} at ${this.path}`
    return this
  }
}

/** Version 1 wrote this value as it wrote another: a request cannot be compared with its entry. */
export class IncomparableValueError extends Error {}

/**
 * `json`: the JSON path of version 1 (the `canonicalize` package), `value`: its path for other
 * parsers' values (Buffers, streams and back-references as tokens).
 */
export type Legacy = 'json' | 'value' | null

export function canonicalValue (value: unknown, legacy: Legacy = null): string {
  // Every version writes plain data alike: the shortcut serves them all. A getter that throws
  // ends it, and the writer says where.
  try {
    if (inCanonicalOrder(value, 0)) return JSON.stringify(value)
  } catch {}
  return new Writer(legacy).write(value)
}

/** Deeper than this, a value is left to the writer (which also finds cycles). */
const IN_ORDER_MAX_DEPTH = 32

/**
 * Whether `value` is plain JSON data (strings, finite numbers, booleans, null, arrays, objects of
 * Object's prototype or none, no toJSON, no member left out) whose objects all list their members
 * in canonical order. JSON.stringify then writes the canonical text itself, natively, at a third
 * of the writer's cost: a body whose client wrote its members sorted, or objects of one member.
 * The look stops at the first member out of order, and the writer takes over.
 */
function inCanonicalOrder (value: unknown, depth: number): boolean {
  switch (typeof value) {
    case 'string':
    case 'boolean':
      return true
    case 'number':
      return Number.isFinite(value)
    case 'object':
      break
    default:
      return false
  }
  if (value === null) return true
  if (depth === IN_ORDER_MAX_DEPTH) return false
  const prototype = Object.getPrototypeOf(value)
  if (Array.isArray(value)) {
    if (prototype !== Array.prototype) return false
    // A hole reads as undefined, which is left to the writer too.
    for (let index = 0; index < value.length; index++) if (!inCanonicalOrder(value[index], depth + 1)) return false
    return true
  }
  if (prototype !== Object.prototype && prototype !== null) return false
  // `for in` lists own members first, in the order JSON.stringify writes them; an inherited
  // enumerable member (a polluted prototype) can only end the look early.
  let previous: string | null = null
  for (const name in value) {
    if (previous !== null && !(previous < name)) return false
    if (!inCanonicalOrder((value as Record<string, unknown>)[name], depth + 1)) return false
    previous = name
  }
  return true
}

/** A Node stream or a web ReadableStream. */
export function isStream (value: object): boolean {
  return typeof (value as { pipe?: unknown }).pipe === 'function' || typeof (value as { getReader?: unknown }).getReader === 'function'
}

/**
 * An object whose data is its own members: no prototype, Object's, or a chain of prototypes with
 * nothing of their own but a `constructor` (fast-querystring's result, what @fastify/formbody
 * makes; a class of fields only). A prototype with methods or getters belongs to a class whose
 * data may live where no walk of its members sees it.
 */
export function isPlainObject (value: object): boolean {
  for (let prototype = Object.getPrototypeOf(value); prototype !== null && prototype !== Object.prototype; prototype = Object.getPrototypeOf(prototype)) {
    if (Reflect.ownKeys(prototype).some((name) => name !== 'constructor')) return false
  }
  return true
}

function className (value: object): string {
  const name: unknown = (value.constructor as { name?: unknown } | undefined)?.name
  return typeof name === 'string' && name !== '' ? name : 'an object without a class name'
}

class Writer {
  readonly #legacy: Legacy
  /** The objects enclosing the one being written, outermost first. */
  readonly #path: object[] = []

  constructor (legacy: Legacy) {
    this.#legacy = legacy
  }

  write (value: unknown): string {
    const text = this.#member(value)
    if (text !== undefined) return text
    if (this.#legacy !== null) throw new IncomparableValueError(typeof value)
    throw new FingerprintValueError(`the body is a ${typeof value}, which has no canonical form`)
  }

  /** The text of `value`, or `undefined` where JSON leaves a member out. */
  #member (value: unknown): string | undefined {
    switch (typeof value) {
      case 'string': return quoted(value)
      case 'boolean': return value ? 'true' : 'false'
      case 'number': return Number.isFinite(value) ? JSON.stringify(value) : this.#token(`f${String(value)}`)
      case 'bigint': return this.#token(`n${value.toString()}`)
      case 'object': return value === null ? 'null' : this.#object(value)
      default: return undefined
    }
  }

  /** A token version 2 writes and version 1 did not: that version wrote the value as it wrote another. */
  #token (text: string): string {
    if (this.#legacy !== null) throw new IncomparableValueError(text)
    return `\u0000${text}`
  }

  #object (value: object): string {
    const path = this.#path
    const back = path.lastIndexOf(value)
    if (back !== -1) {
      if (this.#legacy === 'json') throw new IncomparableValueError('a cycle')
      return `\u0000r${path.length - back}`
    }
    if (ArrayBuffer.isView(value) || value instanceof ArrayBuffer) return this.#bytes(value)
    if (isStream(value)) {
      if (this.#legacy === 'json') throw new IncomparableValueError('a stream')
      return '\u0000s'
    }
    if (typeof (value as { toJSON?: unknown }).toJSON === 'function') return this.#toJSON(value as { toJSON: () => unknown })
    if (path.length >= MAX_DEPTH) throw new BodyNestedTooDeeplyError()
    path.push(value)
    let text
    if (Array.isArray(value)) text = this.#array(value)
    else if (isPlainObject(value)) text = this.#members(value as Record<string, unknown>)
    else if (value instanceof Map) text = this.#token('M') + this.#array([...value])
    else if (value instanceof Set) text = this.#token('S') + this.#array([...value])
    else throw new FingerprintValueError(`the body holds an instance of ${className(value)}, which has no canonical form (give its class a toJSON method, or make the parser produce plain data)`)
    path.pop()
    return text
  }

  #bytes (value: ArrayBufferView | ArrayBuffer): string {
    if (this.#legacy === 'json') throw new IncomparableValueError('bytes')
    const buffer = value instanceof ArrayBuffer
    // Version 1 wrote every view alike, and an ArrayBuffer as `{}`.
    if (buffer && this.#legacy !== null) throw new IncomparableValueError('an ArrayBuffer')
    const bytes = buffer ? Buffer.from(value) : Buffer.from(value.buffer, value.byteOffset, value.byteLength)
    const type = value instanceof Uint8Array || this.#legacy !== null ? '' : `${buffer ? 'ArrayBuffer' : className(value)}:`
    return `\u0000b${type}${bytes.length}:${hash('sha256', bytes, 'base64url')}`
  }

  #toJSON (value: { toJSON: () => unknown }): string {
    let json
    try {
      json = value.toJSON()
    } catch (error) {
      throw new FingerprintValueError(`toJSON of an instance of ${className(value)} threw`, { cause: error })
    }
    const text = this.#member(json)
    // Version 1 wrote only what toJSON returned, so a Date and its ISO string were alike.
    if (this.#legacy === null) return `\u0000o${className(value)}:${text ?? 'null'}`
    if (text === undefined) throw new IncomparableValueError('toJSON returned nothing')
    return text
  }

  #array (items: unknown[]): string {
    let text = '['
    let index = 0
    try {
      for (; index < items.length; index++) {
        const item = items[index]
        if (index > 0) text += ','
        // JSON writes a member it cannot represent in an array as null.
        text += this.#member(item) ?? this.#arrayHole(item)
      }
    } catch (error) {
      throw located(error, String(index))
    }
    return text + ']'
  }

  /** Version 1's JSON path wrote a function in an array as the text "undefined". */
  #arrayHole (item: unknown): string {
    if (this.#legacy === 'json' && typeof item === 'function') throw new IncomparableValueError('a function')
    return 'null'
  }

  #members (value: Record<string, unknown>): string {
    let text = '{'
    let name = ''
    try {
      // RFC 8785 orders members by their UTF-16 code units, which is what a plain sort compares.
      for (name of Object.keys(value).sort()) {
        const member = value[name]
        const written = this.#member(member)
        if (written === undefined) {
          if (this.#legacy === 'json' && typeof member === 'function') throw new IncomparableValueError('a function')
          continue
        }
        text += `${text.length === 1 ? '' : ','}${quoted(name)}:${written}`
      }
    } catch (error) {
      throw located(error, name)
    }
    return text + '}'
  }
}

/** Shorter strings are quoted here when nothing in them needs escaping. */
const QUOTED_HERE_MAX_LENGTH = 32

/**
 * A string as JSON writes it. A short one with nothing to escape (no quote, backslash, control
 * character or surrogate) is put in quotes here, which costs half of a call into JSON.stringify.
 */
function quoted (text: string): string {
  if (text.length > QUOTED_HERE_MAX_LENGTH) return JSON.stringify(text)
  for (let index = 0; index < text.length; index++) {
    const code = text.charCodeAt(index)
    if (code < 0x20 || code === 0x22 || code === 0x5c || (code >= 0xd800 && code <= 0xdfff)) return JSON.stringify(text)
  }
  return `"${text}"`
}

/** An error from inside member `token`: ours get the member added to their path; a getter's is wrapped. */
function located (error: unknown, token: string): Error {
  if (error instanceof FingerprintValueError) return error.within(token)
  if (error instanceof BodyNestedTooDeeplyError || error instanceof IncomparableValueError) return error
  return new FingerprintValueError('reading a member threw', { cause: error }).within(token)
}
