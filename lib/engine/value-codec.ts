/**
 * How a value a function returned is kept in the store, and read back: the result of a function
 * run with `run` and the result of a recovery point (a step). A record is a StoredResponse whose
 * content type names its encoding, so that a reader knows it without guessing, and an encoding
 * written by any earlier version is still read:
 *
 *   none      `undefined`
 *   bytes     a Buffer, byte for byte
 *   json      plain data that JSON keeps exactly (objects, arrays, strings, finite numbers,
 *             booleans, null), and objects that say how they are written (`toJSON`)
 *   devalue   anything else devalue keeps (BigInt, Date, Map, Set, RegExp, URL, typed arrays,
 *             nested Buffers, undefined, NaN, Infinity, -0, and repeated or circular references
 *             between plain objects), written with the devalue library
 *   custom    the bytes of the caller's own `serialize`, read with its `deserialize`
 *
 * A value none of them can keep (an instance of a class without `toJSON`, a function, a symbol)
 * cannot be recorded; neither can one over the size limit. The caller then records that the
 * function ran with its result lost (`lostRecord`), so that it never runs again for that key.
 */
import { parse as parseDevalue, stringify as stringifyDevalue } from 'devalue'
import type { StoredResponse } from '../storage/types.js'

/** How a result is kept: the content type of its record says which encoding. */
export const RESULT_ENCODING = {
  json: 'application/vnd.fastify-idempotency.step+json',
  bytes: 'application/vnd.fastify-idempotency.step+octet-stream',
  none: 'application/vnd.fastify-idempotency.step+undefined',
  devalue: 'application/vnd.fastify-idempotency.value+devalue',
  custom: 'application/vnd.fastify-idempotency.value+custom',
  /** The function ran, and its result could not be kept: the body says why. */
  lost: 'application/vnd.fastify-idempotency.value+lost'
} as const

/** A caller's own way to keep its results: what `serialize` writes, `deserialize` reads back. */
export interface ValueCodec<T = unknown> {
  /** Turns a result into the bytes to store. */
  serialize: (value: T) => string | Buffer | Uint8Array
  /** Reads a stored result back from its bytes. */
  deserialize: (data: Buffer) => T
}

/** A value that cannot be kept: `reason` says why, for the error and the lost record. */
export class ValueNotRecordableError extends Error {
  constructor (reason: string, options?: ErrorOptions) {
    super(reason, options)
    this.name = 'ValueNotRecordableError'
  }
}

// Buffers inside a value come back as Buffers (devalue alone would make them Uint8Arrays).
const reducers = { Buffer: (value: unknown) => Buffer.isBuffer(value) && value.toString('base64') }
const revivers = { Buffer: (text: string) => Buffer.from(text, 'base64') }

/** Raised by `exactly` at the first value JSON would change. */
const LOSSY = new Error('lossy')

/**
 * JSON.stringify's replacer that refuses every value JSON would not give back as it was. `this`
 * is the holder, so `this[key]` is the value before `toJSON`.
 */
function exactly (this: unknown, key: string, value: unknown): unknown {
  const original = (this as Record<string, unknown>)[key]
  switch (typeof original) {
    case 'string':
    case 'boolean':
      return value
    case 'number':
      if (!Number.isFinite(original) || Object.is(original, -0)) throw LOSSY
      return value
    case 'object': {
      if (original === null || Array.isArray(original)) return value
      const prototype = Object.getPrototypeOf(original) as unknown
      if (prototype === Object.prototype || prototype === null) return value
      // An object that says how it is written (a Decimal, a model): its toJSON is its record. A
      // Date, a URL and a Buffer have one too, but would be read back as something else: devalue
      // keeps them what they are.
      if (typeof (original as { toJSON?: unknown }).toJSON === 'function' && !(original instanceof Date) && !(original instanceof URL) && !Buffer.isBuffer(original)) return value
      throw LOSSY
    }
    default:
      // undefined, a BigInt, a function, a symbol: dropped, nulled or refused by JSON.
      throw LOSSY
  }
}

/**
 * The record of `value`, at most `limit` bytes; ValueNotRecordableError when it cannot be kept.
 * `what` names the value in messages ("step 'charge' returned", "the function returned").
 */
