/**
 * RedisStorage on node-redis (`redis` 5 and 6), RESP2 and RESP3, and node-redis 6 with a
 * `keyPrefix`, each through the client suite (test/helpers/redis-client-suite.ts) on the shared
 * Redis.
 */
import { afterAll, describe, expect, it, vi } from 'vitest'
import { Redis } from 'ioredis'
import { createClient } from 'redis'
import { createClient as createClient5 } from 'redis5'
import { RedisStorage, type RedisStorageClient } from '../lib/redis.js'
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

  // node-redis merges each command's own options into the client's with a slow object spread; on
  // node-redis 6 the driver sets them once on a view of the client instead (node-redis.ts).
  it('sends commands with no options of their own on node-redis 6, and with them on node-redis 5, with bulk strings as Buffers on both', async () => {
    for (const version of [6, 5] as const) {
      const client: { destroy: () => void } = version === 6 ? await connected(createClient({ socket })) : await connected(createClient5({ socket }))
      try {
        const storage = new RedisStorage({ client: client as unknown as RedisStorageClient, prefix: `${KEY_PREFIX}options:${version}:` })
        // Where every view of the client finds sendCommand: the class's own (restored below).
        let owner: object = client
        while (!Object.hasOwn(owner, 'sendCommand')) owner = Object.getPrototypeOf(owner) as object
        const send = vi.spyOn(owner as { sendCommand: (...args: unknown[]) => unknown }, 'sendCommand')
        const key = `k-${version}`
        const lease = await storage.begin(key, 'f1', 10_000)
        expect(lease.state).toBe('acquired')
        const options = send.mock.calls.map((call) => call[1])
        expect(options.length).toBeGreaterThan(0)
        for (const sent of options) {
          if (version === 6) expect(sent).toBeUndefined()
          else expect(sent).toMatchObject({ timeout: 0, typeMapping: { 36: Buffer } })
        }
        await storage.complete(key, (lease as { token: string }).token, { statusCode: 201, contentType: null, headers: {}, body: Buffer.from([0, 255, 1]) }, 10_000)
        const again = await storage.begin(key, 'f1', 10_000)
        expect(again.state === 'completed' && [...again.response.body]).toEqual([0, 255, 1])
      } finally {
        vi.restoreAllMocks()
        client.destroy()
      }
    }
  })
})
