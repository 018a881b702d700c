/**
 * `fastify-idempotency/redis`: RedisStorage, on a client of ioredis, iovalkey, node-redis or Valkey GLIDE.
 *
 * @module fastify-idempotency/redis
 */
export { RedisStorage, type RedisStorageClient, type RedisStorageOptions } from './storage/redis/index.js'
