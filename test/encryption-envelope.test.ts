/**
 * The sealed envelope across versions of the code: entries sealed with AES-256-GCM by every
 * earlier version (test/fixtures/sealed-v1.json) and with ChaCha20-Poly1305 by this one
 * (sealed-v2.json) open, to the same response, with sodium-native and without it; the keyed hash
 * of a key and scope never changes (another hash would find none of the stored entries), whichever
 * computes it; and `algorithm: 'aes-256-gcm'` seals in the version 1 layout, so a process still
 * running an earlier version opens it during a rolling deploy.
 */
import { createHmac } from 'node:crypto'
import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import { ResponseCipher, SEALED_CONTENT_TYPE } from '../lib/encryption.js'
import { loadSodium } from '../lib/sealing/sodium.js'
import { UnreadableEntryError } from '../lib/storage/unreadable-entry.js'
import type { StoredResponse } from '../lib/index.js'

interface FixtureResponse { statusCode: number, contentType: string | null, headers: Record<string, string | string[]>, body: string, bodyOmitted?: boolean }
interface Fixture {
  keys: { key1: string, key2: string }
  keyHashSecret: string
  hashes: Record<string, string>
  entries: Array<{ sealedWith: 'key1' | 'key2', storageKey: string, sealed: FixtureResponse, response: FixtureResponse }>
}

const fixture = JSON.parse(readFileSync(new URL('./fixtures/sealed-v1.json', import.meta.url), 'utf8')) as Fixture
const stored = (response: FixtureResponse): StoredResponse => ({ ...response, body: Buffer.from(response.body, 'base64') })
const both = new ResponseCipher({ keys: [fixture.keys.key2, fixture.keys.key1], keyHashSecret: fixture.keyHashSecret })

