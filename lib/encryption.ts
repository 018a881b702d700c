/**
 * Encryption at rest: what a store holds about a request says nothing to whoever reads the store.
 *
 * - The stored response is sealed with AES-256-GCM (`node:crypto`). The first key seals; every
 *   configured key opens, so keys rotate without a flag day. The entry's storage key and status
 *   are bound in as associated data: a sealed entry moved to another key, or given another status,
 *   no longer opens.
 * - The key and scope reach the store as a keyed hash (HMAC-SHA256 with `keyHashSecret`), so the
 *   store never sees a client's key or who asked, and every storage key has one length.
 *
 * A sealed entry is an ordinary StoredResponse to the store: the status in clear, a marker content
 * type, no headers, and the envelope as its body:
 *
 *   version (1) | key id (8) | IV (12) | GCM tag (16) | ciphertext of [meta length (4) | meta JSON | body]
 *
 * where meta holds the content type, the headers, and whether the body was omitted.
 */
import { createCipheriv, createDecipheriv, createHmac, randomBytes } from 'node:crypto'
import type { StoredResponse } from './storage/types.js'
import { UnreadableEntryError } from './storage/unreadable-entry.js'

export interface EncryptionOptions {
  /**
   * 32-byte AES-256 keys, as Buffers or base64 strings. The first seals new entries; each of them
   * opens entries sealed with it. To rotate, put a new key first and drop the old one once the
   * entries it sealed have expired (`expiration`).
   */
  keys: Array<Buffer | string>
  /**
   * The secret of the keyed hash that replaces key and scope in the store, 32 bytes or more (a
   * Buffer or a base64 string). Keep it for as long as entries live: another secret finds none
   * of the entries stored before, nor the leases held, so it is not rotated with the keys.
   */
  keyHashSecret: Buffer | string
}

/** The content type that marks a sealed entry in the store. */
export const SEALED_CONTENT_TYPE = 'application/vnd.fastify-idempotency.sealed'
/** Marks a storage key that is a keyed hash (see engine/storage-key.ts for the other forms). */
export const KEYED_HASH_PREFIX = '\u0000hmac:'

const VERSION = 1
const KEY_ID_BYTES = 8
const IV_BYTES = 12
const TAG_BYTES = 16
const HEADER_BYTES = 1 + KEY_ID_BYTES + IV_BYTES + TAG_BYTES
const KEY_BYTES = 32

interface Meta {
  /** Content type. */
  c: string | null
  /** Headers. */
  h: Record<string, string | string[]>
  /** Body omitted. */
  o?: true
}

function secretBytes (value: unknown, name: string, exact: boolean): Buffer {
  const bytes = Buffer.isBuffer(value) ? value : typeof value === 'string' ? Buffer.from(value, 'base64') : null
  if (bytes === null) throw new TypeError(`fastify-idempotency: invalid options: encryption.${name} must be a Buffer or a base64 string`)
  if (exact ? bytes.length !== KEY_BYTES : bytes.length < KEY_BYTES) {
    throw new TypeError(`fastify-idempotency: invalid options: encryption.${name} must be ${exact ? '' : 'at least '}${KEY_BYTES} bytes (got ${bytes.length})`)
  }
  return Buffer.from(bytes)
}

export class ResponseCipher {
  /** Key id -> key; the first entry seals. */
  readonly #keys: Map<string, Buffer>
  readonly #sealingId: Buffer
  readonly #sealingKey: Buffer
  readonly #hashSecret: Buffer

  constructor (options: EncryptionOptions) {
    if (options === null || typeof options !== 'object') throw new TypeError('fastify-idempotency: invalid options: encryption must be an object { keys, keyHashSecret }')
    if (!Array.isArray(options.keys) || options.keys.length === 0) throw new TypeError('fastify-idempotency: invalid options: encryption.keys must be a non-empty array of 32-byte keys')
    this.#keys = new Map()
    for (const [index, key] of options.keys.entries()) {
      const bytes = secretBytes(key, `keys[${index}]`, true)
      this.#keys.set(keyId(bytes).toString('hex'), bytes)
    }
    this.#sealingKey = secretBytes(options.keys[0], 'keys[0]', true)
    this.#sealingId = keyId(this.#sealingKey)
    this.#hashSecret = secretBytes(options.keyHashSecret, 'keyHashSecret', false)
  }

