/**
 * RedisStorage on ioredis clients whose options rewrite keys (`keyPrefix`, as a string or a
 * Buffer), on the shared Redis: the client suite (conformance, and over HTTP what the store does
 * by name: SCAN patterns, step records, channels). The same on a Cluster is in
 * storage-redis-cluster.test.ts.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { Redis } from 'ioredis'
import { RedisStorage } from '../lib/redis.js'
import { REDIS, service } from './helpers/services.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'

const redis = await service(REDIS)
const KEY_PREFIX = `test:redis-names:${process.pid}:${Date.now()}:`

describe.skipIf(!redis.available)('RedisStorage on a client with a keyPrefix' + redis.reason, () => {
  const reader = new Redis({ host: REDIS.host, port: REDIS.port })
  afterAll(async () => { await reader.quit() })
  const options = { host: REDIS.host, port: REDIS.port, maxRetriesPerRequest: 1 }

  redisClientSuite({
    label: 'ioredis with a keyPrefix',
    connect: async () => new Redis({ ...options, keyPrefix: KEY_PREFIX }),
    close: async (client) => { await (client as Redis).quit() },
    keyPrefix: KEY_PREFIX
  }, () => reader)
  redisClientSuite({
    label: 'ioredis with a keyPrefix given as a Buffer',
    connect: async () => new Redis({ ...options, keyPrefix: Buffer.from(KEY_PREFIX + 'buffer:') as unknown as string }),
    close: async (client) => { await (client as Redis).quit() },
    keyPrefix: KEY_PREFIX + 'buffer:'
  }, () => reader)

  it('refuses a keyPrefix given as a Buffer that is not text', () => {
    const binary = new Redis({ lazyConnect: true, keyPrefix: Buffer.from([0xff, 0xfe]) as unknown as string })
    expect(() => new RedisStorage({ client: binary })).toThrow(/keyPrefix.*UTF-8/)
  })
})
