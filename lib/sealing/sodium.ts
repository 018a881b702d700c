/**
 * libsodium through `sodium-native`, an optional dependency: when it is installed (npm installs
 * it by default, with a prebuilt binary for every common platform), the keyed hash and the seal
 * go through it, at a fraction of what node:crypto costs per call (docs/security.md#what-sealing-costs).
 * Without it, node:crypto does the same work: the same keyed hashes, envelopes either can open.
 */
import { createCipheriv, hash } from 'node:crypto'
import { createRequire } from 'node:module'

/** The few functions of libsodium the plugin calls. */
export interface Sodium {
  /** Bytes of a SHA-256 state: a state copied as bytes goes on from where it was. */
  sha256StateBytes: number
  sha256Init: (state: Buffer) => void
  sha256Update: (state: Buffer, input: Buffer) => void
  sha256Final: (state: Buffer, output: Buffer) => void
  /** ChaCha20-Poly1305 (IETF, RFC 8439): the ciphertext (as long as the message) and the 16-byte tag written into the Buffers given. */
  chachaSeal: (ciphertext: Buffer, tag: Buffer, message: Buffer, associatedData: Buffer, nonce: Buffer, key: Buffer) => void
  /** Writes the message and answers true, or answers false when the tag does not authenticate. */
  chachaOpen: (message: Buffer, ciphertext: Buffer, tag: Buffer, associatedData: Buffer, nonce: Buffer, key: Buffer) => boolean
}

/**
 * sodium-native's native binding: its exported functions check every argument against constants
 * read from this object, which has hundreds of members, on every call: about 4k instructions per
 * first request in all (bench/analysis.md). The plugin's buffers have fixed sizes, checked once,
 * and the self-test below proves the binding computes what node:crypto computes before it is used.
 */
export interface SodiumBinding {
  crypto_hash_sha256_STATEBYTES: number
  crypto_hash_sha256_init: (state: Buffer) => number
  crypto_hash_sha256_update: (state: Buffer, input: Buffer) => number
  crypto_hash_sha256_final: (state: Buffer, output: Buffer) => number
  crypto_aead_chacha20poly1305_ietf_encrypt_detached: (c: Buffer, mac: Buffer, m: Buffer, ad: Buffer, npub: Buffer, k: Buffer) => number
  crypto_aead_chacha20poly1305_ietf_decrypt_detached: (m: Buffer, c: Buffer, mac: Buffer, ad: Buffer, npub: Buffer, k: Buffer) => number
}

let loaded: Sodium | null | undefined

/**
 * libsodium's functions, or `null` when sodium-native is not installed, cannot be loaded here (no
 * binary for the platform, a bundle that left it out), or fails the self-test. Loaded once.
 */
export function loadSodium (): Sodium | null {
  if (loaded !== undefined) return loaded
  try {
    loaded = sodiumOf(createRequire(import.meta.url)('sodium-native/binding.js') as SodiumBinding)
  } catch {
    loaded = null
  }
  return loaded
}

/** The functions of `binding`, or `null` when they do not answer what node:crypto answers (or throw). */
export function sodiumOf (binding: SodiumBinding): Sodium | null {
  try {
    const sodium = wrap(binding)
    return agreesWithNode(sodium) ? sodium : null
  } catch {
    return null
  }
}

function wrap (binding: SodiumBinding): Sodium {
  const { crypto_hash_sha256_init: init, crypto_hash_sha256_update: update, crypto_hash_sha256_final: final } = binding
  const { crypto_aead_chacha20poly1305_ietf_encrypt_detached: seal, crypto_aead_chacha20poly1305_ietf_decrypt_detached: open } = binding
  const fail = (what: string, status: number): never => { throw new Error(`sodium-native: ${what} failed (${status})`) }
  return {
    sha256StateBytes: binding.crypto_hash_sha256_STATEBYTES,
    sha256Init: (state) => { const status = init(state); if (status !== 0) fail('SHA-256 init', status) },
    sha256Update: (state, input) => { const status = update(state, input); if (status !== 0) fail('SHA-256 update', status) },
    sha256Final: (state, output) => { const status = final(state, output); if (status !== 0) fail('SHA-256 final', status) },
    chachaSeal: (ciphertext, tag, message, associatedData, nonce, key) => {
      const status = seal(ciphertext, tag, message, associatedData, nonce, key)
      if (status < 0) fail('ChaCha20-Poly1305 seal', status)
    },
    chachaOpen: (message, ciphertext, tag, associatedData, nonce, key) => open(message, ciphertext, tag, associatedData, nonce, key) === 0
  }
}

/**
 * Whether libsodium answers what node:crypto answers: a SHA-256 continued from a copied state, a
 * ChaCha20-Poly1305 seal, its opening, and the refusal of an altered tag. A binding whose
 * functions took other arguments would fail here, and the plugin would use node:crypto.
 */
function agreesWithNode (sodium: Sodium): boolean {
  if (sodium.sha256StateBytes < 64 || sodium.sha256StateBytes > 1024) return false
  const block = Buffer.alloc(64, 0x36)
  const message = Buffer.from('fastify-idempotency self-test: ' + 'x'.repeat(50))
  const state = Buffer.alloc(sodium.sha256StateBytes)
  sodium.sha256Init(state)
  sodium.sha256Update(state, block)
  const copy = Buffer.from(state)
  sodium.sha256Update(copy, message)
  const digest = Buffer.alloc(32)
  sodium.sha256Final(copy, digest)
  if (!digest.equals(hash('sha256', Buffer.concat([block, message]), 'buffer'))) return false

  const key = Buffer.alloc(32, 7)
  const nonce = Buffer.alloc(12, 9)
  const associatedData = Buffer.from('201\nkey')
  const cipher = createCipheriv('chacha20-poly1305', key, nonce, { authTagLength: 16 })
  cipher.setAAD(associatedData, { plaintextLength: message.length })
  const expected = cipher.update(message)
  cipher.final()
  const ciphertext = Buffer.alloc(message.length)
  const tag = Buffer.alloc(16)
  sodium.chachaSeal(ciphertext, tag, message, associatedData, nonce, key)
  if (!ciphertext.equals(expected) || !tag.equals(cipher.getAuthTag())) return false
  const opened = Buffer.alloc(message.length)
  if (!sodium.chachaOpen(opened, ciphertext, tag, associatedData, nonce, key) || !opened.equals(message)) return false
  tag[0] = tag[0]! ^ 1
  return !sodium.chachaOpen(opened, ciphertext, tag, associatedData, nonce, key)
}
