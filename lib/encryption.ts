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
import { createCipheriv, createDecipheriv, createHmac, createSecretKey, hash, randomFillSync, type KeyObject } from 'node:crypto'
import { LRUCache } from 'lru-cache'
import type { StoredResponse } from './storage/types.js'
import { UnreadableEntryError } from './storage/unreadable-entry.js'

/**
 * The `encryption` option: stored responses sealed with AES-256-GCM, keys hashed with HMAC-SHA-256
 * (docs/security.md).
 */
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

/** A configured key: its id as two 32-bit halves (compared in place in an envelope), its key object. */
interface OpeningKey {
  idHigh: number
  idLow: number
  key: KeyObject
}

export class ResponseCipher {
  /** The first one seals. A handful at most: looked through in order, with no allocation. */
  readonly #keys: OpeningKey[]
  readonly #sealingId: Buffer
  /**
   * Key objects made once: createCipheriv takes their handle as it is, where a Buffer is
   * validated and copied into a new native key on every call.
   */
  readonly #sealingKey: KeyObject
  readonly #keyedHash: KeyedHash
  readonly #ivs = new IvPool()
  /** Keyed hashes of recent storage keys (see hashKey). */
  readonly #hashedKeys = new LRUCache<string, string>({ max: HASHED_KEYS_KEPT })
  /** The entries opened last, by storage key (see open). */
  readonly #opened = new LRUCache<string, OpenedEntry>({ max: OPENED_ENTRIES_KEPT })
  /** The meta JSON of a response with no header, by content type (see #metaJson). */
  readonly #headerlessMeta = new Map<string | null, string>()
  readonly #associatedData = new AssociatedData()

  constructor (options: EncryptionOptions) {
    if (options === null || typeof options !== 'object') throw new TypeError('fastify-idempotency: invalid options: encryption must be an object { keys, keyHashSecret }')
    if (!Array.isArray(options.keys) || options.keys.length === 0) throw new TypeError('fastify-idempotency: invalid options: encryption.keys must be a non-empty array of 32-byte keys')
    this.#keys = []
    const ids = options.keys.map((key, index) => {
      const bytes = secretBytes(key, `keys[${index}]`, true)
      const id = keyId(bytes)
      this.#keys.push({ idHigh: id.readUInt32BE(0), idLow: id.readUInt32BE(4), key: createSecretKey(bytes) })
      return id
    })
    this.#sealingKey = this.#keys[0]!.key
    this.#sealingId = ids[0]!
    this.#keyedHash = new KeyedHash(secretBytes(options.keyHashSecret, 'keyHashSecret', false))
  }

  /** The storage key for a key and scope, composed as engine/storage-key.ts composes them. */
  hashKey (composed: string): string {
    // A retry, and every replay after it, hashes the same key again: the last keys' hashes are
    // kept. They are held in this process only, where the keys pass through anyway; the store
    // still sees hashes alone.
    let hashed = this.#hashedKeys.get(composed)
    if (hashed === undefined) this.#hashedKeys.set(composed, hashed = KEYED_HASH_PREFIX + this.#keyedHash.digest(composed))
    return hashed
  }

