/**
 * `npm run example:redis`: the orders-and-payments app (orders-app.ts) with its idempotency keys
 * in Redis (REDIS_HOST and REDIS_PORT, default 127.0.0.1:6379), through RedisStorage; the orders
 * and payments stay in SQLite. `npm run example:redis -- --self-test` drives it over HTTP and exits.
 */
import { Redis } from 'ioredis'
// In an application of your own: from 'fastify-idempotency/redis'.
import { RedisStorage } from '../lib/redis.js'
import { openDatabase, runExample } from './orders-app.js'

const host = process.env.REDIS_HOST ?? '127.0.0.1'
const port = Number(process.env.REDIS_PORT ?? 6379)

// The client options docs/stores/redis.md recommends: auto-pipelining for throughput, and failing
// fast when Redis is down or hangs, so that a guarded route answers 503 at once instead of waiting.
const redis = new Redis({
  host,
  port,
  enableAutoPipelining: true,
  maxRetriesPerRequest: 1,
  commandTimeout: 2000,
  lazyConnect: true
})

let reachable = true
try {
  await redis.connect()
} catch (error) {
  reachable = false
  console.error(`Redis is not reachable at ${host}:${port} (${(error as Error).message}); start it, or set REDIS_HOST and REDIS_PORT.`)
  redis.disconnect()
  process.exitCode = 1
}

if (reachable) {
  const storage = new RedisStorage({ client: redis })
  const db = openDatabase(process.argv.includes('--self-test'))
  await runExample({
    title: `Orders and payments in SQLite (${db.file}), with the idempotency keys in Redis at ${host}:${port}`,
    db,
    storage,
    forget: async (keys) => { await redis.del(...keys.map((key) => storage.redisKey(key))) },
    // The storage closes only what it opened itself (its wait-mode subscriber); the client is ours.
    close: async () => {
      await storage.close()
      await redis.quit()
    }
  })
}
