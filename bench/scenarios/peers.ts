/**
 * The peers, on the same route and handler.
 *
 * - `@node-idempotency/core` with its memory and Redis adapters, wired into Fastify hooks the way
 *   its own Fastify plugin does (`preHandler` calls `onRequest`, `onSend` calls `onResponse`), with
 *   one fix in the peer's favour: `onResponse` runs only for the request that `onRequest` let
 *   through as new. (The published plugin calls it for every response, replays and 409s included,
 *   which costs a replay an extra SET and can overwrite an in-flight marker with a 409.)
 * - `express-idempotency` (its default in-memory adapter) on Express 5, and Express's own bare
 *   route as its baseline. The route checks `isHit(req)` first, as its README says to.
 */
import { createServer, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import { Idempotency, IdempotencyError, IdempotencyErrorCodes, type IdempotencyParams } from '@node-idempotency/core'
import type { StorageAdapter } from '@node-idempotency/storage'
import { MemoryStorageAdapter } from '@node-idempotency/storage-adapter-memory'
import { RedisStorageAdapter } from '@node-idempotency/storage-adapter-redis'
import express, { type NextFunction, type Request, type Response } from 'express'
import { getSharedIdempotencyService, idempotency as expressIdempotency } from 'express-idempotency'
import { benchEnv, ExecutionCounter, KEY_HEADER, placeOrder, ROUTE, type BenchServer, type OrderBody } from './common.js'
import { listen } from './fastify.js'

// ---------------------------------------------------------------- @node-idempotency/core + Fastify

/** The status codes @node-idempotency's own Fastify plugin answers its errors with. */
const NODE_IDEMPOTENCY_STATUS: Record<string, number> = {
  [IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_LEN_EXEEDED]: 400,
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_MISSING]: 400,
  [IdempotencyErrorCodes.REQUEST_IN_PROGRESS]: 409
}

const kAcquired = Symbol('bench.node-idempotency.acquired')
type MarkedRequest = FastifyRequest & { [kAcquired]?: boolean }

function idempotencyParams (request: FastifyRequest): IdempotencyParams {
  return {
    headers: request.headers,
    body: request.body as Record<string, unknown>,
    path: request.url,
    method: request.method
  }
}

async function nodeIdempotencyServer (storage: StorageAdapter, cleanup: () => Promise<void>): Promise<BenchServer> {
  const core = new Idempotency(storage, { cacheKeyPrefix: `bench:${benchEnv().tag}:nidem` })
  const app: FastifyInstance = Fastify({ logger: false })
  const counter = new ExecutionCounter()

  async function preHandler (request: FastifyRequest, reply: FastifyReply): Promise<void> {
    let stored
    try {
      stored = await core.onRequest<unknown, unknown>(idempotencyParams(request))
    } catch (error) {
      if (!(error instanceof IdempotencyError)) throw error
      if (error.code === IdempotencyErrorCodes.REQUEST_IN_PROGRESS) reply.header('retry-after', '1')
      await reply.code(NODE_IDEMPOTENCY_STATUS[error.code] ?? 500).send({ code: error.code, message: error.message })
      return
    }
    if (stored === undefined) {
      // New (or not guarded: no key): the handler runs, and onSend stores its response.
      if (request.headers[KEY_HEADER] !== undefined) (request as MarkedRequest)[kAcquired] = true
      return
    }
    const additional = stored.additional ?? {}
    if (typeof additional.statusCode === 'number') reply.code(additional.statusCode)
    if (typeof additional['Content-Type'] === 'string') reply.header('content-type', additional['Content-Type'])
    reply.header('idempotent-replayed', 'true')
    await reply.send(stored.body ?? stored.error)
  }

  async function onSend (request: FastifyRequest, reply: FastifyReply, payload: unknown): Promise<unknown> {
    if ((request as MarkedRequest)[kAcquired] !== true) return payload
    const additional: Record<string, unknown> = { statusCode: reply.statusCode }
    const contentType = reply.getHeader('content-type')
    if (contentType !== undefined) additional['Content-Type'] = contentType
    await core.onResponse(idempotencyParams(request), {
      additional,
      ...(reply.statusCode < 400 ? { body: payload } : { error: payload })
    })
    return payload
  }

  app.post(ROUTE, { preHandler, onSend }, async (request, reply) => {
    const result = await placeOrder(counter, request.headers[KEY_HEADER], request.body as OrderBody)
    reply.code(201)
    return result
  })
  return await listen(app, counter, cleanup)
}

/** @node-idempotency/core on its in-memory adapter (a Map). */
export async function nodeIdempotencyMemory (): Promise<BenchServer> {
  return await nodeIdempotencyServer(new MemoryStorageAdapter(), async () => {})
}

/** @node-idempotency/core on its Redis adapter (node-redis v4, which pipelines a tick's commands). */
export async function nodeIdempotencyRedis (): Promise<BenchServer> {
  const env = benchEnv()
  const adapter = new RedisStorageAdapter({ url: `redis://${env.redisHost}:${env.redisPort}` })
  await adapter.connect()
  return await nodeIdempotencyServer(adapter, async () => { await adapter.disconnect() })
}

// ---------------------------------------------------------------- Express

async function listenExpress (app: express.Express, counter: ExecutionCounter): Promise<BenchServer> {
  const server: Server = createServer(app)
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const address = server.address() as AddressInfo
  return {
    port: address.port,
    counter,
    close: async () => {
      server.closeAllConnections()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    }
  }
}

/** Errors as JSON with the status the middleware chose (Express's default handler would log each). */
function expressErrors (error: Error, _request: Request, response: Response, _next: NextFunction): void {
  response.status(response.statusCode >= 400 ? response.statusCode : 500).json({ message: error.message })
}

/** Express's own bare route: the baseline of express-idempotency. */
export async function expressBare (): Promise<BenchServer> {
  const app = express()
  const counter = new ExecutionCounter()
  app.post(ROUTE, express.json(), async (request: Request, response: Response) => {
    const result = await placeOrder(counter, request.headers[KEY_HEADER], request.body as OrderBody)
    response.status(201).json(result)
  })
  app.use(expressErrors)
  return await listenExpress(app, counter)
}

/** express-idempotency with its default (in-memory) data adapter. */
export async function expressIdempotencyMemory (): Promise<BenchServer> {
  const app = express()
  const counter = new ExecutionCounter()
  app.post(ROUTE, express.json(), expressIdempotency(), async (request: Request, response: Response) => {
    if (getSharedIdempotencyService().isHit(request)) return
    const result = await placeOrder(counter, request.headers[KEY_HEADER], request.body as OrderBody)
    response.status(201).json(result)
  })
  app.use(expressErrors)
  return await listenExpress(app, counter)
}
