/**
 * RedisStorage on one client (a library, a version, a protocol, options), on a real server: the
 * conformance suite (operations and waitFor included), then over real HTTP what a user of the
 * plugin notices that depends on the client: concurrent duplicates run the handler once, a
 * long handler's lease is renewed, a waiting duplicate is woken by the first's end, sealed
 * responses, `inFlight` while a request holds its key, `forget` with recovery points and the redo
 * that follows, and the same operations through the command. Everything the store does by name
 * (SCAN patterns, step records, channels) is exercised, so a client whose options rewrite keys
 * (a `keyPrefix`) is tested by the same suite.
 *
 * Registered by each test file for the clients it owns, on the shared Redis or on the suite's
 * three-node cluster: one describe per client, files run in parallel.
 */
import { randomBytes, randomUUID } from 'node:crypto'
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import type { Cluster, Redis } from 'ioredis'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions } from '../../lib/index.js'
import { runCommand } from '../../lib/cli/run.js'
import { RedisStorage, type RedisStorageClient } from '../../lib/redis.js'
import { storageConformance } from '../../lib/storage/conformance.js'
import { WAITERS_OFFSET, WAITING } from '../../lib/storage/redis/codec.js'
import { Gate } from './gate.js'
import { postWithKey, type HttpAnswer } from './http-client.js'
import { scaled } from './pace.js'

export interface RedisClientCase {
  /** What the describe says of the client: library, version, protocol, options. */
  label: string
  /** A new client, connected (or connecting), with the options under test. */
  connect: () => Promise<RedisStorageClient>
  close: (client: RedisStorageClient) => Promise<void>
  /** The client's keyPrefix, which Redis sees in front of the storage's keys. */
  keyPrefix?: string
}

/** Fails the test after `ms` with `what`, instead of letting it wait out a timeout much longer. */
function within<T> (promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const late = new Promise<never>((_resolve, reject) => { timer = setTimeout(() => reject(new Error(`${what} within ${ms} ms`)), ms) })
  return Promise.race([promise, late]).finally(() => clearTimeout(timer))
}

const ENCRYPTION = { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) }

/**
 * `clientCase`, on the server `reader` reads (an ioredis client of the test's own, without a
 * keyPrefix: what someone looking at Redis sees).
 */
