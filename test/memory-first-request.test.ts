/**
 * What the memory store's first-request path keeps while it is made cheaper: fencing tokens say
 * the time they were issued however issue times alternate (the start of a token is reused within
 * a millisecond), and a stored response is the one given, bodyOmitted included, in an exact-size
 * copy the caller can no longer change.
 */
import Fastify from 'fastify'
import { describe, expect, it } from 'vitest'
import { idempotency } from '../lib/index.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import { TOKEN_LENGTH, TokenGenerator, tokenIssuedAt } from '../lib/storage/tokens.js'
import { SYNCHRONOUS_STEPS, type StoredResponse } from '../lib/storage/types.js'

describe('fencing tokens issued in the same and in other milliseconds', () => {
  it('each says its own issue time, and none repeats', () => {
    const tokens = new TokenGenerator()
    const times = [1_750_000_000_000, 1_750_000_000_000, 1_750_000_000_001, 1_750_000_000_000, 1_750_000_000_001.5, 1_750_000_123_456]
    const issued = times.map((time) => tokens.next(time))
    expect(new Set(issued).size).toBe(issued.length)
    expect(issued.map((token) => token.length)).toEqual(times.map(() => TOKEN_LENGTH))
    expect(issued.map(tokenIssuedAt)).toEqual(times.map(Math.floor))
  })
})

describe('MemoryStorage.complete', () => {
  async function storeAndRead (response: StoredResponse): Promise<StoredResponse> {
    const storage = new MemoryStorage()
    const begun = await storage.begin('k', 'fp', 60_000)
    if (begun.state !== 'acquired') throw new Error('expected a lease')
    expect(await storage.complete('k', begun.token, response, 60_000)).toBe(true)
    const found = await storage.begin('k', 'fp', 60_000)
    if (found.state !== 'completed') throw new Error('expected the stored response')
    return found.response
  }

  it('keeps the response as given, bodyOmitted present only when it was', async () => {
    const base = { statusCode: 201, contentType: 'application/json', headers: { etag: '"1"', 'set-cookie': ['a=1', 'b=2'] }, body: Buffer.from('{"id":1}') }
    expect(await storeAndRead(base)).toStrictEqual(base)
    const omitted = { ...base, body: Buffer.alloc(0), bodyOmitted: true }
    expect(await storeAndRead(omitted)).toStrictEqual(omitted)
    const notOmitted = { ...base, bodyOmitted: false }
    expect(await storeAndRead(notOmitted)).toStrictEqual(notOmitted)
  })

  it('keeps its own copy of the body: changing the caller\'s buffer afterwards changes nothing stored', async () => {
    const body = Buffer.alloc(16 * 1024, 1)
    const response = await storeAndRead({ statusCode: 200, contentType: null, headers: {}, body })
    body.fill(2)
    expect(response.body.equals(Buffer.alloc(16 * 1024, 1))).toBe(true)
  })
})

describe('a response kept by the plugin on MemoryStorage', () => {
  async function replayedAfter (send: (body: Buffer) => unknown, change: (body: Buffer) => void): Promise<{ first: string, replay: string }> {
    const app = Fastify()
    const storage = new MemoryStorage()
    await app.register(idempotency, { storage })
    // A Buffer of its own memory, as a handler's module-level Buffer may be (not a pool slice).
    const body = Buffer.allocUnsafeSlow(14)
    body.write('{"id":"first"}')
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => reply.code(201).type('application/json').send(send(body)))
    await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      const url = `http://127.0.0.1:${(app.server.address() as { port: number }).port}/orders`
      const post = async () => await (await fetch(url, { method: 'POST', headers: { 'idempotency-key': 'k1', 'content-type': 'application/json' }, body: '{}' })).text()
      const first = await post()
      change(body)
      return { first, replay: await post() }
    } finally {
      await app.close()
    }
  }

  it('is the handler\'s Buffer as it was sent, whatever the handler does with that Buffer afterwards', async () => {
    const { first, replay } = await replayedAfter((body) => body, (body) => body.write('{"id":"later"}'))
    expect(first).toBe('{"id":"first"}')
    expect(replay).toBe('{"id":"first"}')
  })

  it('is a text payload\'s bytes', async () => {
    const { first, replay } = await replayedAfter((body) => body.toString(), () => {})
    expect(replay).toBe(first)
    expect(replay).toBe('{"id":"first"}')
  })
})

