/**
 * A handler that calls `reply.send()` without returning `reply`, over real HTTP, on every store:
 * the first client gets the real body (not an empty one), the replay is the same, and no
 * ERR_HTTP_HEADERS_SENT surfaces as an unhandled rejection (which ends a Node process).
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

const rejections: unknown[] = []
const onRejection = (reason: unknown): void => { rejections.push(reason) }
beforeAll(() => { process.on('unhandledRejection', onRejection) })
afterAll(() => { process.off('unhandledRejection', onRejection) })

async function serve (storage: IdempotencyStorage | undefined): Promise<{ app: FastifyInstance, url: string }> {
  const app = Fastify()
  if (storage !== undefined) await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  const config = { idempotency: true }
  app.post('/queued', { config }, async (_request, reply) => { reply.code(202).send({ queued: true }) })
  app.post('/empty', { config }, async (_request, reply) => { reply.code(204).send() })
  app.post('/sync', { config }, (_request, reply) => { reply.code(201).send({ created: true }) })
  // An asynchronous onSend hook of the application's, as many plugins add.
  app.addHook('onSend', async (_request, reply) => { await new Promise((resolve) => setImmediate(resolve)); reply.header('x-app', 'yes') })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, url: `http://127.0.0.1:${(app.server.address() as { port: number }).port}` }
}

async function post (url: string, key: string | undefined): Promise<{ status: number, body: string, replayed: string | null, app: string | null }> {
  const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) }, body: '{"a":1}' })
  return { status: res.status, body: await res.text(), replayed: res.headers.get('idempotent-replayed'), app: res.headers.get('x-app') }
}

for (const store of cases) {
  describe.skipIf(!store.available)(`reply.send() without return reply, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    let guarded: Awaited<ReturnType<typeof serve>>
    let bare: Awaited<ReturnType<typeof serve>>
    beforeAll(async () => {
      storage = await store.create()
      guarded = await serve(storage)
      bare = await serve(undefined)
    })
    afterAll(async () => {
      await guarded.app.close()
      await bare.app.close()
      await store.cleanup()
    })
    afterEach(() => { expect(rejections).toEqual([]) })

    for (const path of ['/queued', '/empty', '/sync']) {
      it(`${path}: the first answer is the one without the plugin, the replay the same`, async () => {
        const expected = await post(bare.url + path, undefined)
        const key = newKey()
        const first = await post(guarded.url + path, key)
        expect({ ...first, replayed: null }).toEqual(expected)
        expect(first.replayed).toBeNull()
        const again = await post(guarded.url + path, key)
        expect({ ...again, replayed: null }).toEqual(expected)
        expect(again.replayed).toBe('true')
        // Give a late ERR_HTTP_HEADERS_SENT the time to surface before afterEach looks.
        await new Promise((resolve) => setTimeout(resolve, 50))
      })
    }
  })
}
