/**
 * Encryption at rest: what a store holds about a request says nothing to whoever reads the store.
 *
 * - The stored response is sealed with ChaCha20-Poly1305 (through sodium-native when installed)
 *   or AES-256-GCM (sealing/aead.ts). The first key seals; every configured key opens, so keys
 *   rotate without a flag day. The entry's storage key and status are bound in as associated
 *   data: a sealed entry moved to another key, or given another status, no longer opens.
 * - The key and scope reach the store as a keyed hash (HMAC-SHA256 with `keyHashSecret`,
 *   sealing/keyed-hash.ts), so the store never sees a client's key or who asked, and every
 *   storage key has one length.
 *
 * A sealed entry is an ordinary StoredResponse to the store: the status in clear, a marker content
 * type, no headers, and the envelope as its body:
 *
 *   version (1) | key id (8) | nonce (12) | tag (16) | ciphertext of [meta length (4) | meta JSON | body]
 *
 * where meta holds the content type, the headers, and whether the body was omitted.
 */
import { createHmac, createSecretKey, randomFillSync } from 'node:crypto'
import { LRUCache } from 'lru-cache'
import { ALGORITHMS, HEADER_BYTES, isEnvelopeVersion, KEY_ID_BYTES, NONCE_AT, NONCE_BYTES, openFrom, sealInto, type Algorithm, type CipherKey, type EnvelopeVersion } from './sealing/aead.js'
import { keyedHash, type KeyedHash } from './sealing/keyed-hash.js'
import { Utf16Scratch } from './sealing/scratch.js'
import { loadSodium, type Sodium } from './sealing/sodium.js'
import type { StoredResponse } from './storage/types.js'
import { UnreadableEntryError } from './storage/unreadable-entry.js'

/**
 * The `encryption` option: stored responses sealed with ChaCha20-Poly1305 or AES-256-GCM, keys
 * hashed with HMAC-SHA-256 (docs/security.md).
 */
export interface EncryptionOptions {
  /**
   * 32-byte keys, as Buffers or base64 strings. The first seals new entries; each of them
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
  /**
   * The cipher new entries are sealed with: `'chacha20-poly1305'` (the default when sodium-native
   * is installed) or `'aes-256-gcm'` (the default without it; pin it where a policy requires
   * AES-GCM, as FIPS 140 does). Entries sealed with either always open.
   */
  algorithm?: Algorithm
}

/** The content type that marks a sealed entry in the store. */
export const SEALED_CONTENT_TYPE = 'application/vnd.fastify-idempotency.sealed'
/** Marks a storage key that is a keyed hash (see engine/storage-key.ts for the other forms). */
export const KEYED_HASH_PREFIX = '\u0000hmac:'

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

/** A configured key: its id as two 32-bit halves (compared in place in an envelope), the key itself. */
interface OpeningKey {
  idHigh: number
  idLow: number
  key: CipherKey
}

export class ResponseCipher {
  /** The first one seals. A handful at most: looked through in order, with no allocation. */
  readonly #keys: OpeningKey[]
  readonly #sealingId: Buffer
  readonly #sealingKey: CipherKey
  /** The version new envelopes get: which cipher seals. */
  readonly #sealingVersion: EnvelopeVersion
  /** sodium-native's functions, or `null` to do everything through node:crypto. */
  readonly #sodium: Sodium | null
  readonly #keyedHash: KeyedHash
  readonly #ivs = new IvPool()
  /** Keyed hashes of recent storage keys (see hashKey). */
  readonly #hashedKeys = new LRUCache<string, string>({ max: HASHED_KEYS_KEPT })
  /** The entries opened last, by storage key (see open). */
  readonly #opened = new LRUCache<string, OpenedEntry>({ max: OPENED_ENTRIES_KEPT })
  /** The meta JSON of a response with no header, by content type (see #metaJson). */
  readonly #headerlessMeta = new Map<string | null, string>()
  readonly #associatedData = new AssociatedData()

