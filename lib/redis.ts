/**
 * `fastify-idempotency/redis`: RedisStorage, on an ioredis Redis or Cluster client.
 *
 * @module fastify-idempotency/redis
 */
export { RedisStorage, type RedisStorageOptions } from './storage/redis/index.js'