describe('a text payload on MemoryStorage, kept as the string it was sent as', () => {
  const LIMIT = 16
  async function server (storage: MemoryStorage, options: Record<string, unknown> = {}) {
    const app = Fastify()
    await app.register(idempotency, { storage, maxResponseBytes: LIMIT, unstorableResponse: 'release' as const, ...options })
    app.post('/text', { config: { idempotency: true } }, async (request, reply) => reply.code(201).type('text/plain; charset=utf-8').send((request.body as { text: string }).text))
    await app.listen({ port: 0, host: '127.0.0.1' })
    const url = `http://127.0.0.1:${(app.server.address() as { port: number }).port}/text`
    const post = async (key: string, text: string) => {
      const response = await fetch(url, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: JSON.stringify({ text }) })
      return { status: response.status, replayed: response.headers.get('idempotent-replayed'), bytes: Buffer.from(await response.arrayBuffer()) }
    }
    return { app, post }
  }

  it('goes to the store as the string, and replays byte for byte, characters of every width and lone surrogates included', async () => {
    const storage = new MemoryStorage()
    const steps = storage[SYNCHRONOUS_STEPS]
    const texts: unknown[] = []
    const complete = steps.complete
    steps.complete = (key, token, response, expiration, text) => {
      texts.push(text)
      return complete(key, token, response, expiration, text)
    }
    const { app, post } = await server(storage, { maxResponseBytes: 1024 })
    try {
      for (const [index, text] of ['plain', 'é ü ß', '中文', '😀 ok', 'lone \ud800 x', ''].entries()) {
        const first = await post(`k${index}`, text)
        const replay = await post(`k${index}`, text)
        expect(first.status).toBe(201)
        expect([replay.status, replay.replayed]).toEqual([201, 'true'])
        expect(replay.bytes.equals(first.bytes)).toBe(true)
        expect(first.bytes.equals(Buffer.from(text))).toBe(true)
      }
      expect(texts).toEqual(['plain', 'é ü ß', '中文', '😀 ok', 'lone \ud800 x', ''])
      // An operator's look at an entry sees its bytes.
      const found = await storage.inspect('k2')
      expect(found.state === 'completed' && found.response.body.toString()).toBe('中文')
    } finally {
      await app.close()
    }
  })

  it('counts against maxResponseBytes by its UTF-8 bytes, not its length', async () => {
    const storage = new MemoryStorage()
    const { app, post } = await server(storage)
    try {
      // 16 bytes: kept. 6 characters but 18 bytes, and 16 characters but 17 bytes: not kept.
      const cases: Array<[string, boolean]> = [['a'.repeat(16), true], ['中'.repeat(6), false], ['a'.repeat(15) + 'é', false], ['中'.repeat(5) + 'a', true]]
      for (const [index, [text, kept]] of cases.entries()) {
        expect(Buffer.byteLength(text) <= LIMIT).toBe(kept)
        await post(`m${index}`, text)
        expect((await post(`m${index}`, text)).replayed).toBe(kept ? 'true' : null)
      }
    } finally {
      await app.close()
    }
  })

  it('is counted in calculatedSize by its length, as a body of bytes is by its bytes', async () => {
    const viaText = new MemoryStorage()
    const viaBytes = new MemoryStorage()
    const { app, post } = await server(viaText, { maxResponseBytes: 1024 })
    try {
      await post('same-key', 'abcdefgh')
      const begun = await viaBytes.begin('same-key', (await viaText.inspect('same-key') as { fingerprint: string }).fingerprint, 60_000)
      if (begun.state !== 'acquired') throw new Error('expected a lease')
      const found = await viaText.inspect('same-key')
      if (found.state !== 'completed') throw new Error('expected the stored response')
      await viaBytes.complete('same-key', begun.token, { ...found.response, body: Buffer.from('abcdefgh') }, 60_000)
      expect(viaText.calculatedSize).toBe(viaBytes.calculatedSize)
    } finally {
      await app.close()
    }
  })
})
