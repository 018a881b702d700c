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
import type { StoredResponse } from '../lib/storage/types.js'

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

  it('is a text payload\'s bytes, kept without a second copy', async () => {
    const { first, replay } = await replayedAfter((body) => body.toString(), () => {})
    expect(replay).toBe(first)
    expect(replay).toBe('{"id":"first"}')
  })
})
