/**
 * sodium-native is called through its native binding, which checks nothing: the plugin uses it
 * only once it has answered what node:crypto answers. A binding that computes anything else (a
 * changed argument order in a later release, say), or throws, is not used, and node:crypto does
 * the work.
 */
import { createRequire } from 'node:module'
import { describe, expect, it } from 'vitest'
import { loadSodium, sodiumOf, type SodiumBinding } from '../lib/sealing/sodium.js'

const real = ((): SodiumBinding | null => {
  try {
    return createRequire(import.meta.url)('sodium-native/binding.js') as SodiumBinding
  } catch {
    return null
  }
})()

describe.runIf(real !== null || process.env.CI === 'true')('sodium-native\'s binding, proven before use', () => {
  const binding = real!

  it('is used when it answers what node:crypto answers', () => {
    expect(sodiumOf(binding)).not.toBeNull()
    expect(loadSodium()).not.toBeNull()
  })

  it('is not used when a seal writes other bytes, a tag that does not authenticate is accepted, a hash ignores its state, or a call throws or fails', () => {
    const altered: Array<Partial<SodiumBinding>> = [
      // Ciphertext one bit off.
      { crypto_aead_chacha20poly1305_ietf_encrypt_detached: (c, mac, m, ad, npub, k) => { const status = binding.crypto_aead_chacha20poly1305_ietf_encrypt_detached(c, mac, m, ad, npub, k); c[0] = c[0]! ^ 1; return status } },
      // Arguments in another order.
      { crypto_aead_chacha20poly1305_ietf_encrypt_detached: (c, mac, m, ad, npub, k) => binding.crypto_aead_chacha20poly1305_ietf_encrypt_detached(c, mac, m, Buffer.alloc(0), npub, k) },
      // Every tag accepted.
      { crypto_aead_chacha20poly1305_ietf_decrypt_detached: (m, c, mac, ad, npub, k) => { binding.crypto_aead_chacha20poly1305_ietf_decrypt_detached(m, c, mac, ad, npub, k); return 0 } },
      // A state that starts over on every update.
      { crypto_hash_sha256_update: (state, input) => { binding.crypto_hash_sha256_init(state); return binding.crypto_hash_sha256_update(state, input) } },
      { crypto_hash_sha256_final: () => -1 },
      { crypto_hash_sha256_init: () => { throw new TypeError('state must be a typed array') } },
      { crypto_hash_sha256_STATEBYTES: 8 }
    ]
    for (const change of altered) {
      const faulty = Object.create(binding) as SodiumBinding
      Object.assign(faulty, change)
      expect(sodiumOf(faulty)).toBeNull()
    }
  })
})
