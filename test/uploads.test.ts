/**
 * Uploads and bodies the plugin cannot see parsed, over real HTTP/1.1 and HTTP/2 (h2c), and through
 * `app.inject` (as @fastify/aws-lambda serves), on every store: @fastify/multipart in stream mode
 * (the handler reads the body) and with attachFieldsToBody (a circular body), @fastify/formbody,
 * and a custom parser with `fingerprint: { body: 'raw' }`. An HTTP/2 request announces its body
 * with neither Content-Length nor chunked encoding; an injected one is no IncomingMessage.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createHash } from 'node:crypto'
import { connect } from 'node:http2'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance } from 'fastify'
import formbody from '@fastify/formbody'
import multipart from '@fastify/multipart'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { http2Post } from './helpers/http2.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

const sha = (bytes: Buffer): string => createHash('sha256').update(bytes).digest('hex')
/** A file larger than a socket read and a stream's buffer, so reading it ahead really reads. */
const file = (fill: number): Buffer => Buffer.alloc(300_000, fill)

interface Answer { status: number, body: { sha?: string, size?: number, type?: string, [name: string]: unknown }, replayed: string | null }

type Protocol = 'HTTP/1.1' | 'HTTP/2' | 'inject' | 'inject, streamed body'

/** The apps served through `app.inject`, by the host of their `inject:` URL. */
const injected = new Map<string, FastifyInstance>()

/**
 * A POST to `url`: over HTTP/1.1 (`http:`), over HTTP/2 without Content-Length (`h2c:`), or
 * through `app.inject` (`inject:`), as `serve` named it.
 */
async function send (url: string, key: string, body: FormData | URLSearchParams | string, headers: Record<string, string> = {}): Promise<Answer> {
  if (url.startsWith('http:')) {
    const res = await fetch(url, { method: 'POST', headers: { 'idempotency-key': key, ...headers }, body })
    return { status: res.status, body: await res.json() as Answer['body'], replayed: res.headers.get('idempotent-replayed') }
  }
  // The bytes and Content-Type fetch would send (a multipart body with its boundary).
  const encoded = new Request('http://localhost/', { method: 'POST', body, headers })
  const bytes = Buffer.from(await encoded.arrayBuffer())
  const target = new URL(url.replace(/^[a-z0-9]+:/, 'http:'))
  if (url.startsWith('inject:')) {
    // A stream payload comes with no Content-Length.
    const payload = target.host.endsWith('-streamed') ? Readable.from([bytes]) : bytes
    const res = await injected.get(target.host)!.inject({ method: 'POST', url: target.pathname, headers: { 'idempotency-key': key, 'content-type': encoded.headers.get('content-type') ?? 'text/plain' }, payload })
    const replayed = res.headers['idempotent-replayed']
    return { status: res.statusCode, body: res.json(), replayed: replayed === undefined ? null : String(replayed) }
  }
  const session = connect(target.origin)
  try {
    const answer = await http2Post(session, target.pathname, { 'idempotency-key': key, 'content-type': encoded.headers.get('content-type') ?? 'text/plain' }, bytes)
    const replayed = answer.headers.find(([name]) => name === 'idempotent-replayed')?.[1] ?? null
    return { status: answer.status, body: JSON.parse(answer.body.toString()) as Answer['body'], replayed }
  } finally {
    session.close()
  }
}

function upload (bytes: Buffer, name = 'receipt.bin'): FormData {
  const form = new FormData()
  form.append('note', 'monthly')
  form.append('file', new Blob([bytes]), name)
  return form
}

async function serve (storage: IdempotencyStorage, protocol: Protocol, setup: (app: FastifyInstance) => Promise<void>): Promise<{ app: FastifyInstance, url: string, runs: () => number }> {
  const http2 = protocol === 'HTTP/2'
  const app = http2 ? Fastify({ http2, bodyLimit: 2 * 1024 * 1024 }) as unknown as FastifyInstance : Fastify({ bodyLimit: 2 * 1024 * 1024 })
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  await setup(app)
  if (protocol.startsWith('inject')) {
    const host = `app${injected.size}${protocol === 'inject' ? '' : '-streamed'}`
    injected.set(host, app)
    return { app, url: `inject://${host}`, runs: () => runs }
  }
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, url: `${http2 ? 'h2c' : 'http'}://127.0.0.1:${(app.server.address() as { port: number }).port}`, runs: () => runs }
}
let runs = 0

