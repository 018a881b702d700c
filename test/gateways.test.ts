/**
 * A gateway guarded by the plugin with its defaults: @fastify/http-proxy in front of a real
 * upstream server, over real HTTP on every store. The proxy hands the request's stream on as
 * `request.body`; the plugin counts it by its bytes, puts them back, and the upstream receives
 * them all.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createHash } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import proxy from '@fastify/http-proxy'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

const sha = (bytes: Buffer | string): string => createHash('sha256').update(bytes).digest('hex')

interface Answer { status: number, body: { run?: number, sha?: string, size?: number, type?: string }, replayed: string | null }

for (const store of cases) {
  describe.skipIf(!store.available)(`a gateway (@fastify/http-proxy), on ${store.name}${store.reason}`, () => {
    let upstream: FastifyInstance
    let gateway: FastifyInstance
    let url = ''
    let runs = 0

    beforeAll(async () => {
      upstream = Fastify({ bodyLimit: 4 * 1024 * 1024 })
      // Every body as bytes: what the upstream received is what it hashes.
      upstream.addContentTypeParser('*', { parseAs: 'buffer' }, (_request, body, done) => { done(null, body) })
      upstream.removeContentTypeParser('application/json')
      upstream.addContentTypeParser('application/json', { parseAs: 'buffer' }, (_request, body, done) => { done(null, body) })
      upstream.post('/orders', async (request, reply) => {
        const body = request.body as Buffer
        reply.code(201)
        return { run: ++runs, sha: sha(body), size: body.length }
      })
      await upstream.listen({ host: '127.0.0.1', port: 0 })

      gateway = Fastify({ bodyLimit: 4 * 1024 * 1024 })
      await gateway.register(idempotency, { storage: await store.create() })
      gateway.setErrorHandler(idempotencyErrorHandler())
      await gateway.register(proxy, {
        upstream: `http://127.0.0.1:${(upstream.server.address() as { port: number }).port}`,
        prefix: '/api',
        httpMethods: ['POST'],
        config: { idempotency: true }
      })
      await gateway.listen({ host: '127.0.0.1', port: 0 })
      url = `http://127.0.0.1:${(gateway.server.address() as { port: number }).port}/api/orders`
    })
    afterAll(async () => {
      await gateway?.close()
      await upstream?.close()
      await store.cleanup()
    })

    const post = async (key: string | null, body: string | Buffer, type: string): Promise<Answer> => {
      const headers: Record<string, string> = { 'content-type': type }
      if (key !== null) headers['idempotency-key'] = key
      const res = await fetch(url, { method: 'POST', headers, body })
      return { status: res.status, body: await res.json() as Answer['body'], replayed: res.headers.get('idempotent-replayed') }
    }

    for (const [type, body, other] of [
      ['application/json', '{"amount":5,"currency":"eur"}', '{"amount":6,"currency":"eur"}'],
      ['text/plain', 'pay 5 eur', 'pay 6 eur'],
      ['application/octet-stream', Buffer.alloc(300_000, 7), Buffer.alloc(300_000, 8)]
    ] as Array<[string, string | Buffer, string | Buffer]>) {
      it(`a ${type} POST through the proxy: stored, replayed without reaching the upstream again, another body refused`, async () => {
        const key = newKey('gateway')
        const before = runs
        const first = await post(key, body, type)
        expect(first).toMatchObject({ status: 201, body: { sha: sha(body), size: Buffer.byteLength(body) } })
        const retry = await post(key, body, type)
        expect(retry, JSON.stringify(retry)).toMatchObject({ status: 201, replayed: 'true', body: first.body })
        const refused = await post(key, other, type)
        expect(refused.status).toBe(409)
        expect(refused.body.type).toMatch(/#fingerprint-mismatch$/)
        expect(runs - before).toBe(1)
      })
    }

    it('a keyed body over the route\'s bodyLimit is refused with 413 before it reaches the upstream', async () => {
      const before = runs
      const answer = await post(newKey('gateway'), Buffer.alloc(4 * 1024 * 1024 + 1, 1), 'application/octet-stream')
      expect(answer.status).toBe(413)
      expect(runs).toBe(before)
    })

    it('a request without a key goes through untouched', async () => {
      const answer = await post(null, '{"amount":5}', 'application/json')
      expect(answer).toMatchObject({ status: 201, replayed: null, body: { sha: sha('{"amount":5}') } })
    })
  })
}
