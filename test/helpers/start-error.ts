import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { type IdempotencyOptions, type IdempotencyStorage } from '../../lib/index.js'

/** What `app.ready()` says (`null`: it starts); the app is closed either way. */
export async function readyError (app: FastifyInstance): Promise<string | null> {
  try {
    await app.ready()
    return null
  } catch (error) {
    return (error as Error).message
  } finally {
    await app.close()
  }
}

/** What `app.ready()` of an app on `storage` (with `options`) says: `null` when it starts. */
export async function startError (storage: IdempotencyStorage, options: IdempotencyOptions = {}): Promise<string | null> {
  const app = Fastify()
  await app.register(idempotency, { storage, ...options })
  app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
  return await readyError(app)
}
