/**
 * The Fastify scenarios: the bare route, the plugin (unflagged route, memory, Redis on each client,
 * PostgreSQL, SQLite), the in-process floor and the Redis floor. Every one serves the same `POST /orders`
 * with the same handler.
 */
import { hash, randomBytes } from 'node:crypto'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import { Redis } from 'ioredis'
import { benchEnv, ExecutionCounter, KEY_HEADER, placeOrder, ROUTE, type BenchServer, type OrderBody } from './common.js'
import { loadCore, loadRedisStorage } from './source.js'

export function newApp (): FastifyInstance {
  return Fastify({ logger: false })
}

export function orderHandler (counter: ExecutionCounter) {
  return async function handler (request: FastifyRequest, reply: FastifyReply) {
    const result = await placeOrder(counter, request.headers[KEY_HEADER], request.body as OrderBody)
    reply.code(201)
    return result
  }
}

/** Listen on a free loopback port; shared with the peers' Fastify scenarios. */
export async function listen (app: FastifyInstance, counter: ExecutionCounter, cleanup: () => Promise<void> = async () => {}): Promise<BenchServer> {
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  if (address === null || typeof address === 'string') throw new Error('no TCP address')
  return {
    port: address.port,
    counter,
    close: async () => {
      await app.close()
      await cleanup()
    }
  }
}

function redisClient (): Redis {
  const env = benchEnv()
  return new Redis({ host: env.redisHost, port: env.redisPort, enableAutoPipelining: true })
}

/** The route without the plugin: the baseline of every in-process and SQL scenario. */
export async function bare (): Promise<BenchServer> {
  const app = newApp()
  const counter = new ExecutionCounter()
  app.post(ROUTE, orderHandler(counter))
  return await listen(app, counter)
}

/** The plugin registered, a guarded route elsewhere, and the measured route without the flag. */
export async function unflagged (): Promise<BenchServer> {
  const { idempotency, idempotencyErrorHandler, MemoryStorage } = await loadCore()
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage: new MemoryStorage() })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/guarded', { config: { idempotency: true } }, orderHandler(new ExecutionCounter()))
  app.post(ROUTE, orderHandler(counter))
  return await listen(app, counter)
}

/** The plugin on its embedded default store, with the default bound. */
export async function memory (): Promise<BenchServer> {
  const { idempotency, idempotencyErrorHandler, MemoryStorage } = await loadCore()
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage: new MemoryStorage() })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post(ROUTE, { config: { idempotency: true } }, orderHandler(counter))
  return await listen(app, counter)
}

/**
 * The plugin on memory with encryption at rest: every stored response sealed (AES-256-GCM), every
 * replay opened, every key an HMAC. Compared with `memory`, its ratio is the cost of encryption.
 */
export async function memorySealed (): Promise<BenchServer> {
  const { idempotency, idempotencyErrorHandler, MemoryStorage } = await loadCore()
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage: new MemoryStorage(), encryption: { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) } })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post(ROUTE, { config: { idempotency: true } }, orderHandler(counter))
  return await listen(app, counter)
}

/** What the in-process floor keeps per key: `body` is `null` while the first request runs. */
interface FloorEntry {
  fingerprint: string
  status: number
  contentType: string
  body: string | null
}

declare module 'fastify' {
  interface FastifyRequest {
    /** The in-process floor's entry for a first request; `null` on any other. */
    floorEntry: FloorEntry | null
  }
}

/**
 * The least an in-process idempotency layer built on Fastify's hooks does, and nothing more: in
 * `preHandler`, read the key, hash `JSON.stringify` of the parsed body (no canonical form), look
 * the key up in a `Map` and either answer from it or mark the key in flight; in `onSend`, keep the
 * status, content type and payload. It holds as many entries as MemoryStorage does by default,
 * dropping the oldest. No lease, token, deadline, header capture, shutdown drain or error
 * handling: what it costs over the bare route is what any hook-based layer on memory pays.
 */
export async function memoryFloor (): Promise<BenchServer> {
  const app = newApp()
  const counter = new ExecutionCounter()
  const entries = new Map<string, FloorEntry>()
  // The oldest key is found in a ring of the keys in insertion order: asking the Map for its first
  // key walks past every entry deleted since its last rehash (tens of microseconds per call when
  // it holds 100,000 entries and drops one per insert).
  const ring: Array<string | undefined> = new Array(100_000)
  let next = 0
  // The entry a first request took rides on the request, as Fastify decorates it: declared up
  // front, so every request has the same shape (a WeakMap would hash each request object).
  app.decorateRequest('floorEntry', null)
  app.post(ROUTE, {
    preHandler: async (request, reply) => {
      const key = request.headers[KEY_HEADER]
      if (typeof key !== 'string') throw new Error('the floor needs a key')
      const fingerprint = hash('sha256', JSON.stringify(request.body), 'base64url')
      const stored = entries.get(key)
      if (stored !== undefined) {
        if (stored.fingerprint !== fingerprint || stored.body === null) return await reply.code(409).send()
        return await reply.code(stored.status).type(stored.contentType).send(stored.body)
      }
      const entry: FloorEntry = { fingerprint, status: 0, contentType: '', body: null }
      const oldest = ring[next]
      if (oldest !== undefined) entries.delete(oldest)
      ring[next] = key
      next = (next + 1) % ring.length
      entries.set(key, entry)
      request.floorEntry = entry
    },
    onSend: async (request, reply, payload) => {
      const entry = request.floorEntry
      if (entry !== null) {
        entry.status = reply.statusCode
        entry.contentType = String(reply.getHeader('content-type'))
        entry.body = payload as string
      }
      return payload
    }
  }, orderHandler(counter))
  return await listen(app, counter)
}

