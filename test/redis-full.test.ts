/**
 * A Redis full under `noeviction` (the policy docs/stores/redis.md recommends), on a server of the
 * test's own: storing the response fails, and must not end in a second run. The lease has to stay
 * held (renewal writes nothing that needs memory) until the store accepts the response.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Redis } from 'ioredis'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { RedisStorage } from '../lib/redis.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'
import { newKey } from './helpers/app.js'
import { deleteRedisPrefix } from './helpers/services.js'
import { resendWhile } from './helpers/resend.js'

const availability = redisClusterAvailability()

describe.skipIf(!availability.available)(`Redis at its memory limit${availability.reason}`, () => {
  let server: Awaited<ReturnType<typeof startRedisServer>>
  let client: Redis
  let app: FastifyInstance
  let runs = 0

  beforeAll(async () => {
    server = await startRedisServer(['--maxmemory', '4mb', '--maxmemory-policy', 'noeviction', '--save', '', '--appendonly', 'no'])
    client = new Redis({ host: '127.0.0.1', port: server.port, enableAutoPipelining: true, maxRetriesPerRequest: 1 })
    app = Fastify()
    await app.register(idempotency, { storage: new RedisStorage({ client }), lockTimeout: 400 })
    app.setErrorHandler(idempotencyErrorHandler())
    app.post('/charges', { config: { idempotency: true } }, async (_request, reply) => {
      runs++
      reply.code(201)
      // Larger than what is left once Redis is full.
      return { run: runs, receipt: 'r'.repeat(64 * 1024) }
    })
    await app.ready()
  })
  afterAll(async () => {
    await app?.close()
    client?.disconnect()
    await server?.stop()
  })

  /**
   * Fill Redis until a write is refused with OOM, then free chunks until a write the size of a
   * lease is taken again: room for a lease, none for a 64 KiB response. Whether a lease fits right
   * after the first refusal depends on buffers Redis frees when it will (a busy machine's first
   * request got OOM on its lease), so the room is made, and checked.
   */
  async function fill (): Promise<void> {
    const chunk = 'f'.repeat(16 * 1024)
    let filled = 0
    for (; ; filled++) {
      try {
        await client.set(`fill:${filled}`, chunk)
      } catch (error) {
        expect(String(error)).toMatch(/OOM/)
        break
      }
    }
    const lease = 'l'.repeat(256)
    for (let i = filled - 1; i >= 0; i--) {
      await client.del(`fill:${i}`)
      try {
        await client.set('fill:probe', lease, 'PX', 1000)
        await client.del('fill:probe')
        return
      } catch (error) {
        expect(String(error)).toMatch(/OOM/)
      }
    }
  }

  it('keeps the key from a second run while the response cannot be stored, then replays it once Redis takes it', async () => {
    await fill()
    const key = newKey()
    const first = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': key }, payload: { amount: 10 } })
    expect(first.statusCode, first.body).toBe(201)
    // Several leases long: renewal keeps the key held although Redis refuses every write.
    for (let i = 0; i < 4; i++) {
      await new Promise((resolve) => setTimeout(resolve, 400))
      const duplicate = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': key }, payload: { amount: 10 } })
      // 409 in progress; or 503 when Redis, still over its limit, refuses the duplicate's own
      // lease command (SET ... NX is refused with OOM before NX is looked at). Never a second run.
      expect([409, 503], duplicate.body).toContain(duplicate.statusCode)
    }
    expect(runs).toBe(1)
    // Memory is freed: the stored response arrives, and the retry replays it.
    await deleteRedisPrefix(client, 'fill:')
    const retry = await resendWhile([409, 503], () => app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': key }, payload: { amount: 10 } }))
    expect(retry.statusCode).toBe(201)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(retry.body).toBe(first.body)
    expect(runs).toBe(1)
  })
})
