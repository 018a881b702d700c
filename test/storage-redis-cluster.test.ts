import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest'
import { Cluster, Redis } from 'ioredis'
import { createCluster } from 'redis'
import type { ClusterOptions } from 'ioredis'
import { storageConformance, HOSTILE_KEYS } from '../lib/storage/conformance.js'
import { RedisStorage } from '../lib/redis.js'
import type { StoredResponse } from '../lib/storage/types.js'
import { redisClusterAvailability, startRedisCluster, type RedisClusterHandle } from './helpers/redis-cluster.js'
import { redisClientSuite } from './helpers/redis-client-suite.js'
import { runWaitExit } from './helpers/redis-wait-exit.js'
import { scaled } from './helpers/pace.js'

const availability = redisClusterAvailability()
const PREFIX = `test:redis-cluster-storage:${process.pid}:${Date.now()}:`
const LEASE = 30_000
const EXPIRY = 60_000

const response: StoredResponse = {
  statusCode: 200,
  contentType: 'text/plain',
  headers: {},
  body: Buffer.from('ok')
}

describe.skipIf(!availability.available)('RedisStorage on a Redis Cluster with a master down' + availability.reason, () => {
  it('fails the start naming the master that is down, whose keys would all answer 503, wherever the probe would land', async () => {
    // Without full coverage the others keep serving their slots: cluster_state stays ok.
    const partial = await startRedisCluster({ settings: ['--cluster-require-full-coverage', 'no', '--cluster-node-timeout', '1000'] })
    const clients: Array<{ quit: () => Promise<unknown> }> = []
    try {
      const [, , down] = partial.nodes
      const admin = new Redis({ host: down!.host, port: down!.port, lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null })
      await admin.call('SHUTDOWN', 'NOSAVE').catch(() => {})
      admin.disconnect()
      const seen = new Redis({ host: partial.nodes[0]!.host, port: partial.nodes[0]!.port })
      clients.push(seen)
      for (const deadline = Date.now() + 10_000; !String(await seen.call('CLUSTER', 'NODES')).includes('fail ') && Date.now() < deadline;) await new Promise((resolve) => setTimeout(resolve, 100))
      type Client = ConstructorParameters<typeof RedisStorage>[0]['client']
      const clientsOf: Array<() => Promise<Client>> = [
        async () => new Cluster(partial.nodes, { redisOptions: { maxRetriesPerRequest: 1, commandTimeout: 500 } }),
        async () => await createCluster({ rootNodes: partial.nodes.map(({ host, port }) => ({ url: `redis://${host}:${port}` })), defaults: { socket: { connectTimeout: 500, reconnectStrategy: false } } }).on('error', () => {}).connect() as unknown as Client
      ]
      for (const make of clientsOf) {
        // The probe's slot is random: three proofs per client, each of which must see the master that is down.
        for (let round = 0; round < 3; round++) {
          const made = await make()
          clients.push({ quit: async () => { if (made instanceof Cluster) made.disconnect(); else await (made as unknown as { close: () => Promise<void> }).close() } })
          const checks = await new RedisStorage({ client: made, prefix: PREFIX + 'down:' }).prove({ wait: false, signal: AbortSignal.timeout(3000) })
          const refused = checks.filter((check) => check.outcome === 'failed')
          expect(refused.map((check) => check.name)).toEqual(['connection'])
          expect(refused[0]!.found).toMatch(new RegExp(`^on ${down!.host}:${down!.port}: Redis cannot be reached through the (ioredis Cluster|node-redis cluster) client: `))
        }
      }
    } finally {
      await Promise.all(clients.map(async (c) => { await c.quit().catch(() => {}) }))
      await partial.stop()
    }
  }, scaled(60_000))
})

