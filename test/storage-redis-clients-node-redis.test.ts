/**
 * RedisStorage on node-redis (`redis` 5 and 6), RESP2 and RESP3, and node-redis 6 with a
 * `keyPrefix`, each through the client suite (test/helpers/redis-client-suite.ts) on the shared
 * Redis.
 */
import { afterAll, describe } from 'vitest'
import { Redis } from 'ioredis'
import { createClient } from 'redis'
import { createClient as createClient5 } from 'redis5'
import type { RedisStorageClient } from '../lib/redis.js'
import { REDIS, service } from './helpers/services.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'

const redis = await service(REDIS)
const socket = { host: REDIS.host, port: REDIS.port }
const KEY_PREFIX = `test:node-redis:${process.pid}:${Date.now()}:`

async function connected<T extends { connect: () => Promise<unknown>, on: (event: 'error', listener: () => void) => unknown }> (client: T): Promise<T> {
  client.on('error', () => {})
  await client.connect()
  return client
}
const destroy = async (client: RedisStorageClient): Promise<void> => { (client as { destroy: () => void }).destroy() }

describe.skipIf(!redis.available)('RedisStorage on node-redis' + redis.reason, () => {
  const reader = new Redis(socket)
  afterAll(async () => { await reader.quit() })

  for (const RESP of [2, 3] as const) {
    redisClientSuite({ label: `node-redis 6, RESP${RESP}`, connect: async () => await connected(createClient({ socket, RESP })) as unknown as RedisStorageClient, close: destroy }, () => reader)
    redisClientSuite({ label: `node-redis 5, RESP${RESP}`, connect: async () => await connected(createClient5({ socket, RESP })) as unknown as RedisStorageClient, close: destroy }, () => reader)
  }
  redisClientSuite({
    label: 'node-redis 6 with a keyPrefix',
    connect: async () => await connected(createClient({ socket, keyPrefix: KEY_PREFIX })) as unknown as RedisStorageClient,
    close: destroy,
    keyPrefix: KEY_PREFIX
  }, () => reader)
})