export function redisClientSuite (clientCase: RedisClientCase, reader: () => Redis | Cluster): void {
  describe(`RedisStorage on ${clientCase.label}`, () => {
    const prefix = `test:rc:${process.pid}:${randomUUID()}:`
    const keyPrefix = clientCase.keyPrefix ?? ''
    let client: RedisStorageClient
    let storage: RedisStorage
    let app: FastifyInstance
    let url = ''
    let gate = new Gate()
    const calls = new Map<string, number>()
    const count = (name: string): number => {
      const n = (calls.get(name) ?? 0) + 1
      calls.set(name, n)
      return n
    }
    /** The lease end of every renewal the storage was asked for, by key. */
    const renewals: string[] = []

    beforeAll(async () => {
      client = await clientCase.connect()
      storage = new RedisStorage({ client, prefix })
      const renew = storage.renew.bind(storage)
      storage.renew = async (key, token, lockTimeout) => {
        const renewed = await renew(key, token, lockTimeout)
        if (renewed) renewals.push(key)
        return renewed
      }
      app = await serve({ storage })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })

    afterAll(async () => {
      await app?.close()
      if (client !== undefined) await clientCase.close(client)
      await deleteUnder(reader(), keyPrefix + prefix)
    })

    /**
     * The app: `/gated` holds its handler until the test opens the gate; `/checkout` takes two
     * recovery points. A duplicate waits for as long as the first may hold its lease
     * (storeTimeout bounds each wait too): only the lease's end, published to the channel the
     * duplicate listens on, answers it sooner.
     */
    async function serve (options: IdempotencyOptions, waiting = true): Promise<FastifyInstance> {
      const server = Fastify()
      await server.register(idempotency, { ...(waiting ? { wait: true, waitTimeout: '60s' } : {}), lockTimeout: '60s', storeTimeout: '60s', ...options })
      server.setErrorHandler(idempotencyErrorHandler())
      server.post('/gated', { config: { idempotency: true } }, async (_request, reply) => {
        await gate.hold()
        reply.code(201)
        return { run: count('gated') }
      })
      server.post('/checkout', { config: { idempotency: true } }, async (request, reply) => {
        const charge = await request.idempotency!.step('charge', () => ({ charge: count('charge') }))
        const order = await request.idempotency!.step('order', () => ({ order: count('order') }))
        reply.code(201)
        return { ...charge, ...order }
      })
      return server
    }

    const post = (path: string, key: string, base = url): Promise<HttpAnswer> => postWithKey(`${base}${path}`, key, { amount: 1 })

    /** Resolves once a request waits for `key`'s lease: its mark is on the lease (codec.ts). */
    async function marked (key: string, on: RedisStorage = storage): Promise<void> {
      await vi.waitFor(async () => {
        const value = await reader().getBuffer(keyPrefix + on.redisKey(key))
        expect(value?.toString('latin1', WAITERS_OFFSET, WAITERS_OFFSET + 1)).toBe(WAITING)
      }, { timeout: 10_000, interval: 5 })
    }

    /** The command, in this process, on a configuration that makes its own client with the same options. */
    async function command (...args: string[]): Promise<{ code: number, stdout: string }> {
      const dir = resolve(import.meta.dirname, '../../.tmp', `redis-client-${process.pid}-${randomUUID()}`)
      mkdirSync(dir, { recursive: true })
      const own = await clientCase.connect()
      const slot = `redisClient${randomUUID().replaceAll('-', '')}`
      ;(globalThis as Record<string, unknown>)[slot] = new RedisStorage({ client: own, prefix })
      writeFileSync(join(dir, 'config.mjs'), `export default { storage: globalThis.${slot} }\n`)
      let stdout = ''
      try {
        const code = await runCommand([...args, '--json', '-c', 'config.mjs'], { stdout: (text) => { stdout += text }, stderr: () => {}, cwd: dir, env: {} })
        return { code, stdout }
      } finally {
        Reflect.deleteProperty(globalThis, slot)
        await clientCase.close(own)
        rmSync(dir, { recursive: true, force: true })
      }
    }

    it('passes the start-up check (ready)', async () => {
      await storage.ready()
    })

    storageConformance(clientCase.label, () => storage, { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })

    describe('over HTTP', () => {
      it('runs the handler once for ten concurrent requests with one key', async () => {
        gate = new Gate()
        const key = `race-${randomUUID()}`
        const before = calls.get('gated') ?? 0
        const first = post('/gated', key)
        await gate.entered
        // In wait mode the others wait for the first; all get its response.
        const others = Array.from({ length: 9 }, () => post('/gated', key))
        await marked(key)
        gate.open()
        const answers = await Promise.all([first, ...others])
        expect(calls.get('gated')).toBe(before + 1)
        expect(answers.map((answer) => answer.status)).toEqual(Array(10).fill(201))
        expect(new Set(answers.map((answer) => answer.body)).size).toBe(1)
        expect(answers.filter((answer) => answer.replayed)).toHaveLength(9)
      })

      it('renews the lease of a handler that runs longer than lockTimeout, and a duplicate is refused meanwhile', async () => {
        // Renewed every lockTimeout / 8: 400 ms, scaled by the machine's pace so that the lease
        // outlives the event loop's stalls on a loaded machine.
        const lockTimeout = scaled(400)
        const short = await serve({ storage, lockTimeout }, false)
        const base = await short.listen({ host: '127.0.0.1', port: 0 })
        try {
          gate = new Gate()
          const key = `renew-${randomUUID()}`
          const first = post('/gated', key, base)
          await gate.entered
          // Nine renewals, one every lockTimeout / 8: the lease has outlived its first lockTimeout.
          await vi.waitFor(() => { expect(renewals.filter((renewed) => renewed === key).length).toBeGreaterThanOrEqual(9) }, { timeout: scaled(20_000), interval: 20 })
          const duplicate = await post('/gated', key, base)
          expect(duplicate.status).toBe(409)
          expect(JSON.parse(duplicate.body).type).toMatch(/#request-in-progress$/)
          gate.open()
          expect((await first).status).toBe(201)
          expect((await post('/gated', key, base)).replayed).toBe(true)
        } finally {
          await short.close()
        }
      })

      it('seals what it stores with encryption, and replays it', async () => {
        const sealed = await serve({ storage, encryption: ENCRYPTION })
        const base = await sealed.listen({ host: '127.0.0.1', port: 0 })
        try {
          const key = `sealed-${randomUUID()}`
          const first = await post('/checkout', key, base)
          expect(first.status).toBe(201)
          const replay = await post('/checkout', key, base)
          expect(replay.replayed).toBe(true)
          expect(replay.body).toBe(first.body)
          const found = await sealed.idempotency.inspect(key)
          expect(found.state).toBe('stored')
          // Neither the key nor the body is readable in Redis.
          const names = await namesUnder(reader(), keyPrefix + prefix)
          expect(names.some((name) => name.includes(key))).toBe(false)
          expect(await sealed.idempotency.forget(key)).toMatchObject({ outcome: 'forgotten', recoveryPoints: 2 })
        } finally {
          await sealed.close()
        }
      })

      it('lists a request that holds its key in inFlight()', async () => {
        gate = new Gate()
        const key = `held-${randomUUID()}`
        const first = post('/gated', key)
        await gate.entered
        try {
          const listing = await app.idempotency.inFlight()
          expect(listing.leases.map((lease) => lease.key)).toContain(key)
          expect(listing.complete).toBe(true)
        } finally {
          gate.open()
        }
        expect((await first).status).toBe(201)
        expect((await app.idempotency.inFlight()).leases.map((lease) => lease.key)).not.toContain(key)
      })

      it('forgets a key with its recovery points, so that its redo runs every step again', async () => {
        const key = `redo-${randomUUID()}`
        const done = await post('/checkout', key)
        expect(done.status).toBe(201)
        const ran = { charge: calls.get('charge')!, order: calls.get('order')! }
        expect(await app.idempotency.forget(key)).toMatchObject({ outcome: 'forgotten', previous: 'stored', recoveryPoints: 2 })
        const redo = await post('/checkout', key)
        expect(redo.status).toBe(201)
        expect(redo.replayed).toBe(false)
        expect(JSON.parse(redo.body)).toEqual({ charge: ran.charge + 1, order: ran.order + 1 })
      })

      it('lists and forgets through the command as the app does', async () => {
        gate = new Gate()
        const held = `cli-held-${randomUUID()}`
        const first = post('/gated', held)
        await gate.entered
        try {
          const listing = await command('in-flight')
          expect(listing.code, listing.stdout).toBe(0)
          expect((JSON.parse(listing.stdout) as { leases: Array<{ key: string }> }).leases.map((lease) => lease.key)).toContain(held)
        } finally {
          gate.open()
        }
        expect((await first).status).toBe(201)
        const key = `cli-redo-${randomUUID()}`
        expect((await post('/checkout', key)).status).toBe(201)
        const forgotten = await command('forget', key)
        expect(forgotten.code, forgotten.stdout).toBe(0)
        expect(JSON.parse(forgotten.stdout)).toMatchObject({ outcome: 'forgotten', previous: 'stored', recoveryPoints: 2 })
        expect((await post('/checkout', key)).replayed).toBe(false)
      })

      it('wakes a duplicate that waits for the first request as soon as the first ends', async () => {
        gate = new Gate()
        const key = `wait-${randomUUID()}`
        const first = post('/gated', key)
        await gate.entered
        const duplicate = post('/gated', key)
        // The duplicate waits once it has marked the lease: from then on, the lease's end is published.
        await marked(key)
        gate.open()
        const answer = await first
        // Not woken, it would wait out the lease (60 s): far longer than a wake-up takes.
        const replay = await within(duplicate, 15_000, 'the waiting duplicate was not woken')
        expect(replay.status).toBe(201)
        expect(replay.replayed).toBe(true)
        expect(replay.body).toBe(answer.body)
      })
    })
  })
}

/** Every key whose name starts with `start`, on every master `client` reaches. */
async function namesUnder (client: Redis | Cluster, start: string): Promise<string[]> {
  const servers = typeof (client as Cluster).nodes === 'function' ? (client as Cluster).nodes('master') : [client as Redis]
  const names: string[] = []
  for (const server of servers) {
    let cursor = '0'
    do {
      const [next, keys] = await server.scan(cursor, 'MATCH', start.replace(/[\\*?[\]]/g, '\\$&') + '*', 'COUNT', 1000)
      cursor = next
      names.push(...keys)
    } while (cursor !== '0')
  }
  return names
}

async function deleteUnder (client: Redis | Cluster, start: string): Promise<void> {
  for (const name of await namesUnder(client, start)) await client.del(name)
}
