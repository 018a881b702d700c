import type { FastifyInstance } from 'fastify'
import { afterAll, beforeAll } from 'vitest'
import type { IdempotencyStorage } from '../../lib/index.js'
import type { StoreCase } from './stores.js'

export interface Served {
  app: FastifyInstance
  /** Where it listens: `http://127.0.0.1:<port>`. */
  url: string
}

/**
 * The app `build` makes on a new storage of `store` (with whatever else it gives the tests),
 * listening on a free loopback port, for a describe's tests: made before the first test, closed
 * after the last, and the store's namespace dropped. Its fields are set once the app listens.
 */
export function servedOn<T extends { app: FastifyInstance }> (store: Pick<StoreCase, 'create' | 'cleanup'>, build: (storage: IdempotencyStorage) => Promise<T>): T & Served {
  const served = {} as T & Served
  beforeAll(async () => {
    Object.assign(served, await build(await store.create()))
    served.url = await served.app.listen({ host: '127.0.0.1', port: 0 })
  })
  afterAll(async () => {
    await served.app?.close()
    await store.cleanup()
  })
  return served
}
