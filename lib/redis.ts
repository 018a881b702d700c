/** `fastify-idempotency/redis`: RedisStorage, on an ioredis Redis or Cluster client. */
export { RedisStorage, type RedisStorageOptions } from './storage/redis/index.js'