/** The plugin on Redis, with the recommended client setup (ioredis, enableAutoPipelining). */
export async function redis (): Promise<BenchServer> {
  const { idempotency, idempotencyErrorHandler } = await loadCore()
  const { RedisStorage } = await loadRedisStorage()
  const client = redisClient()
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage: new RedisStorage({ client, prefix: `bench:${benchEnv().tag}:idem:` }) })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post(ROUTE, { config: { idempotency: true } }, orderHandler(counter))
  return await listen(app, counter, async () => { await client.quit() })
}

/**
 * The plugin on Redis through another client: node-redis 6 (its defaults, RESP3), Valkey GLIDE 2
 * (RESP3) or iovalkey. The same storage, scripts and keys; only the client differs.
 */
export async function redisOn (family: 'node-redis' | 'glide' | 'iovalkey'): Promise<BenchServer> {
  // From the repository's own dependencies: bench/node_modules has the peer's node-redis 4.
  const fromRoot = createRequire(new URL('../../package.json', import.meta.url))
  const load = async <T>(name: string): Promise<T> => await import(pathToFileURL(fromRoot.resolve(name)).href) as T
  const { idempotency, idempotencyErrorHandler } = await loadCore()
  const { RedisStorage } = await loadRedisStorage()
  const { redisHost: host, redisPort: port, tag } = benchEnv()
  let client: ConstructorParameters<typeof RedisStorage>[0]['client']
  let close: () => Promise<void>
  if (family === 'node-redis') {
    const { createClient } = await load<typeof import('redis')>('redis')
    const nodeRedis = createClient({ socket: { host, port } })
    await nodeRedis.connect()
    client = nodeRedis as unknown as typeof client
    close = async () => { nodeRedis.destroy() }
  } else if (family === 'glide') {
    const { GlideClient } = await load<typeof import('@valkey/valkey-glide')>('@valkey/valkey-glide')
    const glide = await GlideClient.createClient({ addresses: [{ host, port }] })
    client = glide as unknown as typeof client
    close = async () => { glide.close() }
  } else {
    const { Redis: Valkey } = await load<typeof import('iovalkey')>('iovalkey')
    const valkey = new Valkey({ host, port, enableAutoPipelining: true })
    client = valkey as unknown as typeof client
    close = async () => { await valkey.quit() }
  }
  const app = newApp()
  const counter = new ExecutionCounter()
  await app.register(idempotency, { storage: new RedisStorage({ client, prefix: `bench:${tag}:idem-${family}:` }) })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post(ROUTE, { config: { idempotency: true } }, orderHandler(counter))
  return await listen(app, counter, close)
}

/**
 * The physical floor on Redis: what any Redis-backed idempotency layer must at least spend, with
 * none of the work of deciding. A key starting with `r-` (REPLAY, and the replays of MIXED) costs
 * one GET; any other key (NEW) costs two round trips, SET NX PX before the handler and SET PX
 * after it. The client is ioredis with `enableAutoPipelining: true`.
 */
export async function redisFloor (): Promise<BenchServer> {
  const client = redisClient()
  const prefix = `bench:${benchEnv().tag}:floor:`
  const app = newApp()
  const counter = new ExecutionCounter()
  app.post(ROUTE, async (request, reply) => {
    const key = request.headers[KEY_HEADER]
    if (typeof key !== 'string') throw new Error('the floor needs a key')
    const redisKey = prefix + key
    if (key.startsWith('r-')) {
      const stored = await client.getBuffer(redisKey)
      if (stored !== null) {
        reply.code(201).type('application/json; charset=utf-8')
        return stored
      }
    } else {
      await client.set(redisKey, 'in-flight', 'PX', 60_000, 'NX')
    }
    const payload = JSON.stringify(await placeOrder(counter, key, request.body as OrderBody))
    await client.set(redisKey, payload, 'PX', 86_400_000)
    reply.code(201).type('application/json; charset=utf-8')
    return payload
  })
  return await listen(app, counter, async () => { await client.quit() })
}
