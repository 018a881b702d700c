/**
 * A route's `key` function: the key comes from the request (a webhook's event id) rather than the
 * Idempotency-Key header, read after the route's own hooks, over real HTTP. The webhook here
 * follows Standard Webhooks: `webhook-id`, `webhook-timestamp`, and `webhook-signature` (an
 * HMAC-SHA256 over `id.timestamp.body`), checked over the raw body in the route's preHandler.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createHmac, timingSafeEqual } from 'node:crypto'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { newKey } from './helpers/app.js'

const SECRET = Buffer.from('whsec-test-secret-of-this-suite')

function sign (id: string, timestamp: string, body: string): string {
  return `v1,${createHmac('sha256', SECRET).update(`${id}.${timestamp}.${body}`).digest('base64')}`
}

/** Standard Webhooks: one of the space-separated `v1,<base64>` signatures matches. */
function verified (request: FastifyRequest & { rawBody?: string }): boolean {
  const id = String(request.headers['webhook-id'])
  const timestamp = String(request.headers['webhook-timestamp'])
  const expected = Buffer.from(sign(id, timestamp, request.rawBody ?? ''))
  return String(request.headers['webhook-signature'] ?? '').split(' ').some((candidate) => {
    const given = Buffer.from(candidate)
    return given.length === expected.length && timingSafeEqual(given, expected)
  })
}

let app: FastifyInstance
let base = ''
const handled: string[] = []

beforeAll(async () => {
  app = Fastify()
  await app.register(idempotency)
  app.setErrorHandler(idempotencyErrorHandler())
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (request, body, done) => {
    (request as FastifyRequest & { rawBody?: string }).rawBody = body as string
    try {
      done(null, JSON.parse(body as string))
    } catch (error) {
      done(error as Error)
    }
  })
  const checkSignature = async (request: FastifyRequest) => {
    if (!verified(request)) throw Object.assign(new Error('invalid signature'), { statusCode: 401 })
  }
  app.post('/webhooks/standard', {
    preHandler: checkSignature,
    config: { idempotency: { required: true, key: (request) => request.headers['webhook-id'] as string | undefined } }
  }, async (request) => {
    handled.push(String(request.headers['webhook-id']))
    return { received: (request.body as { type: string }).type, run: handled.length }
  })
  // Stripe's events carry their id in the body: read once the body is validated.
  app.post('/webhooks/body', {
    schema: { body: { type: 'object', required: ['id'], properties: { id: { type: 'string' } } } },
    config: { idempotency: { key: async (request) => (request.body as { id: string }).id } }
  }, async (request) => {
    handled.push((request.body as { id: string }).id)
    return { run: handled.length }
  })
  app.post('/optional', { config: { idempotency: { key: (request) => request.headers['x-event'] as string | undefined } } }, async () => {
    handled.push('optional')
    return { run: handled.length }
  })
  base = await app.listen({ port: 0, host: '127.0.0.1' })
})
afterAll(async () => { await app.close() })

async function deliver (id: string, body: object, signature?: string): Promise<{ status: number, body: string, replayed: boolean }> {
  const text = JSON.stringify(body)
  const timestamp = String(Math.floor(Date.now() / 1000))
  const res = await fetch(`${base}/webhooks/standard`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'webhook-id': id, 'webhook-timestamp': timestamp, 'webhook-signature': signature ?? sign(id, timestamp, text) },
    body: text
  })
  return { status: res.status, body: await res.text(), replayed: res.headers.get('idempotent-replayed') === 'true' }
}

describe('a route whose key comes from a function', () => {
  it('handles a webhook event once: the provider\'s retries of the event id get the stored answer', async () => {
    const id = newKey('msg')
    const first = await deliver(id, { type: 'invoice.paid' })
    expect(first.status).toBe(200)
    const retry = await deliver(id, { type: 'invoice.paid' })
    expect(retry).toEqual({ ...first, replayed: true })
    expect(handled.filter((seen) => seen === id)).toHaveLength(1)
  })

  it('refuses an invalid signature before the key is read: nothing is stored, and the genuine event then runs', async () => {
    const id = newKey('forged')
    const forged = await deliver(id, { type: 'invoice.paid' }, 'v1,AAAA')
    expect(forged.status).toBe(401)
    const genuine = await deliver(id, { type: 'invoice.paid' })
    expect(genuine.status).toBe(200)
    expect(genuine.replayed).toBe(false)
    expect(handled.filter((seen) => seen === id)).toHaveLength(1)
  })

  it('refuses the same event id with another body as a mismatch (409)', async () => {
    const id = newKey('reused')
    await deliver(id, { type: 'invoice.paid' })
    const other = await deliver(id, { type: 'invoice.voided' })
    expect(other.status).toBe(409)
    expect(JSON.parse(other.body).type).toMatch(/#fingerprint-mismatch$/)
  })

  it('reads a key from the validated body, and lets the body schema refuse a body without it', async () => {
    const id = newKey('evt')
    const post = (body: object) => app.inject({ method: 'POST', url: '/webhooks/body', payload: body })
    const first = await post({ id, object: 'event' })
    const again = await post({ id, object: 'event' })
    expect(again.json()).toEqual(first.json())
    expect(again.headers['idempotent-replayed']).toBe('true')
    expect((await post({ object: 'event' })).statusCode).toBe(400)
  })

  it('without a key: passes through unguarded, or 400 when the route requires one; a key that is not printable ASCII is 400', async () => {
    const before = handled.length
    await app.inject({ method: 'POST', url: '/optional', payload: {} })
    await app.inject({ method: 'POST', url: '/optional', payload: {} })
    expect(handled.length).toBe(before + 2)
    const missing = await app.inject({ method: 'POST', url: '/webhooks/standard', payload: {} })
    expect(missing.statusCode).toBe(401)
    const unsigned = await fetch(`${base}/optional`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-event': 'é-not-ascii' }, body: '{}' })
    expect(unsigned.status).toBe(400)
    expect(((await unsigned.json()) as { type: string }).type).toMatch(/#key-invalid$/)
  })

  it('ignores the Idempotency-Key header on such a route', async () => {
    const key = newKey('ignored')
    const post = () => app.inject({ method: 'POST', url: '/optional', headers: { 'idempotency-key': key }, payload: {} })
    const before = handled.length
    await post()
    await post()
    expect(handled.length).toBe(before + 2)
  })

  it('refuses a key that is not a function when the route is added', async () => {
    const other = Fastify()
    await other.register(idempotency)
    expect(() => other.post('/x', { config: { idempotency: { key: 'webhook-id' as never } } }, async () => ({}))).toThrow(/key/)
    await other.close()
  })
})
