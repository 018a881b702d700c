/**
 * The authenticated ciphers a sealed envelope may name by its version byte, each able to seal
 * and to open with or without sodium-native, so that any process of this version opens what any
 * other sealed:
 *
 * - 1: AES-256-GCM, through node:crypto (what every earlier version sealed with);
 * - 2: ChaCha20-Poly1305 (RFC 8439), through sodium-native when it is installed, node:crypto
 *   otherwise. One call into libsodium seals a response for about a quarter of what setting up
 *   Node's GCM cipher alone costs (docs/security.md#what-sealing-costs).
 *
 * Both take a 256-bit key, a 96-bit nonce and a 128-bit tag, and both envelopes share one layout:
 * version (1) | key id (8) | nonce (12) | tag (16) | ciphertext.
 */
import { createCipheriv, createDecipheriv, type KeyObject } from 'node:crypto'
import type { Sodium } from './sodium.js'

/** An envelope's version byte: which cipher sealed it. */
export type EnvelopeVersion = 1 | 2

/** The `encryption.algorithm` option's values, and the version each seals. */
export const ALGORITHMS = { 'aes-256-gcm': 1, 'chacha20-poly1305': 2 } as const
export type Algorithm = keyof typeof ALGORITHMS

/** Whether an envelope's first byte is a version this code opens. */
export function isEnvelopeVersion (byte: number | undefined): byte is EnvelopeVersion {
  return byte === ALGORITHMS['aes-256-gcm'] || byte === ALGORITHMS['chacha20-poly1305']
}

export const KEY_ID_BYTES = 8
export const NONCE_BYTES = 12
export const TAG_BYTES = 16
export const NONCE_AT = 1 + KEY_ID_BYTES
export const TAG_AT = NONCE_AT + NONCE_BYTES
export const HEADER_BYTES = TAG_AT + TAG_BYTES

/** A key as each implementation takes it: its bytes (libsodium) and a key object made once (node:crypto). */
export interface CipherKey {
  bytes: Buffer
  object: KeyObject
}

/** node:crypto's name of each version's cipher: the option's own names are node:crypto's. */
const NODE_NAMES = Object.fromEntries(Object.entries(ALGORITHMS).map(([name, version]) => [version, name])) as Record<EnvelopeVersion, Algorithm>
const TAG_OPTIONS = { authTagLength: TAG_BYTES }

/** Where libsodium writes a tag before it is copied into the envelope (sealing is synchronous). */
const TAG_SCRATCH = Buffer.alloc(TAG_BYTES)

/**
 * Encrypts `plain` with `nonce` into `envelope` after its header, and writes the tag into the
 * header; the version, key id and nonce are already there. (A view of a Buffer costs more than
 * copying 16 bytes: the tag goes through a scratch Buffer, the nonce is passed as given.)
 */
export function sealInto (version: EnvelopeVersion, sodium: Sodium | null, key: CipherKey, associatedData: Buffer, nonce: Buffer, plain: Buffer, envelope: Buffer): void {
  if (version === 2 && sodium !== null) {
    sodium.chachaSeal(envelope.subarray(HEADER_BYTES), TAG_SCRATCH, plain, associatedData, nonce, key.bytes)
    envelope.set(TAG_SCRATCH, TAG_AT)
    return
  }
  // createCipheriv('chacha20-poly1305') requires the tag length; GCM accepts it. Both ciphers
  // have the same calls (typed here as GCM's).
  const cipher = createCipheriv(NODE_NAMES[version] as 'aes-256-gcm', key.object, nonce, TAG_OPTIONS)
  cipher.setAAD(associatedData)
  envelope.set(cipher.update(plain), HEADER_BYTES)
  cipher.final()
  envelope.set(cipher.getAuthTag(), TAG_AT)
}

/** The plaintext of `envelope`; throws when its tag does not authenticate it with `associatedData`. */
export function openFrom (version: EnvelopeVersion, sodium: Sodium | null, key: CipherKey, associatedData: Buffer, envelope: Buffer): Buffer {
  const nonce = envelope.subarray(NONCE_AT, TAG_AT)
  const tag = envelope.subarray(TAG_AT, HEADER_BYTES)
  const ciphertext = envelope.subarray(HEADER_BYTES)
  if (version === 2 && sodium !== null) {
    const plain = Buffer.allocUnsafe(ciphertext.length)
    if (!sodium.chachaOpen(plain, ciphertext, tag, associatedData, nonce, key.bytes)) throw new Error('the tag does not authenticate the envelope')
    return plain
  }
  const decipher = createDecipheriv(NODE_NAMES[version] as 'aes-256-gcm', key.object, nonce, TAG_OPTIONS)
  decipher.setAAD(associatedData)
  decipher.setAuthTag(tag)
  const plain = decipher.update(ciphertext)
  // Nothing more comes out here; final() is what checks the tag.
  decipher.final()
  return plain
}
