/**
 * Encryption at rest, over real HTTP on every store: what the store holds says nothing about the
 * responses, the keys or who asked; replays stay byte-identical; keys rotate; an entry that cannot
 * be opened (altered, sealed with a removed key) is refused, never replayed; two principals never
 * see each other's responses. Plus redaction, and the warning for credentials without a scope.
 */
import { randomBytes } from 'node:crypto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, scopeByHeader, type IdempotencyOptions, type IdempotencyStorage, type StoredResponse } from '../lib/index.js'
import { ResponseCipher } from '../lib/encryption.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

const KEY_1 = randomBytes(32)
const KEY_2 = randomBytes(32).toString('base64')
const HASH_SECRET = randomBytes(32)

/** Distinctive strings that must never appear in a store dump. */
const SECRET = {
  key: 'key-Zq7SECRETKEY',
  tokenA: 'tok_alice_Wv3SECRETTOKEN',
  tokenB: 'tok_bob_Hk9SECRETTOKEN',
  clientSecret: 'pi_3Ks_secret_Pq8CLIENTSECRET',
  url: 'https://pay.example/one-time/Jx2ONETIMEURL',
  marker: 'X-Charge-Marker-Yy5HEADERVALUE'
}

/** Every store, and what the plugin handed it: for the in-process store, that is what it holds. */
function recording (storage: IdempotencyStorage, seen: string[]): IdempotencyStorage {
  const record = (...values: unknown[]): void => { seen.push(JSON.stringify(values, (_k, v: unknown) => (v as { type?: string })?.type === 'Buffer' ? Buffer.from((v as { data: number[] }).data).toString('latin1') : v)) }
  return {
    begin: async (key, fingerprint, lockTimeout) => { record(key, fingerprint); return await storage.begin(key, fingerprint, lockTimeout) },
    complete: async (key, token, response, expiration) => { record(key, token, response); return await storage.complete(key, token, response, expiration) },
    release: async (key, token) => await storage.release(key, token),
    renew: async (key, token, lockTimeout) => await storage.renew(key, token, lockTimeout)
  }
}

/** A store read by someone who flipped one byte of each stored body. */
function tampering (storage: IdempotencyStorage): IdempotencyStorage {
  return {
    begin: async (key, fingerprint, lockTimeout) => {
      const result = await storage.begin(key, fingerprint, lockTimeout)
      if (result.state !== 'completed') return result
      const body = Buffer.from(result.response.body)
      body[body.length - 1]! ^= 1
      return { ...result, response: { ...result.response, body } }
    },
    complete: async (...args) => await storage.complete(...args),
    release: async (key, token) => await storage.release(key, token),
    renew: async (key, token, lockTimeout) => await storage.renew(key, token, lockTimeout)
  }
}

/** A store whose read bodies have one byte flipped while `altering.on`. */
function switchable (storage: IdempotencyStorage, altering: { on: boolean }): IdempotencyStorage {
  const altered = tampering(storage)
  return {
    begin: async (key, fingerprint, lockTimeout) => await (altering.on ? altered : storage).begin(key, fingerprint, lockTimeout),
    complete: async (...args) => await storage.complete(...args),
    release: async (key, token) => await storage.release(key, token),
    renew: async (key, token, lockTimeout) => await storage.renew(key, token, lockTimeout),
    forget: async (key, options) => await storage.forget!(key, options)
  }
}

interface Exchange { status: number, headers: Headers, body: string }

