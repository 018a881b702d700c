import { describe, it, beforeEach, afterAll, expect } from 'vitest'
import Fastify from 'fastify'
import { readFileSync } from 'node:fs'
import { request } from 'node:http'
import { storageConformance } from '../lib/storage/conformance.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import idempotency from '../lib/index.js'

storageConformance('memory', () => new MemoryStorage(), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })

describe('the conformance suite, for a store that offers fewer optional methods', () => {
  /** The titles the suite registers, run or skipped, without running any. */
  const registered = (options: Parameters<typeof storageConformance>[3]) => {
    const run: string[] = []
    const skipped: string[] = []
    const it = Object.assign((name: string) => { run.push(name) }, { skip: (name: string) => { skipped.push(name) } })
    storageConformance('recorded', () => new MemoryStorage(), { describe: (_name, fn) => fn(), it, beforeEach: () => {}, afterAll: () => {} }, options)
    return { run, skipped }
  }

  it('reports the tests of waitFor and of the operations methods it does not say it offers as skipped, with the reason', () => {
    const { run, skipped } = registered({})
    expect(skipped.filter((name) => name.startsWith('waitFor: '))).toHaveLength(2)
    expect(skipped.every((name) => /\[skipped: the store does not offer (waitFor|inspect|forget|listInFlight)/.test(name))).toBe(true)
    expect(run.some((name) => /waitFor|inspect|forget|listInFlight/.test(name))).toBe(false)
    const all = registered({ operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })
    expect(all.skipped).toEqual([])
    expect(all.run).toHaveLength(run.length + skipped.length)
  })

  it('registers as many tests, run and skipped, as docs/stores/custom.md shows a store without optional methods', () => {
    const { run, skipped } = registered({})
    const page = readFileSync(new URL('../docs/stores/custom.md', import.meta.url), 'utf8')
    const shown = /map-storage\.test\.ts \((\d+) tests \| (\d+) skipped\)/.exec(page)
    expect(shown, 'the summary line of the MapStorage run').not.toBeNull()
    expect([Number(shown![1]), Number(shown![2])]).toEqual([run.length + skipped.length, skipped.length])
    const words = ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten', 'eleven', 'twelve', 'thirteen', 'fourteen', 'fifteen']
    expect(page).toContain(`The ${words[skipped.length]} skipped are`)
  })

  it('gives a store too slow for a short lease a longer one in the renew test, instead of failing it', async () => {
    // A loaded machine (CI runs every suite at once) can take longer than the short lease between
    // begin and renew: the test must widen the lease, not blame the store.
    let renewTest: (() => void | Promise<void>) | undefined
    const it = Object.assign((name: string, fn: () => void | Promise<void>) => { if (name.startsWith('extends a lease on renew')) renewTest = fn }, { skip: () => {} })
    const slow = new MemoryStorage()
    const begin = slow.begin.bind(slow)
    const leases: number[] = []
    slow.begin = async (key, fingerprint, lease) => {
      leases.push(lease)
      if (lease < 100) await new Promise((resolve) => setTimeout(resolve, 50))
      return begin(key, fingerprint, lease)
    }
    const setUp: Array<() => unknown> = []
    storageConformance('slow', () => slow, { describe: (_name, fn) => fn(), it, beforeEach: (fn) => { setUp.push(fn) }, afterAll: () => {} }, { shortTtl: 20 })
    for (const fn of setUp) await fn()
    await renewTest!()
    expect(leases.filter((lease) => lease < 30_000)).toEqual([20, 40, 80])
  })
})

const response = (bytes: number) => ({ statusCode: 201, contentType: 'application/json', headers: {}, body: Buffer.alloc(bytes, 1) })

/** A response of `bytes` stored under `key`, as a request that ran stores it. */
async function storeResponse (storage: MemoryStorage, key: string, bytes: number, expiration = 60_000): Promise<void> {
  const begun = await storage.begin(key, 'fp', 60_000)
  if (begun.state !== 'acquired') throw new Error('expected a lease')
  await storage.complete(key, begun.token, response(bytes), expiration)
}

describe('MemoryStorage bounds', () => {
  it('keeps at most maxEntries stored responses under 100 000 unique keys, evicting the least recently used', async () => {
    const storage = new MemoryStorage({ maxEntries: 1000 })
    for (let i = 0; i < 100_000; i++) {
      await storeResponse(storage, `k${i}`, 10)
      if (i === 50_000) expect((await storage.begin('k49500', 'fp', 1)).state).toBe('completed')
    }
    expect(storage.size).toBeLessThanOrEqual(1000)
    expect(storage.leases).toBe(0)
    expect((await storage.begin('k99999', 'fp', 1)).state).toBe('completed')
    expect((await storage.begin('k0', 'fp', 60_000)).state).toBe('acquired')
  })

  it('keeps at most maxBytes of stored responses', async () => {
    const storage = new MemoryStorage({ maxBytes: 100_000 })
    for (let i = 0; i < 1000; i++) await storeResponse(storage, `k${i}`, 1000)
    expect(storage.calculatedSize).toBeLessThanOrEqual(100_000)
    expect(storage.size).toBeGreaterThan(50)
  })

  it('never evicts a lease: a request in flight keeps its key under memory pressure', async () => {
    const storage = new MemoryStorage({ maxEntries: 10 })
    const held = await storage.begin('held', 'fp', 60_000)
    expect(held.state).toBe('acquired')
    for (let i = 0; i < 1000; i++) {
      const begun = await storage.begin(`k${i}`, 'fp', 60_000)
      if (begun.state === 'acquired') await storage.complete(`k${i}`, begun.token, response(10), 60_000)
    }
    expect((await storage.begin('held', 'fp', 60_000)).state).toBe('in-flight')
  })

  it('drops expired entries by the injected clock', async () => {
    let now = 1_000_000
    const storage = new MemoryStorage({ now: () => now })
    await storeResponse(storage, 'k', 1, 1000)
    now += 999
    expect((await storage.begin('k', 'fp', 60_000)).state).toBe('completed')
    now += 1
    expect((await storage.begin('k', 'fp', 60_000)).state).toBe('acquired')
  })

  it('drops expired entries as new ones are written, without waiting for a read or for LRU pressure', async () => {
    let now = 1_000_000
    const storage = new MemoryStorage({ now: () => now })
    const store = (key: string, expiration: number) => storeResponse(storage, key, 1, expiration)
    for (let i = 0; i < 10; i++) await store(`old${i}`, 1000)
    now += 2000
    for (let i = 0; i < 10; i++) await store(`new${i}`, 60_000)
    expect(storage.size).toBe(10)
  })

  it('keeps an exact-size copy of each body, not a slice of a shared buffer pool', async () => {
    const storage = new MemoryStorage()
    const pooled = Buffer.from('{"id":1}')
    expect(pooled.buffer.byteLength).toBeGreaterThan(pooled.length)
    const begun = await storage.begin('k', 'fp', 60_000)
    if (begun.state !== 'acquired') throw new Error('expected a lease')
    await storage.complete('k', begun.token, { ...response(0), body: pooled }, 60_000)
    const stored = await storage.begin('k', 'fp', 60_000)
    expect(stored.state === 'completed' && stored.response.body.buffer.byteLength).toBe(pooled.length)
  })

  it('refuses nonsensical bounds', () => {
    expect(() => new MemoryStorage({ maxEntries: 0 })).toThrow(/maxEntries/)
    expect(() => new MemoryStorage({ maxBytes: 1.5 })).toThrow(/maxBytes/)
  })

  it('leaves no handle open after fastify.close()', async () => {
    const count = () => process.getActiveResourcesInfo().filter((r) => r !== 'Timeout').length
    const before = count()
    const app = Fastify()
    await app.register(idempotency)
    app.post('/o', { config: { idempotency: true } }, async () => ({ ok: true }))
    await app.listen({ host: '127.0.0.1', port: 0 })
    const port = (app.server.address() as { port: number }).port
    for (let i = 0; i < 20; i++) {
      // agent: false, so the client side keeps no socket open either.
      await new Promise<void>((resolve, reject) => {
        const req = request({ host: '127.0.0.1', port, method: 'POST', path: '/o', agent: false, headers: { 'idempotency-key': `k${i % 10}`, 'content-type': 'application/json' } }, (res) => { res.resume(); res.socket.once('close', () => resolve()) })
        req.on('error', reject)
        req.end('{}')
      })
    }
    await app.close()
    // The server's handle is freed on the tick after close() resolves.
    await new Promise((resolve) => setTimeout(resolve, 10))
    const timers = process.getActiveResourcesInfo().filter((r) => r === 'Timeout')
    expect(count(), JSON.stringify(process.getActiveResourcesInfo())).toBeLessThanOrEqual(before)
    // Renewal timers are cleared when a request settles, and all are unref'd anyway.
    expect(timers.length).toBeLessThanOrEqual(2)
  })
})
