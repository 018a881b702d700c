/**
 * RedisStorage on the ioredis family beside the ioredis 6 (RESP3, its default) of the other Redis
 * tests: ioredis 6 on RESP2, ioredis 5, and iovalkey, each through the client suite
 * (test/helpers/redis-client-suite.ts) on the shared Redis.
 */
import { afterAll, describe } from 'vitest'
import { Redis } from 'ioredis'
import { Redis as Redis5 } from 'ioredis5'
import { Redis as Valkey } from 'iovalkey'
import type { RedisStorageClient } from '../lib/redis.js'
import { REDIS, service } from './helpers/services.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'

const redis = await service(REDIS)
const options = { host: REDIS.host, port: REDIS.port, maxRetriesPerRequest: 1 }
const quit = async (client: RedisStorageClient): Promise<void> => { await (client as Redis).quit() }

describe.skipIf(!redis.available)('RedisStorage on the ioredis family' + redis.reason, () => {
  const reader = new Redis(options)
  afterAll(async () => { await reader.quit() })

  redisClientSuite({ label: 'ioredis 6, RESP2', connect: async () => new Redis({ ...options, protocol: 2 }), close: quit }, () => reader)
  redisClientSuite({ label: 'ioredis 5 (RESP2)', connect: async () => new Redis5(options) as unknown as Redis, close: quit }, () => reader)
  redisClientSuite({ label: 'iovalkey (RESP2)', connect: async () => new Valkey(options) as unknown as Redis, close: quit }, () => reader)
})