  seal (storageKey: string, response: StoredResponse): StoredResponse {
    const plain = plaintext(this.#metaJson(response), response.bodyOmitted === true ? EMPTY : response.body)
    const iv = this.#ivs.next()
    const cipher = createCipheriv('aes-256-gcm', this.#sealingKey, iv)
    cipher.setAAD(this.#associatedData.of(storageKey, response.statusCode))
    const encrypted = cipher.update(plain)
    cipher.final()
    // Every byte is written below. A small envelope is a slice of Node's shared pool, as
    // Buffer.concat would make it: the cheapest allocation (MemoryStorage keeps a copy of its own).
    const envelope = Buffer.allocUnsafe(HEADER_BYTES + encrypted.length)
    envelope[0] = VERSION
    envelope.set(this.#sealingId, 1)
    envelope.set(iv, 1 + KEY_ID_BYTES)
    envelope.set(cipher.getAuthTag(), 1 + KEY_ID_BYTES + IV_BYTES)
    envelope.set(encrypted, HEADER_BYTES)
    return { statusCode: response.statusCode, contentType: SEALED_CONTENT_TYPE, headers: {}, body: envelope }
  }

  /**
   * The meta JSON of `response`. Most responses keep no header and have one of a few content
   * types: their meta is written once per content type and reused (JSON.stringify of the meta
   * costs about 5k instructions a call).
   */
  #metaJson (response: StoredResponse): string {
    const omitted = response.bodyOmitted === true
    if (omitted || hasOwnMember(response.headers)) {
      const meta: Meta = { c: response.contentType, h: response.headers }
      if (omitted) meta.o = true
      return JSON.stringify(meta)
    }
    let json = this.#headerlessMeta.get(response.contentType)
    if (json === undefined) {
      json = JSON.stringify({ c: response.contentType, h: {} } satisfies Meta)
      if (this.#headerlessMeta.size < HEADERLESS_META_KEPT) this.#headerlessMeta.set(response.contentType, json)
    }
    return json
  }

  /**
   * The response a sealed entry holds; throws UnreadableEntryError when it cannot be opened.
   *
   * Replays of one key open the same envelope again and again, and setting up a decipher costs
   * about 10 µs inside a busy server, several times its decrypting. So the last entries opened
   * are kept with their envelope: the same bytes under the same storage key and status open to
   * the same response (that is what authenticated encryption guarantees), and any other envelope
   * is opened and checked as usual. The responses kept are plaintext in this process's memory,
   * where every replay puts them anyway; the store still holds only sealed entries.
   */
  open (storageKey: string, entry: StoredResponse): StoredResponse {
    if (entry.contentType !== SEALED_CONTENT_TYPE) throw new UnreadableEntryError('the entry is not sealed')
    const body = entry.body
    const recent = this.#opened.get(storageKey)
    if (recent !== undefined && recent.statusCode === entry.statusCode && recent.envelope.equals(body)) return recent.response
    const response = this.#decrypt(storageKey, entry)
    // A copy: a reply parser's Buffer may be a slice of a much larger read.
    if (body.length <= OPENED_ENVELOPE_MAX_BYTES) this.#opened.set(storageKey, { statusCode: entry.statusCode, envelope: Buffer.from(body), response })
    return response
  }

  #decrypt (storageKey: string, entry: StoredResponse): StoredResponse {
    const body = entry.body
    if (body.length < HEADER_BYTES || body[0] !== VERSION) throw new UnreadableEntryError('the entry is not a sealed envelope of a known version')
    const key = this.#openingKey(body)
    if (key === undefined) throw new UnreadableEntryError('the entry was sealed with a key that is no longer configured')
    let plain: Buffer
    try {
      const decipher = createDecipheriv('aes-256-gcm', key, body.subarray(1 + KEY_ID_BYTES, 1 + KEY_ID_BYTES + IV_BYTES))
      decipher.setAAD(this.#associatedData.of(storageKey, entry.statusCode))
      decipher.setAuthTag(body.subarray(1 + KEY_ID_BYTES + IV_BYTES, HEADER_BYTES))
      plain = decipher.update(body.subarray(HEADER_BYTES))
      // GCM returns nothing more here; final() is what checks the tag.
      decipher.final()
    } catch (error) {
      throw new UnreadableEntryError('the entry failed authentication: it was altered, or moved from another key', { cause: error })
    }
    const metaLength = plain.readUInt32BE(0)
    const meta = JSON.parse(plain.toString('utf8', 4, 4 + metaLength)) as Meta
    const response: StoredResponse = { statusCode: entry.statusCode, contentType: meta.c, headers: meta.h, body: plain.subarray(4 + metaLength) }
    if (meta.o === true) response.bodyOmitted = true
    return response
  }

  #openingKey (envelope: Buffer): KeyObject | undefined {
    const high = envelope.readUInt32BE(1)
    const low = envelope.readUInt32BE(5)
    for (const key of this.#keys) if (key.idHigh === high && key.idLow === low) return key.key
    return undefined
  }
}

const EMPTY = Buffer.alloc(0)

/** Most keyed hashes kept by hashKey: at most about 1 MiB of keys with their hashes. */
const HASHED_KEYS_KEPT = 4096
/** Most entries kept opened, and the largest envelope kept: at most 4 MiB of envelopes and as much plaintext. */
const OPENED_ENTRIES_KEPT = 128
const OPENED_ENVELOPE_MAX_BYTES = 16 * 1024

/** An entry opened lately: the envelope as stored, and what it opened to. */
interface OpenedEntry {
  statusCode: number
  envelope: Buffer
  response: StoredResponse
}

/**
 * What is encrypted, in one buffer: meta length (4) | meta JSON | body. One cipher call costs a
 * native call and a new output buffer; copying a body of a few KiB costs less than either.
 */
function plaintext (metaJson: string, body: Buffer): Buffer {
  const metaLength = Buffer.byteLength(metaJson)
  const plain = Buffer.allocUnsafe(4 + metaLength + body.length)
  plain.writeUInt32BE(metaLength, 0)
  plain.write(metaJson, 4)
  plain.set(body, 4 + metaLength)
  return plain
}

/**
 * Random 96-bit IVs, drawn from the system's CSPRNG 4 KiB at a time instead of one native call per
 * entry: the same randomness, each IV handed out once. GCM's limit for random IVs (2^32 entries
 * per key) is unchanged.
 */
class IvPool {
  static readonly #COUNT = 340
  readonly #pool = Buffer.allocUnsafeSlow(IV_BYTES * IvPool.#COUNT)
  #next = IvPool.#COUNT

  /** A fresh IV; valid until the next call (the cipher copies it when it is set up). */
  next (): Buffer {
    if (this.#next === IvPool.#COUNT) {
      randomFillSync(this.#pool)
      this.#next = 0
    }
    const offset = IV_BYTES * this.#next++
    return this.#pool.subarray(offset, offset + IV_BYTES)
  }
}

/**
 * HMAC-SHA256 (RFC 2104) under one secret, as two one-shot hashes over pads derived once:
 * SHA-256((K ^ opad) || SHA-256((K ^ ipad) || message)). The same digest createHmac gives, without
 * the native HMAC context createHmac sets up on every call, which inside a busy server costs more
 * than both hashes (7.5 against 4.7 µs of server CPU per request, bench/analysis.md).
 */
class KeyedHash {
  static readonly #BLOCK = 64
  static readonly #SCRATCH = 4096
  /** The inner pad, followed by room for a message that fits. */
  readonly #inner: Buffer
  /** The outer pad, followed by the inner digest. */
  readonly #outer: Buffer

  constructor (secret: Buffer) {
    // A secret longer than the hash's block is hashed first, as RFC 2104 says.
    const key = secret.length > KeyedHash.#BLOCK ? hash('sha256', secret, 'buffer') : secret
    this.#inner = Buffer.alloc(KeyedHash.#SCRATCH)
    this.#outer = Buffer.alloc(KeyedHash.#BLOCK + 32)
    for (let index = 0; index < KeyedHash.#BLOCK; index++) {
      const byte = key[index] ?? 0
      this.#inner[index] = byte ^ 0x36
      this.#outer[index] = byte ^ 0x5c
    }
  }

  /** The digest of `text` as UTF-16 code units (so that lone surrogates hash apart), base64url. */
  digest (text: string): string {
    const length = KeyedHash.#BLOCK + text.length * 2
    let message: Buffer
    if (length <= KeyedHash.#SCRATCH) {
      this.#inner.write(text, KeyedHash.#BLOCK, 'utf16le')
      message = this.#inner.subarray(0, length)
    } else {
      message = Buffer.concat([this.#inner.subarray(0, KeyedHash.#BLOCK), Buffer.from(text, 'utf16le')])
    }
    this.#outer.set(hash('sha256', message, 'buffer'), KeyedHash.#BLOCK)
    return hash('sha256', this.#outer, 'base64url')
  }
}

/** A key's id in the envelope: says which key opens it, and nothing about the key. */
function keyId (key: Buffer): Buffer {
  return createHmac('sha256', key).update('fastify-idempotency key id').digest().subarray(0, KEY_ID_BYTES)
}

/**
 * The associated data that binds an envelope to its storage key and status: `status \n key` as
 * UTF-16LE. Written into one scratch buffer, reused: the cipher reads it in setAAD and keeps
 * nothing of it.
 */
class AssociatedData {
  static readonly #SCRATCH = 2048
  readonly #scratch = Buffer.allocUnsafeSlow(AssociatedData.#SCRATCH)

  of (storageKey: string, statusCode: number): Buffer {
    const text = `${statusCode}\n${storageKey}`
    if (text.length * 2 > AssociatedData.#SCRATCH) return Buffer.from(text, 'utf16le')
    return this.#scratch.subarray(0, this.#scratch.write(text, 'utf16le'))
  }
}

/** Most content types whose headerless meta JSON is kept (a handful in any app). */
const HEADERLESS_META_KEPT = 64

/** Whether `object` has an own enumerable member, without making a list of them. */
function hasOwnMember (object: object): boolean {
  for (const name in object) if (Object.hasOwn(object, name)) return true
  return false
}
