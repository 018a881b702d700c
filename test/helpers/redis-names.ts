/**
 * What RedisStorage does by name rather than through a command's key argument (the SCAN of
 * `inFlight`, the step records `forget` finds, the channel a waiting duplicate listens on), over
 * real HTTP, on a client whose options rewrite keys (ioredis `keyPrefix`, on a Redis or a
 * Cluster), and the same operations through the `fastify-idempotency` command, whose
 * configuration makes a client of its own with the same options. Registered by the test file that
 * owns the server: the shared Redis, or the suite's three-node cluster.
 */
import { randomUUID } from 'node:crypto'
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import type { Cluster, Redis } from 'ioredis'
import idempotency, { idempotencyErrorHandler } from '../../lib/index.js'
import { runCommand } from '../../lib/cli/run.js'
import { RedisStorage } from '../../lib/redis.js'
import { WAITERS_OFFSET, WAITING } from '../../lib/storage/redis/codec.js'
import { Gate } from './gate.js'
import { postWithKey, type HttpAnswer } from './http-client.js'

export interface NamedClient {
  /** What the describe says of the client. */
  label: string
  /** A new client, its key-rewriting options set; the scenarios close it. */
  connect: () => Redis | Cluster
}

/** Fails the test after `ms` with `what`, instead of letting it wait out a timeout much longer. */
function within<T> (promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const late = new Promise<never>((_resolve, reject) => { timer = setTimeout(() => reject(new Error(`${what} within ${ms} ms`)), ms) })
  return Promise.race([promise, late]).finally(() => clearTimeout(timer))
}

export function redisNameScenarios (client: NamedClient): void {
  describe(`names RedisStorage builds, over HTTP, on ${client.label}`, () => {
    let redis: Redis | Cluster
    let storage: RedisStorage
    let app: FastifyInstance
    let url = ''
    let gate = new Gate()
    const prefix = `test:redis-names:${process.pid}:${randomUUID()}:`
    const calls = new Map<string, number>()
    const count = (name: string): number => {
      const n = (calls.get(name) ?? 0) + 1
      calls.set(name, n)
      return n
    }

    beforeAll(async () => {
      redis = client.connect()
      storage = new RedisStorage({ client: redis, prefix })
      app = Fastify()
      // A duplicate waits for as long as the first may hold its lease (storeTimeout bounds each
      // wait too): only the lease's end, published to the channel the duplicate listens on,
      // answers it sooner.
      await app.register(idempotency, { storage, wait: true, waitTimeout: '60s', lockTimeout: '60s', storeTimeout: '60s' })
      app.setErrorHandler(idempotencyErrorHandler())
      app.post('/gated', { config: { idempotency: true } }, async (_request, reply) => {
        await gate.hold()
        reply.code(201)
        return { run: count('gated') }
      })
      app.post('/checkout', { config: { idempotency: true } }, async (request, reply) => {
        const charge = await request.idempotency!.step('charge', () => ({ charge: count('charge') }))
        const order = await request.idempotency!.step('order', () => ({ order: count('order') }))
        reply.code(201)
        return { ...charge, ...order }
      })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })

    afterAll(async () => {
      await app?.close()
      await redis?.quit()
    })

    /** The command, in this process, on a configuration that makes its own client with the same options. */
    async function command (...args: string[]): Promise<{ code: number, stdout: string }> {
      const dir = resolve(import.meta.dirname, '../../.tmp', `redis-names-${process.pid}-${randomUUID()}`)
      mkdirSync(dir, { recursive: true })
      const own = client.connect()
      const slot = `redisNames${randomUUID().replaceAll('-', '')}`
      ;(globalThis as Record<string, unknown>)[slot] = new RedisStorage({ client: own, prefix })
      writeFileSync(join(dir, 'config.mjs'), `export default { storage: globalThis.${slot} }\n`)
      let stdout = ''
      try {
        const code = await runCommand([...args, '--json', '-c', 'config.mjs'], { stdout: (text) => { stdout += text }, stderr: () => {}, cwd: dir, env: {} })
        return { code, stdout }
      } finally {
        Reflect.deleteProperty(globalThis, slot)
        await own.quit()
        rmSync(dir, { recursive: true, force: true })
      }
    }

    const post = (path: string, key: string): Promise<HttpAnswer> => postWithKey(`${url}${path}`, key, { amount: 1 })

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
      const ran = { charge: calls.get('charge'), order: calls.get('order') }
      const forgotten = await app.idempotency.forget(key)
      expect(forgotten).toMatchObject({ outcome: 'forgotten', previous: 'stored', recoveryPoints: 2 })
      const redo = await post('/checkout', key)
      expect(redo.status).toBe(201)
      expect(redo.replayed).toBe(false)
      expect(JSON.parse(redo.body)).toEqual({ charge: ran.charge! + 1, order: ran.order! + 1 })
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
      await vi.waitFor(async () => {
        expect((await redis.getBuffer(storage.redisKey(key)))?.toString('latin1', WAITERS_OFFSET, WAITERS_OFFSET + 1)).toBe(WAITING)
      }, { timeout: 10_000, interval: 5 })
      gate.open()
      const answer = await first
      // Not woken, it would wait out the lease (60 s): far longer than a wake-up takes.
      const replay = await within(duplicate, 15_000, 'the waiting duplicate was not woken')
      expect(replay.status).toBe(201)
      expect(replay.replayed).toBe(true)
      expect(replay.body).toBe(answer.body)
    })
  })
}