export function encodeValue (value: unknown, what: string, limit: number, codec?: ValueCodec): StoredResponse {
  let record: StoredResponse
  if (codec !== undefined) {
    let data
    try {
      data = codec.serialize(value)
    } catch (error) {
      throw new ValueNotRecordableError(`${what} a value its serialize could not write: ${String((error as Error)?.message ?? error)}`, { cause: error })
    }
    if (typeof data !== 'string' && !(data instanceof Uint8Array)) throw new ValueNotRecordableError(`${what} a value whose serialize returned neither a string nor bytes`)
    record = { statusCode: 200, contentType: RESULT_ENCODING.custom, headers: {}, body: typeof data === 'string' ? Buffer.from(data) : Buffer.from(data.buffer, data.byteOffset, data.byteLength) }
  } else if (value === undefined) {
    record = { statusCode: 200, contentType: RESULT_ENCODING.none, headers: {}, body: Buffer.alloc(0) }
  } else if (Buffer.isBuffer(value)) {
    record = { statusCode: 200, contentType: RESULT_ENCODING.bytes, headers: {}, body: value }
  } else {
    record = { statusCode: 200, ...structured(value, what), headers: {} }
  }
  if (record.body.length > limit) {
    throw new ValueNotRecordableError(`${what} ${record.body.length} bytes; a result is kept up to maxResponseBytes (${limit})`)
  }
  return record
}

/** JSON when JSON keeps the value exactly, devalue otherwise. */
function structured (value: unknown, what: string): { contentType: string, body: Buffer } {
  try {
    // The replacer sees the top-level value under the key '' of a holder of its own.
    return { contentType: RESULT_ENCODING.json, body: Buffer.from(JSON.stringify(value, exactly)) }
  } catch (error) {
    // Not plain JSON (a BigInt, a Date, a Map, a circular reference...): devalue may keep it.
    if (error !== LOSSY && !(error instanceof TypeError)) throw error
  }
  try {
    return { contentType: RESULT_ENCODING.devalue, body: Buffer.from(stringifyDevalue(value, reducers)) }
  } catch (error) {
    throw new ValueNotRecordableError(`${what} a value that cannot be kept (${String((error as Error)?.message ?? error)}): return plain data, or give a serialize and deserialize`, { cause: error })
  }
}

/**
 * The value a record holds. A lost record throws ValueLostError; a record of an unknown encoding
 * (a later version's) throws an Error.
 */
const RESULT_CONTENT_TYPES: ReadonlySet<string | null> = new Set(Object.values(RESULT_ENCODING))

/** Whether `record` is a kept value (a result or a recovery point's), not a request's answer. */
export function isResultRecord (record: StoredResponse): boolean {
  return RESULT_CONTENT_TYPES.has(record.contentType)
}

export function decodeValue (record: StoredResponse, codec?: ValueCodec): unknown {
  switch (record.contentType) {
    case RESULT_ENCODING.none: return undefined
    case RESULT_ENCODING.bytes: return Buffer.from(record.body)
    case RESULT_ENCODING.json: return JSON.parse(record.body.toString())
    case RESULT_ENCODING.devalue: return parseDevalue(record.body.toString(), revivers)
    case RESULT_ENCODING.custom:
      if (codec === undefined) throw new Error('fastify-idempotency: a result kept by a serialize of its own, read without its deserialize')
      return codec.deserialize(Buffer.from(record.body))
    case RESULT_ENCODING.lost: throw new ValueLostError(record.body.toString())
    default: throw new Error(`fastify-idempotency: a result record of an unknown kind (${String(record.contentType)})`)
  }
}

/**
 * The record of `value`; when it cannot be kept, a record that the function ran with its result
 * lost (it has done its work either way, and must never run again for its key), after telling
 * `lost` why.
 */
export function recordOrLost (value: unknown, what: string, limit: number, codec: ValueCodec | undefined, lost: (error: ValueNotRecordableError) => void): StoredResponse {
  try {
    return encodeValue(value, what, limit, codec)
  } catch (error) {
    if (!(error instanceof ValueNotRecordableError)) throw error
    lost(error)
    return lostRecord(error.message)
  }
}

/** A record saying the function ran and its result could not be kept, and why. */
export function lostRecord (reason: string): StoredResponse {
  return { statusCode: 200, contentType: RESULT_ENCODING.lost, headers: {}, body: Buffer.from(reason) }
}

/** Read from a lost record: the function ran once already, and its result was not kept. */
export class ValueLostError extends Error {
  readonly reason: string
  constructor (reason: string) {
    super(`its result could not be kept when it ran: ${reason}`)
    this.name = 'ValueLostError'
    this.reason = reason
  }
}
