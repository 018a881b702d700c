/**
 * The errors an application meets as the `cause` of the plugin's errors (and BodyTooLargeError,
 * met as itself), each recognised by its exported type guard in the application's own error
 * handler, and by no other guard. Each is provoked the way it happens in production: a store
 * that does not answer, an entry sealed with a key since removed, a body nested too deeply, an
 * upload over the route's limit.
 */
import { describe, expect, it } from 'vitest'
import Fastify, { type FastifyError, type FastifyInstance } from 'fastify'
import idempotency, {
  isBodyNestedTooDeeplyError,
  isBodyTooLargeError,
  isIdempotencyError,
  isStoreContentionError,
  isStoreTimeoutError,
  isUnreadableEntryError,
  MemoryStorage,
  type IdempotencyOptions,
  type IdempotencyStorage
} from '../lib/index.js'

const GUARDS = { isStoreTimeoutError, isStoreContentionError, isUnreadableEntryError, isBodyNestedTooDeeplyError, isBodyTooLargeError }

/** An app whose own error handler records what it receives, and answers with its status. */
async function appWith (options: IdempotencyOptions): Promise<{ app: FastifyInstance, seen: FastifyError[] }> {
  const app = Fastify()
  const seen: FastifyError[] = []
  await app.register(idempotency, options)
  app.setErrorHandler(async (error: FastifyError, _request, reply) => {
    seen.push(error)
    return reply.code(error.statusCode ?? 500).send({ code: error.code })
  })
  app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => reply.code(201).send({ id: 1 }))
  return { app, seen }
}

const post = (app: FastifyInstance, key: string, payload: unknown = { sku: 'A1' }) =>
  app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: payload as object })

/** The names of the guards that accept `error`. */
function matching (error: unknown): string[] {
  return Object.entries(GUARDS).filter(([, guard]) => guard(error)).map(([name]) => name)
}

describe('the causes of the plugin\'s errors, each with its guard', () => {
  it('a store that does not answer within storeTimeout: 503, cause StoreTimeoutError', async () => {
    const hung: IdempotencyStorage = {
      begin: () => new Promise(() => {}),
      complete: async () => true,
      release: async () => true,
      renew: async () => true
    }
    const { app, seen } = await appWith({ storage: hung, storeTimeout: 100 })
    expect((await post(app, 'k-timeout')).statusCode).toBe(503)
    expect(isIdempotencyError(seen[0])).toBe(true)
    expect(matching(seen[0]!.cause)).toEqual(['isStoreTimeoutError'])
    expect((seen[0]!.cause as { code: string }).code).toBe('FST_IDEMPOTENCY_STORE_TIMEOUT')
    await app.close()
  })

  it('an entry sealed with a key no longer configured: 409, cause UnreadableEntryError', async () => {
    const storage = new MemoryStorage()
    const keyHashSecret = Buffer.alloc(32, 7)
    const first = await appWith({ storage, encryption: { keys: [Buffer.alloc(32, 1)], keyHashSecret } })
    expect((await post(first.app, 'k-sealed')).statusCode).toBe(201)
    const rotated = await appWith({ storage, encryption: { keys: [Buffer.alloc(32, 2)], keyHashSecret } })
    expect((await post(rotated.app, 'k-sealed')).statusCode).toBe(409)
    expect(matching(rotated.seen[0]!.cause)).toEqual(['isUnreadableEntryError'])
    await Promise.all([first.app.close(), rotated.app.close()])
  })

  it('a body nested too deeply to fingerprint (a parser\'s value, not JSON): 400, cause BodyNestedTooDeeplyError', async () => {
    const { app, seen } = await appWith({ storage: new MemoryStorage() })
    // A format of the application's own, parsed into a value; JSON bodies overflow later (RangeError).
    app.addContentTypeParser('application/vnd.tree', { parseAs: 'string' }, (_request, text, done) => { done(null, JSON.parse(text as string)) })
    const body = '{"deep":'.repeat(1010) + '{}' + '}'.repeat(1010)
    const res = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'k-deep', 'content-type': 'application/vnd.tree' }, payload: body })
    expect(res.statusCode).toBe(400)
    expect(matching(seen[0]!.cause)).toEqual(['isBodyNestedTooDeeplyError'])
    await app.close()
  })

  it('an upload over the route\'s limit, read by the plugin for its fingerprint: 413, BodyTooLargeError itself', async () => {
    const app = Fastify({ bodyLimit: 1024 })
    const seen: FastifyError[] = []
    await app.register(idempotency, { storage: new MemoryStorage() })
    // A parser that leaves the stream to the handler: the plugin reads the bytes for the fingerprint.
    app.addContentTypeParser('application/octet-stream', (_request, _payload, done) => { done(null) })
    app.setErrorHandler(async (error: FastifyError, _request, reply) => {
      seen.push(error)
      return reply.code(error.statusCode ?? 500).send({ code: error.code })
    })
    app.post('/upload', { config: { idempotency: true } }, async () => ({ stored: true }))
    const res = await app.inject({ method: 'POST', url: '/upload', headers: { 'idempotency-key': 'k-big', 'content-type': 'application/octet-stream' }, payload: Buffer.alloc(4096) })
    expect(res.statusCode).toBe(413)
    expect(matching(seen[0])).toEqual(['isBodyTooLargeError'])
    expect(seen[0]!.code).toBe('FST_ERR_CTP_BODY_TOO_LARGE')
    await app.close()
  })
})