  /** The storage key for a key and scope, composed as engine/storage-key.ts composes them. */
  hashKey (composed: string): string {
    // UTF-16 code units, so that scopes with lone surrogates hash apart.
    return KEYED_HASH_PREFIX + createHmac('sha256', this.#hashSecret).update(Buffer.from(composed, 'utf16le')).digest('base64url')
  }

  seal (storageKey: string, response: StoredResponse): StoredResponse {
    const meta: Meta = { c: response.contentType, h: response.headers }
    if (response.bodyOmitted === true) meta.o = true
    const metaBytes = Buffer.from(JSON.stringify(meta))
    const length = Buffer.alloc(4)
    length.writeUInt32BE(metaBytes.length)
    const iv = randomBytes(IV_BYTES)
    const cipher = createCipheriv('aes-256-gcm', this.#sealingKey, iv)
    cipher.setAAD(associatedData(storageKey, response.statusCode))
    const parts = [cipher.update(length), cipher.update(metaBytes), response.bodyOmitted === true ? Buffer.alloc(0) : cipher.update(response.body), cipher.final()]
    const header = Buffer.alloc(HEADER_BYTES)
    header.writeUInt8(VERSION, 0)
    this.#sealingId.copy(header, 1)
    iv.copy(header, 1 + KEY_ID_BYTES)
    cipher.getAuthTag().copy(header, 1 + KEY_ID_BYTES + IV_BYTES)
    return { statusCode: response.statusCode, contentType: SEALED_CONTENT_TYPE, headers: {}, body: Buffer.concat([header, ...parts]) }
  }

  /** The response a sealed entry holds; throws UnreadableEntryError when it cannot be opened. */
  open (storageKey: string, entry: StoredResponse): StoredResponse {
    if (entry.contentType !== SEALED_CONTENT_TYPE) throw new UnreadableEntryError('the entry is not sealed')
    const body = entry.body
    if (body.length < HEADER_BYTES || body.readUInt8(0) !== VERSION) throw new UnreadableEntryError('the entry is not a sealed envelope of a known version')
    const key = this.#keys.get(body.subarray(1, 1 + KEY_ID_BYTES).toString('hex'))
    if (key === undefined) throw new UnreadableEntryError('the entry was sealed with a key that is no longer configured')
    let plain: Buffer
    try {
      const decipher = createDecipheriv('aes-256-gcm', key, body.subarray(1 + KEY_ID_BYTES, 1 + KEY_ID_BYTES + IV_BYTES))
      decipher.setAAD(associatedData(storageKey, entry.statusCode))
      decipher.setAuthTag(body.subarray(1 + KEY_ID_BYTES + IV_BYTES, HEADER_BYTES))
      plain = Buffer.concat([decipher.update(body.subarray(HEADER_BYTES)), decipher.final()])
    } catch (error) {
      throw new UnreadableEntryError('the entry failed authentication: it was altered, or moved from another key', { cause: error })
    }
    const metaLength = plain.readUInt32BE(0)
    const meta = JSON.parse(plain.subarray(4, 4 + metaLength).toString()) as Meta
    const response: StoredResponse = { statusCode: entry.statusCode, contentType: meta.c, headers: meta.h, body: plain.subarray(4 + metaLength) }
    if (meta.o === true) response.bodyOmitted = true
    return response
  }
}

/** A key's id in the envelope: says which key opens it, and nothing about the key. */
function keyId (key: Buffer): Buffer {
  return createHmac('sha256', key).update('fastify-idempotency key id').digest().subarray(0, KEY_ID_BYTES)
}

function associatedData (storageKey: string, statusCode: number): Buffer {
  return Buffer.from(`${statusCode}\n${storageKey}`, 'utf16le')
}
