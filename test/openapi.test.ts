import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import swagger from '@fastify/swagger'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions } from '../lib/index.js'

type Operation = { parameters?: Array<{ in: string, name: string, required: boolean }>, responses: Record<string, { headers?: Record<string, unknown>, content?: Record<string, unknown> }> }

async function document (options: IdempotencyOptions = {}) {
  const app = Fastify()
  await app.register(swagger, { openapi: { info: { title: 'orders', version: '1' } } })
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  const shared = { type: 'object', properties: { id: { type: 'string' } } }
  app.post('/orders', { config: { idempotency: true }, schema: { response: { 201: shared } } }, async (_req, reply) => { reply.code(201); return { id: 'o1', hidden: true } })
  app.post('/payments', { config: { idempotency: { required: true } } }, async () => ({ ok: true }))
  app.post('/plain', { schema: { response: { 201: shared } } }, async () => ({}))
  await app.ready()
  const paths = app.swagger().paths as Record<string, { post: Operation }>
  return { app, paths, shared }
}

describe('OpenAPI through @fastify/swagger', () => {
  it('documents the Idempotency-Key header, optional or required as configured', async () => {
    const { paths } = await document()
    expect(paths['/orders']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: false }))
    expect(paths['/payments']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: true }))
    expect(paths['/plain']!.post.parameters ?? []).toEqual([])
  })

  it('documents the replay header on success and the problem+json answers', async () => {
    const { paths } = await document()
    const orders = paths['/orders']!.post.responses
    expect(orders['201']!.headers).toHaveProperty('Idempotent-Replayed')
    for (const code of ['400', '409', '503']) expect(orders[code]!.content).toHaveProperty(['application/problem+json'])
    expect(paths['/payments']!.post.responses['2XX']!.headers).toHaveProperty('Idempotent-Replayed')
    expect(paths['/plain']!.post.responses['409']).toBeUndefined()
  })

  it('follows the options: 422 for a mismatch, no 503 with failOpen, no replay header when disabled', async () => {
    const { paths } = await document({ mismatchStatusCode: 422, failOpen: true, replayHeader: false })
    const orders = paths['/orders']!.post.responses
    expect(orders['422']!.content).toHaveProperty(['application/problem+json'])
    expect(orders['503']).toBeUndefined()
    expect(orders['201']!.headers ?? {}).not.toHaveProperty('Idempotent-Replayed')
  })

  it('changes neither the shared schema objects nor the behaviour of the routes', async () => {
    const { app, shared } = await document()
    expect(shared).toEqual({ type: 'object', properties: { id: { type: 'string' } } })
    const send = (key?: string) => app.inject({ method: 'POST', url: '/orders', headers: key === undefined ? {} : { 'idempotency-key': key }, payload: {} })
    const first = await send('k1')
    expect(first.statusCode).toBe(201)
    expect(first.json()).toEqual({ id: 'o1' })
    expect((await send('k1')).headers['idempotent-replayed']).toBe('true')
    const bad = await send('bad key')
    expect(bad.statusCode).toBe(400)
    expect(bad.headers['content-type']).toMatch(/^application\/problem\+json/)
    expect(bad.json().type).toMatch(/#key-invalid$/)
    const missing = await app.inject({ method: 'POST', url: '/payments', payload: {} })
    expect(missing.statusCode).toBe(400)
    expect(missing.json().type).toMatch(/#key-missing$/)
  })

  it('documents the key on routes with their own headers schema, whatever the case of its names, and never twice', async () => {
    const app = Fastify()
    await app.register(swagger, { openapi: { info: { title: 'orders', version: '1' } } })
    await app.register(idempotency, { required: true })
    const auth = { type: 'object', properties: { authorization: { type: 'string' } }, required: ['authorization'] }
    app.post('/lower', { config: { idempotency: true }, schema: { headers: auth } }, async () => ({}))
    app.post('/mixed', { config: { idempotency: true }, schema: { headers: { type: 'object', properties: { 'X-Tenant': { type: 'string' } } } } }, async () => ({}))
    app.post('/declared', { config: { idempotency: true }, schema: { headers: { type: 'object', properties: { 'idempotency-key': { type: 'string', description: 'ours' } } } } }, async () => ({}))
    await app.ready()
    const paths = app.swagger().paths as Record<string, { post: Operation }>
    for (const path of ['/lower', '/mixed', '/declared']) {
      const keys = (paths[path]!.post.parameters ?? []).filter((p) => p.in === 'header' && p.name.toLowerCase() === 'idempotency-key')
      expect(keys, path).toHaveLength(1)
    }
    expect(paths['/lower']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'authorization', required: true }))
    expect(paths['/lower']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: true }))
    expect(auth).toEqual({ type: 'object', properties: { authorization: { type: 'string' } }, required: ['authorization'] })
    await app.close()
  })
})
