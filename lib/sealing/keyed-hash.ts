/**
 * The keyed hash that replaces a key and scope in the store: HMAC-SHA256 (RFC 2104) under
 * `keyHashSecret`, of the text as UTF-16 code units (so that lone surrogates hash apart), in
 * base64url. It is where an entry lives: every version of the plugin, with or without
 * sodium-native, must give the same digest for the same text.
 *
 * Both forms hash SHA-256((K ^ opad) || SHA-256((K ^ ipad) || message)) over pads derived once,
 * without a native HMAC context per call (createHmac's costs more than both hashes).
 */
import { hash } from 'node:crypto'
import { Utf16Scratch } from './scratch.js'
import type { Sodium } from './sodium.js'

export interface KeyedHash {
  digest: (text: string) => string
}

const BLOCK = 64
const DIGEST = 32
/** Room for a message written in place: keys and scopes of up to 2,016 characters. */
const SCRATCH = 4096

/** The inner and outer pads of `secret` (a secret longer than a block is hashed first, as RFC 2104 says). */
function pads (secret: Buffer): { inner: Buffer, outer: Buffer } {
  const key = secret.length > BLOCK ? hash('sha256', secret, 'buffer') : secret
  const inner = Buffer.alloc(BLOCK)
  const outer = Buffer.alloc(BLOCK)
  for (let index = 0; index < BLOCK; index++) {
    const byte = key[index] ?? 0
    inner[index] = byte ^ 0x36
    outer[index] = byte ^ 0x5c
  }
  return { inner, outer }
}

export function keyedHash (secret: Buffer, sodium: Sodium | null): KeyedHash {
  return sodium === null ? new NodeKeyedHash(secret) : new SodiumKeyedHash(secret, sodium)
}

/** Two one-shot `crypto.hash` calls. */
class NodeKeyedHash implements KeyedHash {
  /** The inner pad, followed by room for a message that fits. */
  readonly #inner = Buffer.alloc(SCRATCH)
  /** The outer pad, followed by the inner digest. */
  readonly #outer = Buffer.alloc(BLOCK + DIGEST)

  constructor (secret: Buffer) {
    const { inner, outer } = pads(secret)
    this.#inner.set(inner)
    this.#outer.set(outer)
  }

  digest (text: string): string {
    const length = BLOCK + text.length * 2
    let message: Buffer
    if (length <= SCRATCH) {
      this.#inner.write(text, BLOCK, 'utf16le')
      message = this.#inner.subarray(0, length)
    } else {
      message = Buffer.concat([this.#inner.subarray(0, BLOCK), Buffer.from(text, 'utf16le')])
    }
    this.#outer.set(hash('sha256', message, 'buffer'), BLOCK)
    return hash('sha256', this.#outer, 'base64url')
  }
}

/**
 * libsodium's SHA-256 from states that have already absorbed each pad: a digest compresses the
 * message and the inner digest alone, two blocks for a key of up to 27 characters, where the
 * one-shot form compresses both pads again (four), each call through Node's crypto binding.
 */
class SodiumKeyedHash implements KeyedHash {
  readonly #sodium: Sodium
  readonly #innerState: Buffer
  readonly #outerState: Buffer
  /** The state being worked on: a copy of one of the two above. */
  readonly #state: Buffer
  readonly #message = new Utf16Scratch(SCRATCH)
  readonly #innerDigest = Buffer.alloc(DIGEST)
  readonly #digest = Buffer.alloc(DIGEST)

  constructor (secret: Buffer, sodium: Sodium) {
    this.#sodium = sodium
    const { inner, outer } = pads(secret)
    this.#innerState = Buffer.alloc(sodium.sha256StateBytes)
    this.#outerState = Buffer.alloc(sodium.sha256StateBytes)
    this.#state = Buffer.alloc(sodium.sha256StateBytes)
    sodium.sha256Init(this.#innerState)
    sodium.sha256Update(this.#innerState, inner)
    sodium.sha256Init(this.#outerState)
    sodium.sha256Update(this.#outerState, outer)
  }

  digest (text: string): string {
    const sodium = this.#sodium
    const state = this.#state
    const message = this.#message.bytes(text)
    // TypedArray set, not Buffer copy: no call into Node's binding for 104 bytes.
    state.set(this.#innerState)
    sodium.sha256Update(state, message)
    sodium.sha256Final(state, this.#innerDigest)
    state.set(this.#outerState)
    sodium.sha256Update(state, this.#innerDigest)
    sodium.sha256Final(state, this.#digest)
    return this.#digest.toString('base64url')
  }
}
