/**
 * RedisStorage on Valkey GLIDE 2 (`@valkey/valkey-glide`, a Rust core in a native package),
 * RESP2 and RESP3, each through the client suite (test/helpers/redis-client-suite.ts) on the
 * shared Redis.
 */
import { afterAll, describe } from 'vitest'
import { Redis } from 'ioredis'
import { GlideClient, ProtocolVersion } from '@valkey/valkey-glide'
import type { RedisStorageClient } from '../lib/redis.js'
import { REDIS, service } from './helpers/services.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'

const redis = await service(REDIS)

describe.skipIf(!redis.available)('RedisStorage on Valkey GLIDE' + redis.reason, () => {
  const reader = new Redis({ host: REDIS.host, port: REDIS.port })
  afterAll(async () => { await reader.quit() })

  for (const [label, protocol] of [['RESP2', ProtocolVersion.RESP2], ['RESP3', ProtocolVersion.RESP3]] as const) {
    redisClientSuite({
      label: `Valkey GLIDE 2, ${label}`,
      connect: async () => await GlideClient.createClient({ addresses: [{ host: REDIS.host, port: REDIS.port }], protocol }) as unknown as RedisStorageClient,
      close: async (client) => { (client as unknown as GlideClient).close() }
    }, () => reader)
  }
})