describe('sealed envelope, version 1', () => {
  it('opens every entry sealed by the earlier code, to the response that was sealed', () => {
    for (const entry of fixture.entries) {
      expect(both.open(entry.storageKey, stored(entry.sealed))).toEqual(stored(entry.response))
      const one = new ResponseCipher({ keys: [fixture.keys[entry.sealedWith]], keyHashSecret: fixture.keyHashSecret })
      expect(one.open(entry.storageKey, stored(entry.sealed))).toEqual(stored(entry.response))
    }
  })

  it('still binds each of them to its storage key and status', () => {
    for (const entry of fixture.entries) {
      expect(() => both.open(`${entry.storageKey}x`, stored(entry.sealed))).toThrow(/altered, or moved/)
      expect(() => both.open(entry.storageKey, { ...stored(entry.sealed), statusCode: entry.sealed.statusCode + 1 })).toThrow(/altered, or moved/)
    }
  })

  it('opens an envelope again to the same response, and still refuses one altered after it was opened', () => {
    const cipher = new ResponseCipher({ keys: [fixture.keys.key2, fixture.keys.key1], keyHashSecret: fixture.keyHashSecret })
    for (const entry of fixture.entries) {
      const sealed = stored(entry.sealed)
      const first = cipher.open(entry.storageKey, sealed)
      // The same bytes in another Buffer, as a store hands them back on every read.
      expect(cipher.open(entry.storageKey, { ...sealed, body: Buffer.from(sealed.body) })).toEqual(first)
      for (const at of [0, 9, 21, sealed.body.length - 1]) {
        const altered = Buffer.from(sealed.body)
        altered[at] = altered[at]! ^ 1
        expect(() => cipher.open(entry.storageKey, { ...sealed, body: altered })).toThrow(UnreadableEntryError)
      }
      expect(() => cipher.open(entry.storageKey, { ...sealed, body: sealed.body.subarray(0, -1) })).toThrow(UnreadableEntryError)
      expect(() => cipher.open(`${entry.storageKey}x`, sealed)).toThrow(/altered, or moved/)
      expect(() => cipher.open(entry.storageKey, { ...sealed, statusCode: sealed.statusCode + 1 })).toThrow(/altered, or moved/)
      expect(cipher.open(entry.storageKey, sealed)).toEqual(stored(entry.response))
    }
  })

  it('opens every entry correctly while hundreds of others are opened in between', () => {
    const cipher = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret })
    const responses = Array.from({ length: 600 }, (_, index): StoredResponse => ({ statusCode: 200 + (index % 3), contentType: 'text/plain', headers: { 'x-index': String(index) }, body: Buffer.from(`body ${index}`) }))
    const sealed = responses.map((response, index) => cipher.seal(`key-${index % 300}-${index}`, response))
    for (let round = 0; round < 3; round++) {
      for (const [index, entry] of sealed.entries()) expect(cipher.open(`key-${index % 300}-${index}`, entry)).toEqual(responses[index])
    }
    // Under one storage key, a newer entry replaces the older one it is compared with.
    const a = cipher.seal('shared', responses[0]!)
    const b = cipher.seal('shared', responses[3]!)
    expect(cipher.open('shared', a)).toEqual(responses[0])
    expect(cipher.open('shared', b)).toEqual(responses[3])
    expect(cipher.open('shared', a)).toEqual(responses[0])
  })

  it('refuses them without the key that sealed them', () => {
    const [first] = fixture.entries
    const other = new ResponseCipher({ keys: [fixture.keys.key2], keyHashSecret: fixture.keyHashSecret })
    expect(() => other.open(first!.storageKey, stored(first!.sealed))).toThrow(/no longer configured/)
  })

  it('hashes keys and scopes exactly as before', () => {
    for (const [composed, hash] of Object.entries(fixture.hashes)) expect(both.hashKey(composed)).toBe(hash)
  })

  it('hashes as HMAC-SHA256 does, for secrets shorter and longer than its block and keys of any length', () => {
    const texts = ['', 'k', 'scope\nkey', 'a\uD800b', '\uDFFFx\uD800', 'é€😀', 'x'.repeat(2016), 'y'.repeat(2017), 'z\uD800'.repeat(5000)]
    for (const length of [32, 63, 64, 65, 100, 200]) {
      const secret = Buffer.from(Array.from({ length }, (_, index) => (index * 37 + length) & 0xff))
      const cipher = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: secret })
      for (const text of texts) {
        const expected = `\u0000hmac:${createHmac('sha256', secret).update(text, 'utf16le').digest('base64url')}`
        expect(cipher.hashKey(text)).toBe(expected)
        // Twice: the second comes from what was kept.
        expect(cipher.hashKey(text)).toBe(expected)
      }
    }
  })

  it('hashes a key the same the second time, and after thousands of other keys have been hashed', () => {
    const cipher = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret })
    const entries = Object.entries(fixture.hashes)
    for (const [composed, hash] of entries) expect(cipher.hashKey(composed)).toBe(hash)
    // Enough keys to pass the bound on recent hashes kept, twice: answers never come from a stale slot.
    const others = Array.from({ length: 10_000 }, (_, index) => `scope-${index}\nkey-${index}`)
    const first = others.map((composed) => cipher.hashKey(composed))
    expect(new Set(first).size).toBe(others.length)
    for (const [composed, hash] of entries) expect(cipher.hashKey(composed)).toBe(hash)
    expect(others.map((composed) => cipher.hashKey(composed))).toEqual(first)
    const fresh = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret })
    expect(others.slice(0, 50).map((composed) => fresh.hashKey(composed))).toEqual(first.slice(0, 50))
  })

  it('seals in the same layout with algorithm aes-256-gcm: version, key id, IV, tag, then the ciphertext of meta length, meta and body, nothing more', () => {
    const sealer = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret, algorithm: 'aes-256-gcm' })
    const [first] = fixture.entries
    const response = stored(first!.response)
    const sealed = sealer.seal(first!.storageKey, response)
    const old = stored(first!.sealed).body
    expect(sealed.contentType).toBe(SEALED_CONTENT_TYPE)
    expect(sealed.headers).toEqual({})
    expect(sealed.body.length).toBe(old.length)
    expect(sealed.body.subarray(0, 9)).toEqual(old.subarray(0, 9))
    // A fresh IV per entry.
    expect(sealer.seal(first!.storageKey, response).body.subarray(9, 21)).not.toEqual(sealed.body.subarray(9, 21))
    expect(both.open(first!.storageKey, sealed)).toEqual(response)
  })
})

