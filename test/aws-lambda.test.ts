/**
 * Behind @fastify/aws-lambda (API Gateway REST and HTTP API events turned into app.inject), on
 * every store: a retry gets the first answer back (status, headers, bytes, base64 for binary
 * types), refusals keep their status, problem+json and retry signals in the Lambda result, and
 * keys scoped by the caller's credential stay apart.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { randomUUID } from 'node:crypto'
import awsLambdaFastify from '@fastify/aws-lambda'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, scopeByHeader } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

type Version = '1.0' | '2.0'

/** An API Gateway proxy event of either payload version. */
function event (version: Version, path: string, headers: Record<string, string>, body: string | Buffer): Record<string, unknown> {
  const binary = Buffer.isBuffer(body)
  const common = { headers, body: binary ? body.toString('base64') : body, isBase64Encoded: binary }
  return version === '2.0'
    ? { version, routeKey: `POST ${path}`, rawPath: path, requestContext: { http: { method: 'POST', sourceIp: '203.0.113.7' }, requestId: randomUUID() }, ...common }
    : { httpMethod: 'POST', path, requestContext: { identity: { sourceIp: '203.0.113.7' }, requestId: randomUUID() }, ...common }
}

interface Result { statusCode: number, headers: Record<string, string>, body: string, isBase64Encoded?: boolean }

for (const store of cases) {
  describe.skipIf(!store.available)(`@fastify/aws-lambda on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    let app: FastifyInstance
    let handler: (event: unknown, context: unknown) => Promise<Result>
    let runs = 0
    let held: { key: string, gate: Gate } | null = null
    beforeAll(async () => {
      storage = await store.create()
      app = Fastify()
      await app.register(idempotency, { storage, scope: scopeByHeader('authorization') })
      app.setErrorHandler(idempotencyErrorHandler())
      app.addContentTypeParser('application/octet-stream', { parseAs: 'buffer' }, (_request, body, done) => { done(null, body) })
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        const key = request.headers['idempotency-key']
        if (held !== null && key === held.key) await held.gate.hold()
        reply.code(201).header('location', `/orders/${++runs}`)
        return { run: runs, received: request.body }
      })
      app.post('/receipts', { config: { idempotency: true } }, async (_request, reply) => {
        reply.code(201).type('image/png')
        return Buffer.from([0x89, 0x50, 0x4e, 0x47, 0, 255, ++runs])
      })
      // Before ready: it decorates the request, which Fastify refuses once the app has started.
      handler = awsLambdaFastify(app, { binaryMimeTypes: ['image/png'] }) as unknown as typeof handler
      await app.ready()
    })
    afterAll(async () => {
      await app.close()
      await store.cleanup()
    })

    const json = (key: string, authorization = 'Bearer alice'): Record<string, string> => ({ 'content-type': 'application/json', authorization, 'idempotency-key': key })

    for (const version of ['1.0', '2.0'] as const) {
      describe(`payload version ${version}`, () => {
        it('a retry gets the first answer back: status, headers, body, and the handler does not run again', async () => {
          const key = newKey()
          const first = await handler(event(version, '/orders', json(key), '{"amount":42}'), {})
          const before = runs
          const retry = await handler(event(version, '/orders', json(key), '{"amount":42}'), {})
          expect(first.statusCode).toBe(201)
          expect([retry.statusCode, retry.body, retry.headers.location, retry.headers['idempotent-replayed']]).toEqual([201, first.body, first.headers.location, 'true'])
          expect(runs).toBe(before)
        })

        it('a binary answer is replayed as the same base64 bytes', async () => {
          const key = newKey()
          const headers = { 'content-type': 'application/octet-stream', authorization: 'Bearer alice', 'idempotency-key': key }
          const first = await handler(event(version, '/receipts', headers, Buffer.from([1, 2, 3])), {})
          const retry = await handler(event(version, '/receipts', headers, Buffer.from([1, 2, 3])), {})
          expect(first.isBase64Encoded).toBe(true)
          expect([retry.isBase64Encoded, retry.body, retry.headers['content-type'], retry.headers['idempotent-replayed']]).toEqual([true, first.body, 'image/png', 'true'])
        })

        it('refusals keep their status, problem+json and retry signals in the Lambda result', async () => {
          const key = newKey()
          const gate = new Gate()
          held = { key, gate }
          const first = handler(event(version, '/orders', json(key), '{"amount":1}'), {})
          await gate.entered
          const inProgress = await handler(event(version, '/orders', json(key), '{"amount":1}'), {})
          gate.open()
          held = null
          expect((await first).statusCode).toBe(201)
          expect([inProgress.statusCode, inProgress.headers['content-type'], inProgress.headers['x-should-retry'], inProgress.headers['stripe-should-retry']]).toEqual([409, 'application/problem+json; charset=utf-8', 'true', 'true'])
          expect(Number(inProgress.headers['retry-after'])).toBeGreaterThanOrEqual(1)
          const reused = await handler(event(version, '/orders', json(key), '{"amount":2}'), {})
          expect([reused.statusCode, JSON.parse(reused.body).type, reused.headers['x-should-retry']]).toEqual([409, expect.stringMatching(/#fingerprint-mismatch$/), 'false'])
        })

        it('keys scoped by the authorizer\'s credential: one caller never receives another\'s answer', async () => {
          const key = newKey()
          const alice = await handler(event(version, '/orders', json(key, 'Bearer alice'), '{"amount":5}'), {})
          const bob = await handler(event(version, '/orders', json(key, 'Bearer bob'), '{"amount":5}'), {})
          expect(bob.headers['idempotent-replayed']).toBeUndefined()
          expect(JSON.parse(bob.body).run).not.toBe(JSON.parse(alice.body).run)
        })
      })
    }
  })
}
