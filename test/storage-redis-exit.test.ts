/**
 * Wait mode on RedisStorage opens a subscriber connection (a duplicate of the client) on the first
 * wait. Once the app is closed (or, outside the plugin, once the client is quit), nothing of it
 * may hold the process open: each program below waits, closes, and must end by itself. The same
 * with a Cluster is in storage-redis-cluster.test.ts.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { Redis } from 'ioredis'
import { REDIS, deleteRedisPrefix, service } from './helpers/services.js'
import { runWaitExit } from './helpers/redis-wait-exit.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'

const redis = await service(REDIS)
const PREFIX = `test:redis-exit:${process.pid}:${Date.now()}:`
const CLIENTS: Record<string, string> = {
  'fastify-redis': '@fastify/redis\'s client',
  'own-client': 'an ioredis client the app quits in onClose',
  'node-redis': 'a node-redis client the app closes in onClose',
  glide: 'a Valkey GLIDE client the app closes in onClose (its subscriber lasts only while someone waits)'
}

describe.skipIf(!redis.available)('a process that used RedisStorage\'s wait mode ends by itself once closed' + redis.reason, () => {
  afterAll(async () => {
    const client = new Redis({ host: REDIS.host, port: REDIS.port })
    await deleteRedisPrefix(client, PREFIX)
    await client.quit()
  })

  for (const mode of ['fastify-redis', 'own-client', 'node-redis', 'glide', 'outside']) {
    it(mode === 'outside' ? 'the store used without the plugin, its client quit' : `the plugin, on ${CLIENTS[mode]}`, async () => {
      const run = await runWaitExit({ MODE: mode, REDIS_HOST: REDIS.host, REDIS_PORT: String(REDIS.port), PREFIX: `${PREFIX}${mode}:` })
      if (mode !== 'outside') expect(run.stdout, run.stderr).toContain('REPLAYED true')
      expect(run.exitedByItself, `${run.stdout}${run.stderr}`).toBe(true)
      expect(run.code).toBe(0)
    })
  }
})

const own = redisClusterAvailability()

describe.skipIf(!own.available)('on a Redis of the test\'s own' + own.reason, () => {
  it('the plugin on Valkey GLIDE, as a Redis user that may not SUBSCRIBE (GLIDE retries a refused subscription for ever): the app starts, the duplicate polls, and the process ends', async () => {
    const server = await startRedisServer([])
    const admin = new Redis({ port: server.port })
    try {
      await admin.call('ACL', 'SETUSER', 'app', 'on', '>secret', '~*', '&*', '+@all', '-subscribe')
      const run = await runWaitExit({ MODE: 'glide-no-subscribe', REDIS_HOST: '127.0.0.1', REDIS_PORT: String(server.port), REDIS_USER: 'app', REDIS_PASSWORD: 'secret', PREFIX: `${PREFIX}glide-no-subscribe:` }, 10_000, 40_000)
      expect(run.stdout, run.stderr).toContain('REPLAYED true')
      expect(run.exitedByItself, `${run.stdout}${run.stderr}`).toBe(true)
      expect(run.code).toBe(0)
    } finally {
      await admin.quit()
      await server.stop()
    }
  })
})