for (const store of cases) {
  describe.skipIf(!store.available)(`encryption at rest on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    const seen: string[] = []
    const apps: FastifyInstance[] = []
    let runs = 0

    async function start (options: IdempotencyOptions, backing: IdempotencyStorage = recording(storage, seen)): Promise<string> {
      const app = Fastify()
      await app.register(idempotency, { storage: backing, scope: scopeByHeader('authorization'), ...options })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/payments', { config: { idempotency: true } }, async (request, reply) => {
        runs++
        reply.code(201).header('x-charge-marker', SECRET.marker).header('location', SECRET.url)
        return { clientSecret: SECRET.clientSecret, for: request.headers.authorization === `Bearer ${SECRET.tokenA}` ? 'alice' : 'bob', run: runs }
      })
      apps.push(app)
      return `${await app.listen({ host: '127.0.0.1', port: 0 })}/payments`
    }

    async function post (url: string, token: string, key = SECRET.key): Promise<Exchange> {
      const res = await fetch(url, { method: 'POST', headers: { 'idempotency-key': key, authorization: `Bearer ${token}`, 'content-type': 'application/json' }, body: JSON.stringify({ amount: 4200, card: SECRET.clientSecret }) })
      return { status: res.status, headers: res.headers, body: await res.text() }
    }

    const encryption = { keys: [KEY_1], keyHashSecret: HASH_SECRET }

    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => {
      for (const app of apps) await app.close()
      await store.cleanup()
    })

    it('keeps nothing readable in the store, and replays byte for byte', async () => {
      const url = await start({ encryption })
      const first = await post(url, SECRET.tokenA)
      expect(first.status).toBe(201)
      const replay = await post(url, SECRET.tokenA)
      expect(replay.status).toBe(201)
      expect(replay.body).toBe(first.body)
      expect(replay.headers.get('idempotent-replayed')).toBe('true')
      for (const name of ['x-charge-marker', 'location', 'content-type']) expect(replay.headers.get(name)).toBe(first.headers.get(name))
      expect(runs).toBe(1)

      const scope = scopeByHeader('authorization')({ headers: { authorization: `Bearer ${SECRET.tokenA}` } } as never)
      const held = [seen.join('\n'), store.dump === undefined ? '' : await store.dump()].join('\n')
      expect(held).toContain('hmac:')
      for (const secret of [...Object.values(SECRET), scope, 'application/json', 'alice']) expect(held).not.toContain(secret)
    })

    it('keeps two principals apart: neither gets the other\'s response', async () => {
      const url = await start({ encryption })
      const before = runs
      const alice = await post(url, SECRET.tokenA, 'shared-key')
      const bob = await post(url, SECRET.tokenB, 'shared-key')
      expect(JSON.parse(alice.body).for).toBe('alice')
      expect(JSON.parse(bob.body).for).toBe('bob')
      expect(runs).toBe(before + 2)
      expect(JSON.parse((await post(url, SECRET.tokenB, 'shared-key')).body)).toEqual(JSON.parse(bob.body))
      expect(JSON.parse((await post(url, SECRET.tokenA, 'shared-key')).body)).toEqual(JSON.parse(alice.body))
    })

    it('rotates: an entry sealed with an old key replays once a new key is put first', async () => {
      const key = `rotate-${store.name}`
      const before = runs
      const first = await post(await start({ encryption }), SECRET.tokenA, key)
      const rotated = await post(await start({ encryption: { keys: [KEY_2, KEY_1], keyHashSecret: HASH_SECRET } }), SECRET.tokenA, key)
      expect(rotated.status).toBe(201)
      expect(rotated.body).toBe(first.body)
      expect(runs).toBe(before + 1)
    })

    it('replays what either cipher sealed: AES-256-GCM entries (every earlier version\'s) after an upgrade, ChaCha20-Poly1305 entries on an app pinned to GCM', async () => {
      for (const [first, second] of [['aes-256-gcm', 'chacha20-poly1305'], ['chacha20-poly1305', 'aes-256-gcm']] as const) {
        const key = `cipher-${first}-${store.name}`
        const before = runs
        const original = await post(await start({ encryption: { ...encryption, algorithm: first } }), SECRET.tokenA, key)
        const replayed = await post(await start({ encryption: { ...encryption, algorithm: second } }), SECRET.tokenA, key)
        expect(original.status).toBe(201)
        expect(replayed.status).toBe(201)
        expect(replayed.headers.get('idempotent-replayed')).toBe('true')
        expect(replayed.body).toBe(original.body)
        expect(runs).toBe(before + 1)
      }
    })

    it('seals a body sent as a string as its UTF-8 bytes: replayed byte for byte, and kept without it once those bytes pass maxResponseBytes', async () => {
      const text = 'é€😀 naïve '.repeat(20)
      const bytes = Buffer.byteLength(text)
      for (const [limit, omitted] of [[bytes, false], [bytes - 1, true]] as const) {
        const app = Fastify()
        await app.register(idempotency, { storage, encryption, maxResponseBytes: limit })
        let runs = 0
        app.post('/text', { config: { idempotency: true } }, async (_request, reply) => { runs++; reply.type('text/plain; charset=utf-8'); return text })
        apps.push(app)
        const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/text`
        const key = `text-${limit}-${store.name}`
        const send = async (): Promise<Response> => await fetch(url, { method: 'POST', headers: { 'idempotency-key': key } })
        const first = await send()
        const firstBody = Buffer.from(await first.arrayBuffer())
        const replay = await send()
        const replayBody = Buffer.from(await replay.arrayBuffer())
        expect(firstBody.toString()).toBe(text)
        expect(replay.headers.get('idempotent-replayed')).toBe('true')
        expect(runs).toBe(1)
        if (omitted) {
          expect(replay.headers.get('idempotent-body-omitted')).toBe('true')
          expect(replayBody.length).toBe(0)
        } else {
          expect(replayBody.equals(firstBody)).toBe(true)
          expect(replay.headers.get('content-type')).toBe('text/plain; charset=utf-8')
        }
      }
    })

    it('refuses an entry sealed with a key no longer configured (409, not retried), and never runs the handler again', async () => {
      const key = `removed-${store.name}`
      const before = runs
      await post(await start({ encryption }), SECRET.tokenA, key)
      const refused = await post(await start({ encryption: { keys: [KEY_2], keyHashSecret: HASH_SECRET } }), SECRET.tokenA, key)
      expect(refused.status).toBe(409)
      expect(refused.headers.get('content-type')).toMatch(/^application\/problem\+json/)
      expect(JSON.parse(refused.body).type).toMatch(/#stored-response-unreadable$/)
      expect(refused.headers.get('stripe-should-retry')).toBe('false')
      expect(refused.body).not.toContain(SECRET.clientSecret)
      expect(runs).toBe(before + 1)
    })

    it('never replays an altered entry', async () => {
      const key = `tampered-${store.name}`
      const before = runs
      await post(await start({ encryption }), SECRET.tokenA, key)
      const refused = await post(await start({ encryption }, tampering(storage)), SECRET.tokenA, key)
      expect(refused.status).toBe(409)
      expect(JSON.parse(refused.body).type).toMatch(/#stored-response-unreadable$/)
      expect(runs).toBe(before + 1)
    })

    it('in one process, replays an entry opened before, yet refuses it once altered and replays its successor once replaced', async () => {
      // The same app throughout, so the same cipher: it keeps the entries it opened (encryption.ts).
      const key = `reopened-${store.name}`
      const altering = { on: false }
      const url = await start({ encryption }, switchable(storage, altering))
      const before = runs
      const first = await post(url, SECRET.tokenA, key)
      for (let replay = 0; replay < 3; replay++) expect(await post(url, SECRET.tokenA, key)).toMatchObject({ status: 201, body: first.body })
      altering.on = true
      const refused = await post(url, SECRET.tokenA, key)
      expect(refused.status).toBe(409)
      expect(JSON.parse(refused.body).type).toMatch(/#stored-response-unreadable$/)
      altering.on = false
      expect(await post(url, SECRET.tokenA, key)).toMatchObject({ status: 201, body: first.body })
      // Forgotten, run again: the new entry is the one replayed, not what was opened before.
      const app = apps.at(-1)!
      expect(await app.idempotency.forget(key, { scope: scopeByHeader('authorization')({ headers: { authorization: `Bearer ${SECRET.tokenA}` } } as never) as string })).toMatchObject({ previous: 'stored' })
      const second = await post(url, SECRET.tokenA, key)
      expect(second.headers.get('idempotent-replayed')).toBeNull()
      expect(JSON.parse(second.body).run).toBe(before + 2)
      expect(await post(url, SECRET.tokenA, key)).toMatchObject({ status: 201, body: second.body })
      expect(runs).toBe(before + 2)
    })

    it('stores what redact returns, while the first client gets the response in full', async () => {
      const url = await start({
        encryption,
        redact: (response: StoredResponse) => {
          const { location: _location, ...headers } = response.headers
          const body = JSON.parse(response.body.toString()) as Record<string, unknown>
          return { ...response, headers, body: Buffer.from(JSON.stringify({ ...body, clientSecret: '[redacted]' })) }
        }
      })
      const first = await post(url, SECRET.tokenA, `redact-${store.name}`)
      expect(JSON.parse(first.body).clientSecret).toBe(SECRET.clientSecret)
      expect(first.headers.get('location')).toBe(SECRET.url)
      const replay = await post(url, SECRET.tokenA, `redact-${store.name}`)
      expect(replay.status).toBe(201)
      expect(JSON.parse(replay.body).clientSecret).toBe('[redacted]')
      expect(replay.headers.get('location')).toBeNull()
      expect(replay.headers.get('x-charge-marker')).toBe(SECRET.marker)
    })

    it('keeps only the outcome when redact says so, or throws', async () => {
      const before = runs
      const omit = await start({ redact: (response: StoredResponse) => ({ ...response, bodyOmitted: true }) })
      await post(omit, SECRET.tokenA, `omit-${store.name}`)
      const replay = await post(omit, SECRET.tokenA, `omit-${store.name}`)
      expect(replay.status).toBe(201)
      expect(replay.body).toBe('')
      expect(replay.headers.get('idempotent-body-omitted')).toBe('true')
      const throwing = await start({ redact: () => { throw new Error('redaction bug') } })
      await post(throwing, SECRET.tokenA, `throws-${store.name}`)
      const statusOnly = await post(throwing, SECRET.tokenA, `throws-${store.name}`)
      expect(statusOnly.status).toBe(201)
      expect(statusOnly.body).toBe('')
      expect(statusOnly.headers.get('location')).toBeNull()
      expect(runs).toBe(before + 2)
    })

    it('keeps only the status when redact never settles: the client gets its answer once storeTimeout has passed', async () => {
      const before = runs
      const hung = await start({ storeTimeout: 200, redact: async () => await new Promise<StoredResponse>(() => {}) })
      const first = await post(hung, SECRET.tokenA, `hung-${store.name}`)
      expect(first.status).toBe(201)
      expect(JSON.parse(first.body).clientSecret).toBe(SECRET.clientSecret)
      const statusOnly = await post(hung, SECRET.tokenA, `hung-${store.name}`)
      expect([statusOnly.status, statusOnly.body, statusOnly.headers.get('idempotent-replayed')]).toEqual([201, '', 'true'])
      expect(runs).toBe(before + 1)
    })
  })
}

