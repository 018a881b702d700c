/**
 * What RedisStorage costs the client process on each Redis client it takes, counted in
 * instructions (which the machine's load does not move): a loop of storage calls, 8 per
 * event-loop turn, against the Redis of the benchmark, with callgrind collecting over the measured
 * loop alone (after a warm-up).
 *
 *   sh bench/micro-redis-clients.sh                     # every client, both operations
 *   MICRO_CLIENT=node-redis-6 MICRO_OP=new npx tsx bench/micro-redis-clients.ts   # one case, timed only
 *
 * Operations: `replay` is `begin` on a stored key (one SET NX GET that returns the entry); `new`
 * is `begin` on a new key then `complete` (SET NX GET, then the fenced script): a first request's
 * two calls. The response is the benchmark route's.
 */
import { execFileSync } from 'node:child_process'
import { Redis } from 'ioredis'
import { Redis as Redis5 } from 'ioredis5'
import { Redis as Valkey } from 'iovalkey'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'
import { createClient as createClient5 } from 'redis5'
import { GlideClient, ProtocolVersion } from '@valkey/valkey-glide'
import { RedisStorage, type RedisStorageClient } from '../lib/redis.js'

// node-redis 6 of the repository: bench/node_modules has the peer's node-redis 4.
const { createClient } = await import(pathToFileURL(createRequire(new URL('../package.json', import.meta.url)).resolve('redis')).href) as typeof import('redis')
import type { StoredResponse } from '../lib/storage/types.js'

const host = process.env.BENCH_REDIS_HOST ?? '127.0.0.1'
const port = Number(process.env.BENCH_REDIS_PORT ?? 6379)

interface ClientCase { open: () => Promise<RedisStorageClient>, close: (client: RedisStorageClient) => Promise<void> }

const quit = async (client: RedisStorageClient): Promise<void> => { await (client as Redis).quit() }
const destroy = async (client: RedisStorageClient): Promise<void> => { (client as { destroy: () => void }).destroy() }
async function nodeRedis (client: { connect: () => Promise<unknown> }): Promise<RedisStorageClient> {
  await client.connect()
  return client as unknown as RedisStorageClient
}

export const CLIENTS: Record<string, ClientCase> = {
  'ioredis-6': { open: async () => new Redis({ host, port }), close: quit },
  'ioredis-6-resp2': { open: async () => new Redis({ host, port, protocol: 2 }), close: quit },
  'ioredis-5': { open: async () => new Redis5({ host, port }) as unknown as Redis, close: quit },
  iovalkey: { open: async () => new Valkey({ host, port }) as unknown as Redis, close: quit },
  'node-redis-6': { open: () => nodeRedis(createClient({ socket: { host, port }, RESP: 3 })), close: destroy },
  'node-redis-6-resp2': { open: () => nodeRedis(createClient({ socket: { host, port } })), close: destroy },
  'node-redis-5': { open: () => nodeRedis(createClient5({ socket: { host, port } })), close: destroy },
  'glide-2': {
    open: async () => await GlideClient.createClient({ addresses: [{ host, port }], protocol: ProtocolVersion.RESP3, requestTimeout: 60_000 }) as unknown as RedisStorageClient,
    close: async (client) => { (client as unknown as GlideClient).close() }
  }
}

const response: StoredResponse = {
  statusCode: 201,
  contentType: 'application/json; charset=utf-8',
  headers: {},
  body: Buffer.from('{"id":"ord_1","status":"created","amount":4200,"currency":"eur"}')
}
const PER_TURN = 8
const LEASE = 60_000
const EXPIRY = 3_600_000

async function main (): Promise<void> {
  const name = process.env.MICRO_CLIENT ?? 'ioredis-6'
  const op = process.env.MICRO_OP ?? 'replay'
  const count = Number(process.env.MICRO_COUNT ?? 4000)
  const warmup = Number(process.env.MICRO_WARMUP ?? 6000)
  const clientCase = CLIENTS[name]
  if (clientCase === undefined) throw new Error(`unknown MICRO_CLIENT ${name}: one of ${Object.keys(CLIENTS).join(', ')}`)
  const client = await clientCase.open()
  const prefix = `bench:micro:${process.pid}:`
  const storage = new RedisStorage({ client, prefix })
  const stored = Array.from({ length: PER_TURN }, (_, i) => `stored-${i}`)
  for (const key of stored) {
    const lease = await storage.begin(key, 'fp', LEASE)
    if (lease.state === 'acquired') await storage.complete(key, lease.token, response, EXPIRY)
  }
  let unique = 0
  const once = async (slot: number): Promise<void> => {
    if (op === 'replay') {
      const found = await storage.begin(stored[slot]!, 'fp', LEASE)
      if (found.state !== 'completed') throw new Error(`expected a replay, got ${found.state}`)
      return
    }
    const key = `new-${++unique}`
    const lease = await storage.begin(key, 'fp', LEASE)
    if (lease.state !== 'acquired' || !await storage.complete(key, lease.token, response, 2000)) throw new Error('expected a lease, then its completion')
  }
  const run = async (ops: number): Promise<void> => {
    for (let done = 0; done < ops; done += PER_TURN) await Promise.all(Array.from({ length: PER_TURN }, (_, slot) => once(slot)))
  }
  const callgrind = (on: boolean): void => { if (process.env.MICRO_CALLGRIND === '1') execFileSync('callgrind_control', ['-i', on ? 'on' : 'off', String(process.pid)], { stdio: 'ignore' }) }
  await run(warmup)
  const started = performance.now()
  callgrind(true)
  await run(count)
  callgrind(false)
  const elapsed = performance.now() - started
  process.stdout.write(`${name} ${op}: ${(elapsed * 1000 / count).toFixed(1)} us/op wall (${count} ops)\n`)
  const cleanup = new Redis({ host, port })
  const keys = await cleanup.keys(`${prefix}*`)
  if (keys.length > 0) await cleanup.del(...keys)
  await cleanup.quit()
  await clientCase.close(client)
}

await main()