const sodium = loadSodium()
const fixtureV2 = JSON.parse(readFileSync(new URL('./fixtures/sealed-v2.json', import.meta.url), 'utf8')) as Fixture

describe('sodium-native', () => {
  // Installed with the suite (an optional dependency): without it, the tests below would measure
  // node:crypto twice. On CI it must load.
  it.runIf(process.env.CI === 'true' || sodium !== null)('loads, and passes its self-test against node:crypto', () => {
    expect(sodium).not.toBeNull()
  })
})

describe('sealed envelope, version 2 (ChaCha20-Poly1305), with and without sodium-native', () => {
  const implementations = [['sodium-native', sodium], ['node:crypto', null]] as const

  it('opens every entry sealed by the version that introduced it, and refuses it moved or altered', () => {
    for (const [, implementation] of implementations) {
      const cipher = new ResponseCipher({ keys: [fixtureV2.keys.key2, fixtureV2.keys.key1], keyHashSecret: fixtureV2.keyHashSecret }, implementation)
      for (const entry of fixtureV2.entries) {
        const sealed = stored(entry.sealed)
        expect(sealed.body[0]).toBe(2)
        expect(cipher.open(entry.storageKey, sealed)).toEqual(stored(entry.response))
        expect(() => cipher.open(`${entry.storageKey}x`, sealed)).toThrow(/altered, or moved/)
        const altered = Buffer.from(sealed.body)
        altered[25] = altered[25]! ^ 1
        expect(() => cipher.open(entry.storageKey, { ...sealed, body: altered })).toThrow(UnreadableEntryError)
      }
    }
  })

  it('seals with ChaCha20-Poly1305 by default with sodium-native, with AES-256-GCM without it, and each opens what the other sealed', () => {
    const withSodium = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret }, sodium)
    const without = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret }, null)
    const response = stored(fixture.entries[0]!.response)
    const a = withSodium.seal('k', response)
    const b = without.seal('k', response)
    expect(a.body[0]).toBe(sodium === null ? 1 : 2)
    expect(b.body[0]).toBe(1)
    expect(without.open('k', a)).toEqual(response)
    expect(withSodium.open('k', b)).toEqual(response)
    // Pinned, node:crypto alone seals ChaCha20-Poly1305 too, and sodium-native opens it.
    const pinned = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret, algorithm: 'chacha20-poly1305' }, null).seal('k', response)
    expect(pinned.body[0]).toBe(2)
    expect(withSodium.open('k', pinned)).toEqual(response)
    expect(pinned.body.length).toBe(a.body.length)
  })

  it('hashes every key as node:crypto\'s HMAC-SHA256 does, however it computes it', () => {
    const texts = ['', 'k', 'scope\nkey', 'a\uD800b', 'é€😀', 'x'.repeat(2047), 'y'.repeat(2048), 'z'.repeat(2049), 'w\uD800'.repeat(3000)]
    for (const [, implementation] of implementations) {
      for (const length of [32, 64, 65, 200]) {
        const secret = Buffer.from(Array.from({ length }, (_, index) => (index * 31 + length) & 0xff))
        const cipher = new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: secret }, implementation)
        // Twice over: the second round comes from the views and states kept.
        for (let round = 0; round < 2; round++) {
          for (const text of texts) expect(cipher.hashKey(text + String(round))).toBe(`\u0000hmac:${createHmac('sha256', secret).update(text + String(round), 'utf16le').digest('base64url')}`)
        }
      }
    }
  })

  it('refuses an unknown algorithm and an unknown option at start-up', () => {
    expect(() => new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret, algorithm: 'aes-128-gcm' as never })).toThrow(/encryption.algorithm must be one of 'aes-256-gcm', 'chacha20-poly1305'/)
    expect(() => new ResponseCipher({ keys: [fixture.keys.key1], keyHashSecret: fixture.keyHashSecret, algorithim: 'aes-256-gcm' } as never)).toThrow(/unknown option encryption.algorithim/)
  })
})