describe('ResponseCipher', () => {
  const cipher = new ResponseCipher({ keys: [KEY_1], keyHashSecret: HASH_SECRET })
  const response: StoredResponse = { statusCode: 201, contentType: 'application/json', headers: { a: 'b' }, body: Buffer.from('{"x":1}') }

  it('binds an entry to its storage key and its status', () => {
    const sealed = cipher.seal('k1', response)
    expect(cipher.open('k1', sealed)).toEqual(response)
    expect(() => cipher.open('k2', sealed)).toThrow(/altered, or moved/)
    expect(() => cipher.open('k1', { ...sealed, statusCode: 200 })).toThrow(/altered, or moved/)
    expect(() => cipher.open('k1', response)).toThrow(/not sealed/)
  })

  it('keeps an omitted body apart from an empty one', () => {
    const omitted = { ...response, body: Buffer.alloc(0), bodyOmitted: true }
    expect(cipher.open('k', cipher.seal('k', omitted))).toEqual(omitted)
    expect(cipher.open('k', cipher.seal('k', { ...response, body: Buffer.alloc(0) })).bodyOmitted).toBeUndefined()
  })

  it('opens every response to exactly what was sealed, whatever came before it: content types, headers or none, an omitted body, storage keys long and short', () => {
    const fresh = new ResponseCipher({ keys: [KEY_1], keyHashSecret: HASH_SECRET })
    const longKey = 'k'.repeat(3000)
    const responses: StoredResponse[] = [
      { statusCode: 201, contentType: 'application/json', headers: {}, body: Buffer.from('{"a":1}') },
      { statusCode: 201, contentType: 'text/plain', headers: {}, body: Buffer.from('plain') },
      { statusCode: 200, contentType: null, headers: {}, body: Buffer.from([0, 1, 2]) },
      { statusCode: 201, contentType: 'application/json', headers: { location: '/x' }, body: Buffer.from('{"b":2}') },
      { statusCode: 202, contentType: 'application/json', headers: {}, body: Buffer.alloc(0), bodyOmitted: true },
      { statusCode: 201, contentType: 'application/json', headers: Object.create({ inherited: 'not kept' }) as Record<string, string>, body: Buffer.from('{"c":3}') }
    ]
    const sealed = responses.flatMap((response, index) => [[`key-${index}`, response, fresh.seal(`key-${index}`, response)], [longKey + index, response, fresh.seal(longKey + index, response)]] as const)
    const other = new ResponseCipher({ keys: [KEY_1], keyHashSecret: HASH_SECRET })
    for (const [key, response, envelope] of sealed) {
      const opened = other.open(key, envelope)
      expect({ ...opened, headers: { ...opened.headers } }).toEqual({ ...response, headers: { ...response.headers } })
      expect(() => other.open(key === longKey + '0' ? longKey + '1' : longKey + '0', envelope)).toThrow(/altered, or moved/)
    }
  })

  it('refuses keys that are not 32 bytes, and a short hash secret, at start-up', async () => {
    expect(() => new ResponseCipher({ keys: [randomBytes(16)], keyHashSecret: HASH_SECRET })).toThrow(/keys\[0\] must be 32 bytes/)
    expect(() => new ResponseCipher({ keys: [], keyHashSecret: HASH_SECRET })).toThrow(/non-empty array/)
    expect(() => new ResponseCipher({ keys: [KEY_1], keyHashSecret: 'c2hvcnQ=' })).toThrow(/at least 32 bytes/)
    await expect(Fastify().register(idempotency, { encryption: { keys: ['short'], keyHashSecret: HASH_SECRET } }).ready()).rejects.toThrow(/encryption.keys\[0\]/)
    expect(() => new ResponseCipher(null as never)).toThrow(/must be an object/)
    expect(() => new ResponseCipher({ keys: [42 as never], keyHashSecret: HASH_SECRET })).toThrow(/Buffer or a base64 string/)
  })

  it('refuses an envelope cut short or of an unknown version', () => {
    const sealed = cipher.seal('k', response)
    expect(() => cipher.open('k', { ...sealed, body: sealed.body.subarray(0, 10) })).toThrow(/known version/)
    const other = Buffer.from(sealed.body)
    other[0] = 9
    expect(() => cipher.open('k', { ...sealed, body: other })).toThrow(/known version/)
  })
})

describe('credentials without a scope', () => {
  it('warns once per route, naming the fix', async () => {
    const lines: string[] = []
    const app = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { lines.push(line) } } } })
    await app.register(idempotency)
    app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
    app.post('/scoped', { config: { idempotency: { scope: scopeByHeader('authorization') } } }, async () => ({ ok: true }))
    for (const [url, key] of [['/orders', 'a'], ['/orders', 'b'], ['/scoped', 'c']] as const) {
      await app.inject({ method: 'POST', url, headers: { 'idempotency-key': key, authorization: 'Bearer x' }, payload: {} })
    }
    await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'd' }, payload: {} })
    const warnings = lines.filter((line) => line.includes('has no scope'))
    expect(warnings).toHaveLength(1)
    expect(warnings[0]).toContain('/orders')
    expect(warnings[0]).toContain('scope: (request) => request.user?.id')
    await app.close()
  })
})
