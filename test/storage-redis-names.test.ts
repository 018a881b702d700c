/**
 * RedisStorage on a client whose options rewrite keys (ioredis `keyPrefix`), on the shared Redis:
 * the conformance suite (operations and waitFor included), and over HTTP what the store does by
 * name. The same on a Cluster is in storage-redis-cluster.test.ts.
 */
import { afterAll, beforeEach, describe, expect, it } from 'vitest'
import { Redis } from 'ioredis'
import { storageConformance } from '../lib/storage/conformance.js'
import { RedisStorage } from '../lib/redis.js'
import { REDIS, deleteRedisPrefix, service } from './helpers/services.js'
import { redisNameScenarios } from './helpers/redis-names.js'
import { WAITERS_OFFSET, WAITING } from '../lib/storage/redis/codec.js'

const redis = await service(REDIS)
const KEY_PREFIX = `test:redis-names:${process.pid}:${Date.now()}:`

describe.skipIf(!redis.available)('RedisStorage on a client with a keyPrefix' + redis.reason, () => {
  const connect = (): Redis => new Redis({ host: REDIS.host, port: REDIS.port, maxRetriesPerRequest: 1, keyPrefix: KEY_PREFIX })
  const client = connect()
  afterAll(async () => {
    const plain = new Redis({ host: REDIS.host, port: REDIS.port })
    await deleteRedisPrefix(plain, KEY_PREFIX)
    await plain.quit()
    await client.quit()
  })

  storageConformance('redis, keyPrefix', () => new RedisStorage({ client, prefix: 'conformance:' }), { describe, it, beforeEach, afterAll }, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })
  redisNameScenarios({ label: 'a Redis client with a keyPrefix', connect })

  it('takes a keyPrefix given as a Buffer as its UTF-8 text, and refuses one that is not text', async () => {
    const buffered = new Redis({ host: REDIS.host, port: REDIS.port, keyPrefix: Buffer.from(KEY_PREFIX + 'buffer:') as unknown as string })
    try {
      const storage = new RedisStorage({ client: buffered, prefix: 'p:' })
      const lease = await storage.begin('held', 'fp', 30_000)
      expect(lease.state).toBe('acquired')
      expect((await storage.listInFlight({ limit: 10 })).leases.map((held) => held.key)).toEqual(['held'])
      const waiting = storage.waitFor('held', 60_000)
      await expect.poll(async () => (await client.get('buffer:' + storage.redisKey('held')))?.[WAITERS_OFFSET]).toBe(WAITING)
      expect(await storage.release('held', lease.state === 'acquired' ? lease.token : '')).toBe(true)
      await waiting
      await storage.close()
      const binary = new Redis({ lazyConnect: true, keyPrefix: Buffer.from([0xff, 0xfe]) as unknown as string })
      expect(() => new RedisStorage({ client: binary })).toThrow(/keyPrefix.*UTF-8/)
    } finally {
      await buffered.quit()
    }
  })
})
