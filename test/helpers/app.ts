import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import { randomUUID } from 'node:crypto'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions } from '../../lib/index.js'

export interface Counted {
  app: FastifyInstance
  /** How many times each route's handler ran. */
  runs: Map<string, number>
}

/** A fresh key no other test uses. */
export function newKey (label = 'k'): string {
  return `${label}-${randomUUID()}`
}

export type Handler = (request: FastifyRequest, reply: FastifyReply, run: number) => unknown

/**
 * An app with the plugin and its error handler, and `/orders` (guarded, 201 + Location), whose
 * handler runs are counted. `routes` adds more guarded routes: path -> handler.
 */
export async function buildApp (options: IdempotencyOptions = {}, routes: Record<string, Handler> = {}, routeConfig: object | true = true): Promise<Counted> {
  const app = Fastify()
  const runs = new Map<string, number>()
  const count = (name: string) => {
    const n = (runs.get(name) ?? 0) + 1
    runs.set(name, n)
    return n
  }
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/orders', { config: { idempotency: routeConfig } }, async (request, reply) => {
    const run = count('/orders')
    reply.code(201).header('location', `/orders/${run}`).header('x-run', String(run))
    return { id: run, received: request.body }
  })
  for (const [path, handler] of Object.entries(routes)) {
    app.route({ method: ['POST', 'PUT', 'PATCH', 'DELETE'], url: path, config: { idempotency: routeConfig }, handler: async (request, reply) => handler(request, reply, count(path)) })
  }
  await app.ready()
  return { app, runs }
}

/**
 * `storage` with some of its methods replaced (to count or alter calls), the others bound to it, so
 * a storage with private fields still works behind it.
 */
export function withMethods<S extends object> (storage: S, replaced: Partial<Record<keyof S, (...args: never[]) => unknown>>): S {
  return new Proxy(storage, {
    get (target, property) {
      const own = (replaced as Record<PropertyKey, unknown>)[property]
      if (own !== undefined) return own
      const value: unknown = Reflect.get(target, property, target)
      return typeof value === 'function' ? value.bind(target) : value
    }
  })
}