  /**
   * `sodium`: sodium-native's functions, found once per process; `null` has node:crypto do
   * everything (the tests run both).
   */
  constructor (options: EncryptionOptions, sodium: Sodium | null = loadSodium()) {
    if (options === null || typeof options !== 'object') throw new TypeError('fastify-idempotency: invalid options: encryption must be an object { keys, keyHashSecret }')
    if (!Array.isArray(options.keys) || options.keys.length === 0) throw new TypeError('fastify-idempotency: invalid options: encryption.keys must be a non-empty array of 32-byte keys')
    const unknown = Object.keys(options).find((name) => !ENCRYPTION_OPTIONS.has(name))
    if (unknown !== undefined) throw new TypeError(`fastify-idempotency: invalid options: unknown option encryption.${unknown} (known: ${[...ENCRYPTION_OPTIONS].join(', ')})`)
    const algorithm = options.algorithm ?? (sodium === null ? 'aes-256-gcm' : 'chacha20-poly1305')
    if (!Object.hasOwn(ALGORITHMS, algorithm)) throw new TypeError(`fastify-idempotency: invalid options: encryption.algorithm must be one of ${Object.keys(ALGORITHMS).map((name) => `'${name}'`).join(', ')}`)
    this.#sealingVersion = ALGORITHMS[algorithm]
    this.#sodium = sodium
    this.#keys = []
    const ids = options.keys.map((key, index) => {
      const bytes = secretBytes(key, `keys[${index}]`, true)
      const id = keyId(bytes)
      // Key objects made once: createCipheriv takes their handle as it is, where a Buffer is
      // validated and copied into a new native key on every call.
      this.#keys.push({ idHigh: id.readUInt32BE(0), idLow: id.readUInt32BE(4), key: { bytes, object: createSecretKey(bytes) } })
      return id
    })
    this.#sealingKey = this.#keys[0]!.key
    this.#sealingId = ids[0]!
    this.#keyedHash = keyedHash(secretBytes(options.keyHashSecret, 'keyHashSecret', false), sodium)
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

  /** `text`: the body is this string (and `response.body` is not read), as the handler sent it. */
  seal (storageKey: string, response: StoredResponse, text?: string): StoredResponse {
    const omitted = response.bodyOmitted === true
    const plain = plaintext(this.#metaJson(response), omitted ? EMPTY : response.body, omitted ? undefined : text)
    // Every byte is written here and in sealInto. A small envelope is a slice of Node's shared
    // pool, as Buffer.concat would make it: the cheapest allocation (MemoryStorage keeps a copy of
    // its own). Both ciphers' ciphertexts are as long as their plaintexts.
    const envelope = Buffer.allocUnsafe(HEADER_BYTES + plain.length)
    envelope[0] = this.#sealingVersion
    envelope.set(this.#sealingId, 1)
    const nonce = this.#ivs.next()
    envelope.set(nonce, NONCE_AT)
    sealInto(this.#sealingVersion, this.#sodium, this.#sealingKey, this.#associatedData.of(storageKey, response.statusCode), nonce, plain, envelope)
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
    const version = body[0]
    if (body.length < HEADER_BYTES || !isEnvelopeVersion(version)) throw new UnreadableEntryError('the entry is not a sealed envelope of a known version')
    const key = this.#openingKey(body)
    if (key === undefined) throw new UnreadableEntryError('the entry was sealed with a key that is no longer configured')
    let plain: Buffer
    try {
      plain = openFrom(version, this.#sodium, key, this.#associatedData.of(storageKey, entry.statusCode), body)
    } catch (error) {
      throw new UnreadableEntryError('the entry failed authentication: it was altered, or moved from another key', { cause: error })
    }
    const metaLength = plain.readUInt32BE(0)
    const meta = JSON.parse(plain.toString('utf8', 4, 4 + metaLength)) as Meta
    const response: StoredResponse = { statusCode: entry.statusCode, contentType: meta.c, headers: meta.h, body: plain.subarray(4 + metaLength) }
    if (meta.o === true) response.bodyOmitted = true
    return response
  }

  #openingKey (envelope: Buffer): CipherKey | undefined {
    const high = envelope.readUInt32BE(1)
    const low = envelope.readUInt32BE(5)
    for (const key of this.#keys) if (key.idHigh === high && key.idLow === low) return key.key
    return undefined
  }
}

const EMPTY = Buffer.alloc(0)
const ENCRYPTION_OPTIONS = new Set(['keys', 'keyHashSecret', 'algorithm'])

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
function plaintext (metaJson: string, body: Buffer, text: string | undefined): Buffer {
  const metaLength = Buffer.byteLength(metaJson)
  const bodyLength = text === undefined ? body.length : Buffer.byteLength(text)
  const plain = Buffer.allocUnsafe(4 + metaLength + bodyLength)
  plain.writeUInt32BE(metaLength, 0)
  plain.write(metaJson, 4)
  if (text === undefined) plain.set(body, 4 + metaLength)
  else plain.write(text, 4 + metaLength)
  return plain
}

/**
 * Random 96-bit nonces, drawn from the system's CSPRNG 4 KiB at a time instead of one native call
 * per entry: the same randomness, each nonce handed out once. The limit for random 96-bit nonces
 * (2^32 entries per key, for GCM and ChaCha20-Poly1305 alike) is unchanged.
 */
class IvPool {
  static readonly #COUNT = 340
  readonly #pool = Buffer.allocUnsafeSlow(NONCE_BYTES * IvPool.#COUNT)
  /** A view of each nonce of the pool, made once: the pool is refilled in place. */
  readonly #nonces = Array.from({ length: IvPool.#COUNT }, (_, index) => this.#pool.subarray(NONCE_BYTES * index, NONCE_BYTES * (index + 1)))
  #next = IvPool.#COUNT

  /** A fresh nonce; valid until the pool is refilled, IvPool.#COUNT calls later (a seal uses it at once). */
  next (): Buffer {
    if (this.#next === IvPool.#COUNT) {
      randomFillSync(this.#pool)
      this.#next = 0
    }
    return this.#nonces[this.#next++]!
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
  readonly #scratch = new Utf16Scratch(2048)

  of (storageKey: string, statusCode: number): Buffer {
    return this.#scratch.bytes(`${statusCode}\n${storageKey}`)
  }
}

/** Most content types whose headerless meta JSON is kept (a handful in any app). */
const HEADERLESS_META_KEPT = 64

/** Whether `object` has an own enumerable member, without making a list of them. */
function hasOwnMember (object: object): boolean {
  for (const name in object) if (Object.hasOwn(object, name)) return true
  return false
}