for (const store of cases) {
  describe.skipIf(!store.available)(`uploads and other parsers, on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    /** The same file is one operation; another file under the same key is refused; the handler saw every byte. */
    async function expectTrueFingerprint (url: string, before: number, count: () => number): Promise<void> {
      const key = newKey()
      const first = await send(url, key, upload(file(1)))
      expect(first.status).toBe(201)
      expect(first.body).toMatchObject({ sha: sha(file(1)), size: 300_000 })
      const again = await send(url, key, upload(file(1)))
      expect(again.replayed).toBe('true')
      expect(again.body).toEqual(first.body)
      const other = await send(url, key, upload(file(2)))
      expect(other.status).toBe(409)
      expect(other.body.type).toMatch(/#fingerprint-mismatch$/)
      expect(count() - before).toBe(1)
    }

    for (const protocol of ['HTTP/1.1', 'HTTP/2', 'inject', 'inject, streamed body'] as const) {
      describe(`over ${protocol}`, () => {
        it('@fastify/multipart in stream mode: the handler reads the whole file, and another file under the same key is a mismatch', async () => {
          const { app, url, runs: count } = await serve(storage, protocol, async (app) => {
            await app.register(multipart)
            app.post('/uploads', { config: { idempotency: true } }, async (request, reply) => {
              runs++
              const part = await request.file()
              const bytes = await part!.toBuffer()
              reply.code(201)
              return { sha: sha(bytes), size: bytes.length, name: part!.filename }
            })
          })
          try {
            await expectTrueFingerprint(`${url}/uploads`, count(), count)
          } finally {
            await app.close()
          }
        })

        it('@fastify/multipart with attachFieldsToBody: a circular body is fingerprinted, file bytes included', async () => {
          const { app, url, runs: count } = await serve(storage, protocol, async (app) => {
            await app.register(multipart, { attachFieldsToBody: true })
            app.post('/uploads', { config: { idempotency: true } }, async (request, reply) => {
              runs++
              const body = request.body as { file: { toBuffer: () => Promise<Buffer>, filename: string }, note: { value: string } }
              const bytes = await body.file.toBuffer()
              reply.code(201)
              return { sha: sha(bytes), size: bytes.length, note: body.note.value }
            })
          })
          try {
            await expectTrueFingerprint(`${url}/uploads`, count(), count)
          } finally {
            await app.close()
          }
        })

        it('@fastify/formbody: a form body fingerprints by its fields', async () => {
          const { app, url } = await serve(storage, protocol, async (app) => {
            await app.register(formbody)
            app.post('/forms', { config: { idempotency: true } }, async (request, reply) => { runs++; reply.code(201); return { got: request.body } })
          })
          try {
            const key = newKey()
            expect((await send(`${url}/forms`, key, new URLSearchParams({ amount: '10', currency: 'eur' }))).status).toBe(201)
            expect((await send(`${url}/forms`, key, new URLSearchParams({ currency: 'eur', amount: '10' }))).replayed).toBe('true')
            expect((await send(`${url}/forms`, key, new URLSearchParams({ amount: '11', currency: 'eur' }))).status).toBe(409)
          } finally {
            await app.close()
          }
        })

        it("fingerprint: { body: 'raw' }: a custom parser's value counts by the bytes that came over the wire", async () => {
          const { app, url } = await serve(storage, protocol, async (app) => {
          // A parser that keeps only part of the body: two different bodies parse to the same value.
            app.addContentTypeParser('application/x-order', { parseAs: 'string' }, (_request, body, done) => { done(null, { kind: String(body).split(';')[0] }) })
            app.post('/raw', { config: { idempotency: { fingerprint: { body: 'raw' } } } }, async (request, reply) => { runs++; reply.code(201); return { got: request.body } })
            app.post('/parsed', { config: { idempotency: true } }, async (request, reply) => { runs++; reply.code(201); return { got: request.body } })
          })
          try {
            const headers = { 'content-type': 'application/x-order' }
            const raw = newKey()
            expect((await send(`${url}/raw`, raw, 'refund;amount=10', headers)).status).toBe(201)
            expect((await send(`${url}/raw`, raw, 'refund;amount=10', headers)).replayed).toBe('true')
            expect((await send(`${url}/raw`, raw, 'refund;amount=99', headers)).status).toBe(409)
            // The parsed value alone cannot tell the two apart.
            const parsed = newKey()
            expect((await send(`${url}/parsed`, parsed, 'refund;amount=10', headers)).status).toBe(201)
            expect((await send(`${url}/parsed`, parsed, 'refund;amount=99', headers)).replayed).toBe('true')
          } finally {
            await app.close()
          }
        })
      })
    }
  })
}