describe.skipIf(!availability.available)('RedisStorage on a three-node Redis Cluster' + availability.reason, () => {
  let cluster: RedisClusterHandle | undefined
  const clients: Cluster[] = []
  let client: Cluster
  let pipelined: Cluster

  function newCluster (extra: ClusterOptions = {}): Cluster {
    const created = new Cluster(cluster!.nodes, { redisOptions: { maxRetriesPerRequest: 1 }, ...extra })
    clients.push(created)
    return created
  }

  beforeAll(async () => {
    cluster = await startRedisCluster()
    client = newCluster()
    pipelined = newCluster({ enableAutoPipelining: true })
  }, scaled(60_000))

  afterAll(async () => {
    try {
      await Promise.all(clients.map((c) => c.quit().catch(() => undefined)))
    } finally {
      await cluster?.stop()
    }
  }, scaled(30_000))

  const harness = { describe, it, beforeEach, afterAll }
  storageConformance('redis cluster', () => new RedisStorage({ client, prefix: PREFIX }), harness, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })
  storageConformance('redis cluster with enableAutoPipelining', () => new RedisStorage({ client: pipelined, prefix: PREFIX + 'pipelined:' }), harness, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })
  // A keyPrefix, as a Cluster also takes it from the options of its nodes.
  redisClientSuite({
    label: 'an ioredis Cluster with a keyPrefix in its redisOptions',
    connect: async () => newCluster({ enableAutoPipelining: true, redisOptions: { maxRetriesPerRequest: 1, keyPrefix: PREFIX + 'names:' } }),
    close: async (created) => { await (created as Cluster).quit() },
    keyPrefix: PREFIX + 'names:'
  }, () => client)

  it('lets a process that waited on a Cluster end by itself once its app is closed', async () => {
    const run = await runWaitExit({ MODE: 'cluster', REDIS_CLUSTER_PORTS: cluster!.nodes.map((node) => node.port).join(','), PREFIX: PREFIX + 'exit:' })
    expect(run.stdout, run.stderr).toContain('REPLAYED true')
    expect(run.exitedByItself, `${run.stdout}${run.stderr}`).toBe(true)
    expect(run.code).toBe(0)
  })

  it('proves every master: an ACL that refuses EVALSHA on one node alone fails the proof, naming that node, wherever the probe would land', async () => {
    const user = `proof${process.pid}`
    const [, , odd] = cluster!.nodes
    const acl = async (node: { host: string, port: number }, rules: string[]): Promise<void> => {
      const admin = new Redis({ host: node.host, port: node.port, lazyConnect: true })
      try { await admin.call('ACL', 'SETUSER', user, ...rules) } finally { admin.disconnect() }
    }
    for (const node of cluster!.nodes) await acl(node, ['on', '>pw', '~*', '&*', '+@all', ...(node === odd ? ['-evalsha'] : [])])
    try {
      // The probe's slot is random: four proofs, each of which must see the odd node.
      for (let round = 0; round < 4; round++) {
        const user$ = newCluster({ redisOptions: { maxRetriesPerRequest: 1, username: user, password: 'pw' } })
        const checks = await new RedisStorage({ client: user$, prefix: PREFIX + 'acl:' }).prove({ wait: false })
        const refused = checks.filter((check) => check.outcome === 'failed')
        expect(refused.map((check) => check.name)).toEqual(['renew script', 'complete and release script'])
        expect(refused[0]!.found).toMatch(new RegExp(`^on ${odd!.host}:${odd!.port}: EVALSHA of the renew script was refused: NOPERM`))
        await user$.quit()
      }
      const checks = await new RedisStorage({ client, prefix: PREFIX + 'acl:' }).prove({ wait: true })
      expect(checks.filter((check) => check.outcome === 'failed')).toEqual([])
      expect(checks.find((check) => check.name === 'PUBLISH and SUBSCRIBE')!.outcome).toBe('passed')
      expect(checks.find((check) => check.name === 'renew script')!.found).toBe('ran as EVAL, then as EVALSHA (on each of the 3 masters)')
    } finally {
      for (const node of cluster!.nodes) {
        const admin = new Redis({ host: node.host, port: node.port, lazyConnect: true })
        try { await admin.call('ACL', 'DELUSER', user) } finally { admin.disconnect() }
      }
    }
  })

  it('names the master that may evict keys, when the others do not', async () => {
    const odd = cluster!.nodes[1]!
    const admin = new Redis({ host: odd.host, port: odd.port, lazyConnect: true })
    try {
      await admin.config('SET', 'maxmemory', '100mb')
      await admin.config('SET', 'maxmemory-policy', 'allkeys-lru')
      const checks = await new RedisStorage({ client, prefix: PREFIX + 'evict:' }).prove({ wait: false })
      const eviction = checks.find((check) => check.name === 'eviction policy')!
      expect(eviction.outcome).toBe('failed')
      expect(eviction.found).toContain(`maxmemory-policy allkeys-lru with maxmemory 104857600 bytes on 1 of 3 masters (${odd.host}:${odd.port}): `)
    } finally {
      await admin.config('SET', 'maxmemory', '0')
      await admin.config('SET', 'maxmemory-policy', 'noeviction')
      admin.disconnect()
    }
  })

  it('refuses a Cluster client whose keyPrefix holds a brace, which would put every key in one slot', () => {
    for (const keyPrefix of ['{app}:', 'app{', '}']) {
      const braced = newCluster({ keyPrefix, lazyConnect: true })
      expect(() => new RedisStorage({ client: braced, prefix: PREFIX })).toThrow(/keyPrefix.*one slot/)
    }
  })

  /** A plain connection to one of the nodes, for commands that are about the node itself. */
  async function withNode<T> (fn: (node: Redis) => Promise<T>): Promise<T> {
    const node = new Redis(cluster!.nodes[0]!)
    try {
      return await fn(node)
    } finally {
      await node.quit()
    }
  }

  it('hashes the whole escaped key, and only it, whatever braces the key contains', async () => {
    const a = new RedisStorage({ client, prefix: PREFIX + 'slots-a:' })
    const b = new RedisStorage({ client, prefix: PREFIX + 'slots-b:' })
    const keys = [...HOSTILE_KEYS, '{x}a', '{x}b', 'a}b{c', '}{x', 'tenant:{1}:order-7']
    await withNode(async (node) => {
      const slots = new Set<number>()
      for (const key of keys) {
        const slot = await node.cluster('KEYSLOT', a.redisKey(key)) as number
        // The prefix takes no part in the slot, and the user's braces open no tag of their own.
        expect(await node.cluster('KEYSLOT', b.redisKey(key))).toBe(slot)
        const tag = a.redisKey(key).slice((PREFIX + 'slots-a:{').length, -1)
        expect(await node.cluster('KEYSLOT', tag)).toBe(slot)
        slots.add(slot)
      }
      // Had the user's `{x}` become the tag, these two would share a slot.
      expect(await node.cluster('KEYSLOT', a.redisKey('{x}a'))).not.toBe(await node.cluster('KEYSLOT', a.redisKey('{x}b')))
      expect(slots.size).toBeGreaterThan(keys.length / 2)
    })
  })

  it('spreads keys over every master', async () => {
    const storage = new RedisStorage({ client: pipelined, prefix: PREFIX + 'spread:' })
    const keys = Array.from({ length: 60 }, (_, i) => `spread-${i}`)
    const leases = await Promise.all(keys.map((key) => storage.begin(key, 'fp', LEASE)))
    expect(leases.every((lease) => lease.state === 'acquired')).toBe(true)
    const masters = client.nodes('master')
    expect(masters).toHaveLength(3)
    for (const master of masters) {
      const [, found] = await master.scan('0', 'MATCH', PREFIX + 'spread:*', 'COUNT', 1000)
      expect(found.length).toBeGreaterThan(0)
    }
  })

  it('sends one command per call through a Cluster client, and defines nothing on it', async () => {
    const own = newCluster()
    const define = vi.spyOn(own, 'defineCommand')
    const storage = new RedisStorage({ client: own, prefix: PREFIX + 'trips:' })
    new RedisStorage({ client: own, prefix: PREFIX + 'trips:' }) // eslint-disable-line no-new
    expect(define).not.toHaveBeenCalled()
    await own.ping()
    const sent: string[] = []
    const original = own.sendCommand
    vi.spyOn(own, 'sendCommand').mockImplementation(function (this: Cluster, command, ...rest) {
      sent.push(command.name)
      return original.call(this, command, ...rest)
    })
    const lease = await storage.begin('trips', 'fp', LEASE)
    expect(sent).toHaveLength(1)
    const token = lease.state === 'acquired' ? lease.token : ''
    expect(await storage.renew('trips', token, LEASE)).toBe(true)
    expect(sent).toHaveLength(2)
    expect(await storage.complete('trips', token, response, EXPIRY)).toBe(true)
    expect(sent).toHaveLength(3)
    expect((await storage.begin('trips', 'fp', LEASE)).state).toBe('completed')
    expect(sent).toHaveLength(4)
    await storage.close()
    expect(own.status).toBe('ready')
  })

  it('keeps working after the nodes forget their scripts (SCRIPT FLUSH)', async () => {
    const storage = new RedisStorage({ client, prefix: PREFIX + 'flush:' })
    const lease = await storage.begin('flush', 'fp', LEASE)
    expect(lease.state).toBe('acquired')
    await Promise.all(client.nodes('master').map((node) => node.script('FLUSH')))
    expect(await storage.complete('flush', lease.state === 'acquired' ? lease.token : '', response, EXPIRY)).toBe(true)
    const replay = await storage.begin('flush', 'fp', LEASE)
    expect(replay.state === 'completed' && replay.response.body.toString()).toBe('ok')
  })
})
