/**
 * RedisStorage's start-up check (`ready()`, called by the plugin when the app starts): a server it
 * can work with passes; one that refuses its scripts (an ACL), a server that cannot be reached, and
 * one that refuses `SET … NX GET` (older than Redis 7.0: shown with a client that answers as such a
 * server does) fail `app.ready()` with one line that says why.
 */
import { createServer } from 'node:net'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Redis, ReplyError } from 'ioredis'
import type { IdempotencyStorage } from '../lib/index.js'
import { RedisStorage } from '../lib/redis.js'
import { REDIS, service } from './helpers/services.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'
import { scaled } from './helpers/pace.js'
import { startError as startWith } from './helpers/start-error.js'

const redis = await service(REDIS)
const own = redisClusterAvailability()
const PREFIX = `test:redis-ready:${process.pid}:${Date.now()}:`

const startError = async (storage: IdempotencyStorage): Promise<string | null> => await startWith(storage, { storeTimeout: '10s' })

/** A client that answers every command with `error`, as a server that refuses it does (the Cluster path: the client's methods). */
function refusing (error: Error): RedisStorage {
  const fail = async (): Promise<never> => { throw error }
  return new RedisStorage({ client: { defineCommand () {}, evalsha: fail, isCluster: true, status: 'ready', options: {}, setBuffer: fail, delBuffer: fail, evalBuffer: fail, evalshaBuffer: fail, call: fail } as never, prefix: PREFIX })
}

describe.skipIf(!redis.available)('RedisStorage at start-up' + redis.reason, () => {
  const clients: Redis[] = []
  afterAll(async () => { await Promise.all(clients.map((client) => client.quit().catch(() => {}))) })

  it('lets an app on a Redis it can work with start', async () => {
    const client = new Redis({ host: REDIS.host, port: REDIS.port })
    clients.push(client)
    expect(await startError(new RedisStorage({ client, prefix: PREFIX }))).toBeNull()
    // The probe is gone as soon as the check ends: a user's Redis (or a dump of it) does not show it.
    expect(await client.keys(`${PREFIX}*`)).toEqual([])
  })

  it('fails the start when Redis cannot be reached, saying why', async () => {
    const closed = createServer()
    await new Promise<void>((resolve) => closed.listen(0, '127.0.0.1', resolve))
    const { port } = closed.address() as { port: number }
    await new Promise<void>((resolve) => closed.close(() => resolve()))
    const client = new Redis({ host: '127.0.0.1', port, maxRetriesPerRequest: 1, retryStrategy: () => null })
    client.on('error', () => {})
    expect(await startError(new RedisStorage({ client, prefix: PREFIX }))).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: Redis cannot be reached through the ioredis client: /)
  })

  it('fails the start on a server older than Redis 7.0 (SET with NX and GET together), or one that refuses a command', async () => {
    expect(await startError(refusing(new ReplyError('ERR syntax error')))).toMatch(/RedisStorage: the server refuses SET with NX and GET together: ERR syntax error: use Redis 7\.0 or later, or Valkey/)
    expect(await startError(refusing(new ReplyError("ERR unknown command 'set'")))).toMatch(/RedisStorage: the server refuses SET … PX … NX GET: ERR unknown command 'set'/)
  })

  describe.skipIf(!own.available)('on a Redis of its own whose user may not run scripts' + own.reason, () => {
    let server: Awaited<ReturnType<typeof startRedisServer>> | undefined
    beforeAll(async () => {
      server = await startRedisServer(['--save', '', '--appendonly', 'no'])
      const admin = new Redis({ port: server.port })
      await admin.call('ACL', 'SETUSER', 'default', '-eval', '-evalsha')
      await admin.quit()
    }, scaled(60_000))
    afterAll(async () => { await server?.stop() })

    it('fails the start, naming the ACL', async () => {
      const client = new Redis({ port: server!.port, maxRetriesPerRequest: 1 })
      clients.push(client)
      expect(await startError(new RedisStorage({ client, prefix: PREFIX }))).toMatch(/RedisStorage: EVAL of the renew script was refused: NOPERM /)
    })
  })
})
