/**
 * RedisStorage on the cluster clients beside ioredis's Cluster (storage-redis-cluster.test.ts):
 * node-redis 6 and 5 (`createCluster`), iovalkey's Cluster and Valkey GLIDE's
 * `GlideClusterClient`, each through the client suite (test/helpers/redis-client-suite.ts) on a
 * three-node cluster of this file's own.
 */
import { afterAll, beforeAll, describe } from 'vitest'
import { Cluster } from 'ioredis'
import { Cluster as ValkeyCluster } from 'iovalkey'
import { createCluster } from 'redis'
import { createCluster as createCluster5 } from 'redis5'
import { GlideClusterClient, ProtocolVersion } from '@valkey/valkey-glide'
import type { RedisStorageClient } from '../lib/redis.js'
import { redisClusterAvailability, startRedisCluster, type RedisClusterHandle } from './helpers/redis-cluster.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'
import { scaled } from './helpers/pace.js'

const availability = redisClusterAvailability()

describe.skipIf(!availability.available)('RedisStorage on cluster clients' + availability.reason, () => {
  let cluster: RedisClusterHandle | undefined
  let reader: Cluster | undefined
  beforeAll(async () => {
    cluster = await startRedisCluster()
    reader = new Cluster(cluster.nodes)
  }, scaled(60_000))
  afterAll(async () => {
    try {
      await reader?.quit()
    } finally {
      await cluster?.stop()
    }
  }, scaled(30_000))

  const nodeRedis = async <T extends { connect: () => Promise<unknown>, on: (event: 'error', listener: () => void) => unknown }>(client: T): Promise<RedisStorageClient> => {
    client.on('error', () => {})
    await client.connect()
    return client as unknown as RedisStorageClient
  }
  const rootNodes = (): Array<{ socket: { host: string, port: number } }> => cluster!.nodes.map((node) => ({ socket: node }))
  const destroy = async (client: RedisStorageClient): Promise<void> => { await (client as unknown as { destroy: () => Promise<void> | void }).destroy() }

  redisClientSuite({ label: 'node-redis 6 cluster, RESP3', connect: () => nodeRedis(createCluster({ rootNodes: rootNodes(), RESP: 3 })), close: destroy }, () => reader!)
  redisClientSuite({ label: 'node-redis 5 cluster, RESP2', connect: () => nodeRedis(createCluster5({ rootNodes: rootNodes() })), close: destroy }, () => reader!)
  redisClientSuite({
    label: 'iovalkey Cluster',
    connect: async () => new ValkeyCluster(cluster!.nodes, { redisOptions: { maxRetriesPerRequest: 1 } }) as unknown as RedisStorageClient,
    close: async (client) => { await (client as unknown as ValkeyCluster).quit() }
  }, () => reader!)
  redisClientSuite({
    label: 'Valkey GLIDE 2 cluster, RESP3',
    connect: async () => await GlideClusterClient.createClient({ addresses: cluster!.nodes, protocol: ProtocolVersion.RESP3 }) as unknown as RedisStorageClient,
    close: async (client) => { (client as unknown as GlideClusterClient).close() }
  }, () => reader!)
})
