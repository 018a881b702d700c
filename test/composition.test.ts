/**
 * Every way a Fastify app is put together that the plugin must hold its promise in, over real HTTP:
 * config set by `onRoute` hooks before and after the plugin and in contexts below it, prefixes,
 * fastify-plugin or not, the `route()` shorthands, routes with response schemas for specific
 * statuses, `4xx`, `5xx` and `default`, zod and TypeBox type providers each with and without
 * @fastify/swagger, and uploads under every fingerprint option. In each, a first request runs the
 * handler, its retry is replayed, the same key with another body gets 409 with the whole problem
 * body, and the handler ran once. A route's own answers are what they are without the plugin.
 * (@fastify/autoload, which loads files, is in test/autoload.test.ts.)
 */
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest, type RouteOptions } from 'fastify'
import fp from 'fastify-plugin'
import multipart from '@fastify/multipart'
import swagger from '@fastify/swagger'
import { Type, type TypeBoxTypeProvider } from '@fastify/type-provider-typebox'
import { jsonSchemaTransform, serializerCompiler, validatorCompiler, type ZodTypeProvider } from 'fastify-type-provider-zod'
import { z } from 'zod'
import idempotency, { IdempotencyFingerprintMismatchError, IdempotencyKeyInvalidError, IdempotencyKeyMissingError, IdempotencyRequestInProgressError, idempotencyErrorHandler, idempotencyTransform, type FingerprintOptions, type IdempotencyOptions } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'
import { transactionOf } from '../lib/knex.js'

const apps: FastifyInstance[] = []
afterEach(async () => { for (const app of apps.splice(0)) await app.close() })

/** An app with the plugin registered as `register` does (default: at the root, with its error handler). */
function newApp (): FastifyInstance {
  const app = Fastify()
  apps.push(app)
  return app
}

async function withPlugin (app: FastifyInstance, options: IdempotencyOptions = {}): Promise<FastifyInstance> {
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  return app
}

const OPENAPI = { openapi: { info: { title: 'orders', version: '1' } } }

/** Handler runs, counted per path. */
const runs = new Map<string, number>()
const ran = (path: string): number => runs.get(path) ?? 0

/** The order handler every composition guards: 201, its run, and a field its schemas strip. */
function order (path: string) {
  return async (request: FastifyRequest, reply: FastifyReply) => {
    runs.set(path, ran(path) + 1)
    reply.code(201)
    return { id: ran(path), sku: (request.body as { sku?: string } | undefined)?.sku ?? null, internal: 'never sent where a schema strips it' }
  }
}

interface Answer { status: number, contentType: string | null, body: string, replayed: boolean }

type Send = (url: string, key: string | undefined, sku: string) => Promise<Answer>

async function answer (res: Response): Promise<Answer> {
  return { status: res.status, contentType: res.headers.get('content-type'), body: await res.text(), replayed: res.headers.get('idempotent-replayed') === 'true' }
}

/** A JSON POST (or `method`) with the key, as a client over HTTP sends it. */
function json (method = 'POST'): Send {
  return async (url, key, sku) => await answer(await fetch(url, {
    method,
    headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) },
    body: JSON.stringify({ sku })
  }))
}

/** A form with a file, as fetch sends it: a new multipart boundary on every call. */
const form: Send = async (url, key, sku) => {
  const body = new FormData()
  body.append('sku', sku)
  body.append('file', new Blob([Buffer.alloc(70_000, sku)]), 'receipt.bin')
  return await answer(await fetch(url, { method: 'POST', headers: key === undefined ? {} : { 'idempotency-key': key }, body }))
}

/** The whole RFC 9457 body of one of the plugin's refusals, as `idempotencyErrorHandler` sends it. */
function problem (error: { type: string, title: string }, status: number, key?: string): object {
  return { type: error.type, title: error.title, status, detail: expect.any(String), ...(key === undefined ? {} : { idempotencyKey: key }) }
}

function expectProblem (refusal: Answer, error: { type: string, title: string }, status: number, key?: string): void {
  expect(refusal.status).toBe(status)
  expect(refusal.contentType).toBe('application/problem+json; charset=utf-8')
  expect(JSON.parse(refusal.body)).toStrictEqual(problem(error, status, key))
}

/** A first run, its replay, a mismatch refused with the whole problem body, and one run of the handler. */
async function expectGuarded (url: string, path: string, send: Send = json()): Promise<Answer> {
  const key = newKey()
  const before = ran(path)
  const first = await send(url, key, 'A1')
  expect(first.status, first.body).toBe(201)
  const retry = await send(url, key, 'A1')
  expect(retry.replayed, retry.body).toBe(true)
  expect(retry.status).toBe(201)
  expect(retry.body).toBe(first.body)
  expect(retry.contentType).toBe(first.contentType)
  expectProblem(await send(url, key, 'B2'), IdempotencyFingerprintMismatchError, 409, key)
  expect(ran(path) - before).toBe(1)
  return first
}

async function listen (app: FastifyInstance): Promise<string> {
  return await app.listen({ host: '127.0.0.1', port: 0 })
}

const requireKey = (route: RouteOptions): void => {
  if (route.method === 'POST') route.config = { ...route.config, idempotency: { required: true } }
}

describe('config.idempotency set by an onRoute hook', () => {
  for (const when of ['before', 'after'] as const) {
    it(`added to the app ${when} the plugin`, async () => {
      const app = newApp()
      if (when === 'before') app.addHook('onRoute', requireKey)
      await withPlugin(app)
      if (when === 'after') app.addHook('onRoute', requireKey)
      app.post(`/${when}`, order(`/${when}`))
      const url = await listen(app)
      await expectGuarded(`${url}/${when}`, `/${when}`)
      expectProblem(await json()(`${url}/${when}`, undefined, 'A1'), IdempotencyKeyMissingError, 400)
    })
  }

  it('added in an encapsulated context below the registration, and by a fastify-plugin plugin registered after it', async () => {
    const app = await withPlugin(newApp())
    await app.register(async (child) => {
      child.addHook('onRoute', requireKey)
      child.post('/child', order('/child'))
    })
    await app.register(fp(async (instance) => { instance.addHook('onRoute', requireKey) }))
    app.post('/wrapped', order('/wrapped'))
    const url = await listen(app)
    await expectGuarded(`${url}/child`, '/child')
    await expectGuarded(`${url}/wrapped`, '/wrapped')
    expectProblem(await json()(`${url}/wrapped`, undefined, 'A1'), IdempotencyKeyMissingError, 400)
  })

  it('that changes the options a route set (with a new object or in place), or takes them away: the final config is the one that counts', async () => {
    const app = await withPlugin(newApp())
    app.addHook('onRoute', (route) => {
      if (route.url === '/changed') route.config = { ...route.config, idempotency: { required: true } }
      if (route.url === '/removed') route.config = { ...route.config, idempotency: false }
      if (route.url === '/in-place') (route.config as { idempotency: { required?: boolean } }).idempotency.required = true
    })
    app.post('/changed', { config: { idempotency: true } }, order('/changed'))
    app.post('/in-place', { config: { idempotency: {} } }, order('/in-place'))
    app.post('/removed', { config: { idempotency: true } }, order('/removed'))
    const url = await listen(app)
    await expectGuarded(`${url}/changed`, '/changed')
    expectProblem(await json()(`${url}/changed`, undefined, 'A1'), IdempotencyKeyMissingError, 400)
    await expectGuarded(`${url}/in-place`, '/in-place')
    expectProblem(await json()(`${url}/in-place`, undefined, 'A1'), IdempotencyKeyMissingError, 400)
    const key = newKey()
    await json()(`${url}/removed`, key, 'A1')
    expect((await json()(`${url}/removed`, key, 'A1')).replayed).toBe(false)
    expect(ran('/removed')).toBe(2)
  })

  it('in a context no registration reaches: the app refuses to start, naming the route', async () => {
    const app = newApp()
    await app.register(async (child) => { await withPlugin(child) })
    await app.register(async (child) => {
      child.addHook('onRoute', requireKey)
      child.post('/orphan', order('/orphan'))
    })
    await expect(app.ready()).rejects.toThrow(/1 route\(s\) would run unguarded:\n- route POST \/orphan sets config\.idempotency, but no registration of the plugin is in its context or above it/)
  })
})

describe('prefixes and the route shorthands', () => {
  it('routes under a prefix, in a plain plugin and in a fastify-plugin one', async () => {
    const app = await withPlugin(newApp())
    await app.register(async (v1) => {
      v1.post('/orders', { config: { idempotency: true } }, order('/v1/orders'))
      await v1.register(async (nested) => { nested.post('/orders', { config: { idempotency: true } }, order('/v1/eu/orders')) }, { prefix: '/eu' })
    }, { prefix: '/v1' })
    await app.register(fp(async (instance) => { instance.post('/flat', { config: { idempotency: true } }, order('/flat')) }))
    const url = await listen(app)
    await expectGuarded(`${url}/v1/orders`, '/v1/orders')
    await expectGuarded(`${url}/v1/eu/orders`, '/v1/eu/orders')
    await expectGuarded(`${url}/flat`, '/flat')
  })

  it('post, put, patch, delete, route() with one method and with several', async () => {
    const app = await withPlugin(newApp())
    const config = { idempotency: true }
    app.post('/post', { config }, order('/post'))
    app.put('/put', { config }, order('/put'))
    app.patch('/patch', { config }, order('/patch'))
    app.delete('/delete', { config }, order('/delete'))
    app.route({ method: 'POST', url: '/route', config, handler: order('/route') })
    app.route({ method: ['POST', 'PUT'], url: '/methods', config, handler: order('/methods') })
    const url = await listen(app)
    await expectGuarded(`${url}/post`, '/post')
    await expectGuarded(`${url}/put`, '/put', json('PUT'))
    await expectGuarded(`${url}/patch`, '/patch', json('PATCH'))
    await expectGuarded(`${url}/delete`, '/delete', json('DELETE'))
    await expectGuarded(`${url}/route`, '/route')
    await expectGuarded(`${url}/methods`, '/methods', json('PUT'))
  })
})

describe('versioned routes: two handlers on one URL (constraints)', () => {
  it('an onRoute hook guards version 2 only; version 1 runs as without the plugin', async () => {
    const app = await withPlugin(newApp())
    app.addHook('onRoute', (route) => { if ((route.constraints as { version?: string } | undefined)?.version === '2.0.0') requireKey(route) })
    for (const version of ['1.0.0', '2.0.0']) app.post('/invoices', { constraints: { version } }, order(`/invoices@${version}`))
    const url = await listen(app)
    const versioned = (version: string): Send => async (target, key, sku) => await answer(await fetch(target, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'accept-version': version, ...(key === undefined ? {} : { 'idempotency-key': key }) },
      body: JSON.stringify({ sku })
    }))
    await expectGuarded(`${url}/invoices`, '/invoices@2.0.0', versioned('2.x'))
    const key = newKey()
    await versioned('1.x')(`${url}/invoices`, key, 'A1')
    expect((await versioned('1.x')(`${url}/invoices`, key, 'A1')).replayed).toBe(false)
    expect(ran('/invoices@1.0.0')).toBe(2)
  })
})

/** Its own 4xx answer, which the route's schemas serialize. */
async function refuse (request: FastifyRequest, reply: FastifyReply) {
  reply.code(422)
  return { error: 'out of stock', internal: `sku ${(request.body as { sku: string }).sku}` }
}

const strips = (properties: Record<string, object>) => ({ type: 'object', properties })

/** Routes whose response schemas cover the plugin's statuses: specific ones, ranges, `default`. */
const SCHEMAS: Record<string, Record<string, object>> = {
  specific: { 201: strips({ id: { type: 'integer' }, sku: { type: 'string' } }), 400: strips({ error: { type: 'string' } }), 409: strips({ error: { type: 'string' } }), 422: strips({ error: { type: 'string' } }) },
  ranges: { '2xx': strips({ id: { type: 'integer' } }), '4xx': strips({ error: { type: 'string' } }), '5xx': strips({ error: { type: 'string' } }) },
  default: { default: strips({ id: { type: 'integer' }, error: { type: 'string' } }) }
}

async function schemaRoutes (app: FastifyInstance, guarded: boolean): Promise<void> {
  for (const [name, response] of Object.entries(SCHEMAS)) {
    const config = guarded ? { idempotency: true } : {}
    app.post(`/${name}`, { config, schema: { response } }, order(`/${name}${guarded ? '' : '-plain'}`))
    app.post(`/${name}/refuse`, { config, schema: { response } }, refuse)
  }
}

describe('routes with response schemas for specific statuses, 4xx, 5xx and default', () => {
  for (const documented of [false, true]) {
    it(`${documented ? 'with' : 'without'} @fastify/swagger: the plugin's refusals are whole problem bodies, the route's own answers as without the plugin`, async () => {
      const app = newApp()
      if (documented) await app.register(swagger, { ...OPENAPI, transform: idempotencyTransform() })
      await withPlugin(app)
      await schemaRoutes(app, true)
      const gate = new Gate()
      app.post('/held', { config: { idempotency: true }, schema: { response: SCHEMAS.specific } }, async () => { await gate.hold(); return { id: 1 } })
      const plain = newApp()
      await schemaRoutes(plain, false)
      const [url, plainUrl] = [await listen(app), await listen(plain)]
      for (const name of Object.keys(SCHEMAS)) {
        const first = await expectGuarded(`${url}/${name}`, `/${name}`)
        const without = await json()(`${plainUrl}/${name}`, undefined, 'A1')
        expect(JSON.parse(first.body), name).toEqual({ ...JSON.parse(without.body), id: ran(`/${name}`) })
        expect(first.body).not.toContain('internal')
        expectProblem(await json()(`${url}/${name}`, 'bad key', 'A1'), IdempotencyKeyInvalidError, 400)
        const own = await json()(`${url}/${name}/refuse`, newKey(), 'A1')
        expect(own, name).toEqual({ ...await json()(`${plainUrl}/${name}/refuse`, undefined, 'A1'), replayed: false })
      }
      const key = newKey()
      const held = json()(`${url}/held`, key, 'A1')
      await gate.entered
      expectProblem(await json()(`${url}/held`, key, 'A1'), IdempotencyRequestInProgressError, 409, key)
      gate.open()
      expect((await held).status).toBe(200)
    })
  }
})

/** A typed route's handler: 201 with its run and its body's sku, and a field its response schema strips. */
function created (path: string) {
  return async (request: FastifyRequest<{ Body: { sku: string } }>, reply: FastifyReply) => {
    runs.set(path, ran(path) + 1)
    const answer = { id: ran(path), sku: request.body.sku, internal: 'never sent where a schema strips it' }
    return await reply.code(201).send(answer)
  }
}

/** Guarded, its answers serialized by its schemas, a bad key refused whole; and the document made, when there is one. */
async function expectTyped (app: FastifyInstance, path: string, documented: boolean): Promise<void> {
  const url = await listen(app)
  const first = await expectGuarded(`${url}${path}`, path)
  expect(JSON.parse(first.body)).toEqual({ id: ran(path), sku: 'A1' })
  expectProblem(await json()(`${url}${path}`, 'bad key', 'A1'), IdempotencyKeyInvalidError, 400)
  if (documented) expect(app.swagger()).toHaveProperty(['paths', path, 'post'])
}

describe('type providers', () => {
  for (const documented of ['without @fastify/swagger', 'with @fastify/swagger and its transform', 'with @fastify/swagger and idempotencyTransform'] as const) {
    it(`fastify-type-provider-zod, ${documented}: a zod body and zod response schemas, 409 included`, async () => {
      const app = newApp()
      app.setValidatorCompiler(validatorCompiler)
      app.setSerializerCompiler(serializerCompiler)
      if (documented !== 'without @fastify/swagger') await app.register(swagger, { ...OPENAPI, transform: documented === 'with @fastify/swagger and its transform' ? jsonSchemaTransform : idempotencyTransform(jsonSchemaTransform) })
      await withPlugin(app)
      app.withTypeProvider<ZodTypeProvider>().post('/zod', {
        config: { idempotency: true },
        schema: {
          body: z.object({ sku: z.string() }),
          response: { 201: z.object({ id: z.number(), sku: z.string() }), 409: z.object({ error: z.string() }), '4xx': z.object({ error: z.string() }) }
        }
      }, created('/zod'))
      await expectTyped(app, '/zod', documented !== 'without @fastify/swagger')
    })
  }

  for (const documented of [false, true]) {
    it(`TypeBox, ${documented ? 'with @fastify/swagger and idempotencyTransform' : 'without @fastify/swagger'}: a TypeBox body and response schemas`, async () => {
      const app = newApp()
      if (documented) await app.register(swagger, { ...OPENAPI, transform: idempotencyTransform() })
      await withPlugin(app)
      app.withTypeProvider<TypeBoxTypeProvider>().post('/typebox', {
        config: { idempotency: true },
        schema: {
          body: Type.Object({ sku: Type.String() }),
          response: { 201: Type.Object({ id: Type.Integer(), sku: Type.String() }), '4xx': Type.Object({ error: Type.String() }) }
        }
      }, created('/typebox'))
      await expectTyped(app, '/typebox', documented)
    })
  }
})

/** Uploads under each fingerprint option, in both of @fastify/multipart's modes. */
const FINGERPRINTS: Record<string, FingerprintOptions> = {
  'the default': {},
  "body: 'raw'": { body: 'raw' },
  'contentType: true': { contentType: true },
  "headers: ['content-type']": { headers: ['content-type'] },
  'method, path and query': { method: true, path: true, query: true }
}

describe('@fastify/multipart under every fingerprint option, each attempt with a boundary of its own', () => {
  const served: FastifyInstance[] = []
  afterAll(async () => { for (const app of served) await app.close() })

  for (const [name, fingerprint] of Object.entries(FINGERPRINTS)) {
    for (const mode of ['stream mode', 'attachFieldsToBody'] as const) {
      it(`${name}, ${mode}`, async () => {
        const app = Fastify()
        served.push(app)
        await app.register(multipart, mode === 'attachFieldsToBody' ? { attachFieldsToBody: true } : {})
        await withPlugin(app, { fingerprint })
        const path = `/uploads/${Object.keys(FINGERPRINTS).indexOf(name)}/${mode === 'stream mode' ? 'stream' : 'attached'}`
        app.post(path, { config: { idempotency: true } }, async (request, reply) => {
          runs.set(path, ran(path) + 1)
          let sku: unknown
          if (mode === 'stream mode') {
            for await (const part of request.parts()) {
              if (part.type === 'field') sku = part.value
              else await part.toBuffer()
            }
          } else {
            sku = (request.body as { sku: { value: string } }).sku.value
          }
          reply.code(201)
          return { id: ran(path), sku }
        })
        const url = await listen(app)
        await expectGuarded(`${url}${path}?tenant=t1`, path, form)
      })
    }
  }
})

/** The app's authentication: a request without `authorization: Bearer ok` is refused 401 before anything else answers it. */
function authenticate (request: FastifyRequest, reply: FastifyReply, done: () => void): void {
  if (request.headers.authorization === 'Bearer ok') {
    done()
    return
  }
  void reply.code(401).send({ error: 'unauthenticated' })
}

type Stage = 'onRequest' | 'preValidation' | 'preHandler'

/** A route hook option with `hook` added last, as an app's onRoute hook adds one. */
function withAuth (route: RouteOptions, stage: Stage): void {
  if (route.method !== 'POST') return
  const existing = route[stage]
  route[stage] = [...(existing === undefined ? [] : Array.isArray(existing) ? existing : [existing]), authenticate] as never
}

/** A POST with or without the app's credentials. */
function authed (signedIn: boolean): Send {
  return async (url, key, sku) => await answer(await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(signedIn ? { authorization: 'Bearer ok' } : {}), ...(key === undefined ? {} : { 'idempotency-key': key }) },
    body: JSON.stringify({ sku })
  }))
}

/**
 * The app's authentication runs before the plugin answers, whatever attached it and in whichever
 * order: no stored answer, no lease, no refusal of the plugin reaches a request it refuses.
 */
async function expectAuthenticatedFirst (url: string, path: string): Promise<void> {
  const before = ran(path)
  const key = newKey()
  const first = await authed(true)(url, key, 'A1')
  expect(first.status, first.body).toBe(201)
  // Not the stored answer: the app refuses the request first.
  const stranger = await authed(false)(url, key, 'A1')
  expect(stranger.status, stranger.body).toBe(401)
  expect(stranger.replayed).toBe(false)
  // Not the plugin's 409 (another body) nor its 400 (no key) either.
  expect((await authed(false)(url, key, 'B2')).status).toBe(401)
  expect((await authed(false)(url, undefined, 'A1')).status).toBe(401)
  // A new key sent without credentials takes no lease: its owner then runs it.
  const fresh = newKey()
  expect((await authed(false)(url, fresh, 'A1')).status).toBe(401)
  expect((await authed(true)(url, fresh, 'A1')).replayed).toBe(false)
  expect((await authed(true)(url, key, 'A1')).replayed).toBe(true)
  expect(ran(path) - before).toBe(2)
}

describe("the app's own hooks run before the plugin answers, whatever the order they were added in", () => {
  for (const stage of ['onRequest', 'preValidation', 'preHandler'] as const) {
    for (const when of ['an onRoute hook added before the plugin', 'an onRoute hook added after the plugin', 'a fastify-plugin plugin registered after the plugin', 'the route options'] as const) {
      it(`${stage}, from ${when}`, async () => {
        const app = newApp()
        const attach = (route: RouteOptions): void => { withAuth(route, stage) }
        if (when === 'an onRoute hook added before the plugin') app.addHook('onRoute', attach)
        await withPlugin(app)
        if (when === 'an onRoute hook added after the plugin') app.addHook('onRoute', attach)
        if (when === 'a fastify-plugin plugin registered after the plugin') await app.register(fp(async (instance) => { instance.addHook('onRoute', attach) }))
        const path = `/auth/${stage}/${when.replaceAll(' ', '-')}`
        app.post(path, { config: { idempotency: { required: true } }, schema: { body: strips({ sku: { type: 'string' } }) }, ...(when === 'the route options' ? { [stage]: authenticate } : {}) }, order(path))
        await expectAuthenticatedFirst(`${await listen(app)}${path}`, path)
      })
    }
  }
})

/** A body schema under Fastify's default Ajv options: it strips `note`, fills in `qty`, coerces `qty` to a number. */
const ORDER_BODY = { type: 'object', additionalProperties: false, required: ['sku'], properties: { sku: { type: 'string' }, qty: { type: 'integer', default: 1 } } }

describe('a body schema set by an onRoute hook: the fingerprint is the body as it arrived, whatever set the schema', () => {
  for (const when of ['the route options', 'an onRoute hook added before the plugin', 'an onRoute hook added after the plugin', 'a fastify-plugin plugin registered after the plugin'] as const) {
    it(`from ${when}: bodies that validation makes the same are different requests`, async () => {
      const app = newApp()
      const attach = (route: RouteOptions): void => { if (route.method === 'POST') route.schema = { ...route.schema, body: ORDER_BODY } }
      if (when === 'an onRoute hook added before the plugin') app.addHook('onRoute', attach)
      await withPlugin(app)
      if (when === 'an onRoute hook added after the plugin') app.addHook('onRoute', attach)
      if (when === 'a fastify-plugin plugin registered after the plugin') await app.register(fp(async (instance) => { instance.addHook('onRoute', attach) }))
      const path = `/schema/${when.replaceAll(' ', '-')}`
      app.post(path, { config: { idempotency: true }, ...(when === 'the route options' ? { schema: { body: ORDER_BODY } } : {}) }, async (request, reply) => {
        runs.set(path, ran(path) + 1)
        return await reply.code(201).send({ id: ran(path), body: request.body })
      })
      const url = `${await listen(app)}${path}`
      const send = async (key: string, body: object): Promise<Answer> => await answer(await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(body) }))
      for (const [sent, same] of [[{ sku: 'A1', note: 'gift' }, { sku: 'A1' }], [{ sku: 'A1', qty: '2' }, { sku: 'A1', qty: 2 }], [{ sku: 'A1' }, { sku: 'A1', qty: 1 }]] as const) {
        const key = newKey()
        const first = await send(key, sent)
        expect(first.status, first.body).toBe(201)
        // Validation made the handler see the other body; the fingerprint did not.
        expect(JSON.parse(first.body).body).toEqual({ qty: 1, ...same })
        expect((await send(key, sent)).replayed).toBe(true)
        expectProblem(await send(key, same), IdempotencyFingerprintMismatchError, 409, key)
      }
      expect(ran(path)).toBe(3)
    })
  }
})

/** `route`'s hooks of `name` as a list (absent, one function or an array). */
function hookList (route: RouteOptions, name: 'onSend' | 'onError'): unknown[] {
  const existing: unknown = route[name]
  return existing === undefined ? [] : Array.isArray(existing) ? existing : [existing]
}

describe('onSend and onError hooks an onRoute hook after the plugin sets by assignment, taking the plugin\'s away', () => {
  it('route.onSend = hook: the response is still stored whole, and the retry gets it with the hook\'s header', async () => {
    const app = newApp()
    await withPlugin(app)
    app.addHook('onRoute', (route) => {
      route.onSend = (_request, reply, payload, done) => { reply.header('x-frame-options', 'DENY'); done(null, payload) }
    })
    const path = '/assigned/onSend'
    app.post(path, { config: { idempotency: true } }, order(path))
    const url = `${await listen(app)}${path}`
    await expectGuarded(url, path)
    const key = newKey()
    await json()(url, key, 'A1')
    const retry = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify({ sku: 'A1' }) })
    expect(retry.headers.get('idempotent-body-omitted')).toBe(null)
    expect(retry.headers.get('x-frame-options')).toBe('DENY')
  })

  it('route.onError = hook: a thrown error that the error handler answers with a cacheable status is still never stored', async () => {
    const app = Fastify()
    apps.push(app)
    await app.register(idempotency)
    // A GraphQL-like error handler: errors answered 200.
    app.setErrorHandler((error, _request, reply) => { void reply.code(200).send({ errors: [(error as Error).message] }) })
    const reported: string[] = []
    app.addHook('onRoute', (route) => {
      route.onError = async (_request, _reply, error) => { reported.push(error.message) }
    })
    const path = '/assigned/onError'
    app.post(path, { config: { idempotency: true } }, async () => {
      runs.set(path, ran(path) + 1)
      throw new Error('payment provider timeout')
    })
    const url = `${await listen(app)}${path}`
    const key = newKey()
    const first = await json()(url, key, 'A1')
    expect(first.status).toBe(200)
    const retry = await json()(url, key, 'A1')
    expect(retry.replayed).toBe(false)
    expect(ran(path)).toBe(2)
    expect(reported).toStrictEqual(['payment provider timeout', 'payment provider timeout'])
  })

  it('the hooks a route had before the assignment are not brought back, and the plugin\'s are on the route once', async () => {
    const app = newApp()
    await withPlugin(app)
    let seen: RouteOptions | undefined
    app.addHook('onRoute', (route) => {
      route.onSend = (_request, _reply, payload, done) => { done(null, payload) }
      route.onError = (_request, _reply, _error, done) => { done() }
      seen = route
    })
    const path = '/assigned/once'
    const own = (_request: FastifyRequest, _reply: FastifyReply, payload: unknown, done: (error: null, payload: unknown) => void): void => { done(null, payload) }
    app.post(path, { config: { idempotency: true }, onSend: own }, order(path))
    await app.ready()
    const sends = hookList(seen!, 'onSend')
    expect(sends).not.toContain(own)
    // The plugin's onSend, the app's, and the plugin's last one (head-bytes.ts), each once.
    expect(sends).toHaveLength(3)
    expect(new Set(sends).size).toBe(3)
    expect(hookList(seen!, 'onError')).toHaveLength(2)
  })
})

describe('an onSend hook after the plugin\'s that never hands the response on', () => {
  // A response signer whose service is down: its error is answered by the error handler, then by
  // Fastify's own when the hook fails that answer too; or a hook that hijacks the reply.
  for (const ending of ['fails every time', 'fails once', 'hijacks the reply'] as const) {
    it(`${ending}: the handler ran once, and its answer is kept for the retry (the lease does not lapse into a second run)`, async () => {
      const app = newApp()
      await withPlugin(app, { lockTimeout: 100, maxLockHold: 200 })
      let failures = ending === 'fails once' ? 1 : Number.POSITIVE_INFINITY
      app.addHook('onRoute', (route) => {
        route.onSend = [...hookList(route, 'onSend') as never[], (_request: FastifyRequest, reply: FastifyReply, payload: unknown, done: (error: Error | null, payload?: unknown) => void): void => {
          if (failures > 0 && ending === 'hijacks the reply') {
            failures = 0
            reply.hijack()
            reply.raw.writeHead(502, { 'content-type': 'text/plain' }).end('bad gateway')
            return
          }
          if (failures-- > 0) {
            done(new Error('signing service down'))
            return
          }
          reply.header('x-signature', 'signed')
          done(null, payload)
        }]
      })
      const path = `/later-onsend/${ending.replaceAll(' ', '-')}`
      app.post(path, { config: { idempotency: true } }, order(path))
      const url = `${await listen(app)}${path}`
      const key = newKey()
      const first = await json()(url, key, 'A1')
      expect(first.status).toBe(ending === 'hijacks the reply' ? 502 : 500)
      // Past the lease and the longest it is renewed.
      await new Promise((resolve) => setTimeout(resolve, 500))
      failures = 0
      const retry = await json()(url, key, 'A1')
      expect(ran(path)).toBe(1)
      expect(retry.replayed, retry.body).toBe(true)
      expect(retry.status).toBe(201)
      expect(JSON.parse(retry.body)).toMatchObject({ id: 1, sku: 'A1' })
    })
  }
})

/**
 * An `onSend` hook that an `onRoute` hook appends to every route, after the plugin's: it fails
 * every answer (a signing service down) until `recover()`.
 */
function failingSigner (app: FastifyInstance): { recover: () => void } {
  let failing = true
  app.addHook('onRoute', (route) => {
    route.onSend = [...hookList(route, 'onSend') as never[], (_request: FastifyRequest, _reply: FastifyReply, payload: unknown, done: (error: Error | null, payload?: unknown) => void): void => {
      if (failing) done(new Error('signing service down'))
      else done(null, payload)
    }]
  })
  return { recover: () => { failing = false } }
}

/** Past the lease (500 ms), once the signer recovers, the retry of `key` replays 201 and the handler ran once. */
async function expectReplayOnceRecovered (signer: { recover: () => void }, url: string, key: string, path: string): Promise<void> {
  await new Promise((resolve) => setTimeout(resolve, 500))
  signer.recover()
  const retry = await json()(url, key, 'A1')
  expect(ran(path)).toBe(1)
  expect(retry.replayed, retry.body).toBe(true)
  expect(retry.status).toBe(201)
}

describe('an onSend hook after the plugin\'s that fails every time, on an answer with a trailer', () => {
  it('the handler ran once, and its answer is kept for the retry, without the trailer Fastify never asked for', async () => {
    const app = newApp()
    await withPlugin(app, { lockTimeout: 100, maxLockHold: 200 })
    const signer = failingSigner(app)
    const path = '/later-onsend/trailer'
    app.post(path, { config: { idempotency: true } }, async (request, reply) => {
      reply.trailer('x-checksum', async () => 'sum')
      return await order(path)(request, reply)
    })
    const url = `${await listen(app)}${path}`
    const key = newKey()
    expect((await json()(url, key, 'A1')).status).toBe(500)
    await expectReplayOnceRecovered(signer, url, key, path)
  })
})

describe('an onSend hook after the plugin\'s that fails every time, for a request whose client left before the handler ran', () => {
  for (const trailer of [false, true]) {
    it(`the handler ran once, and its answer is kept for the retry${trailer ? ' (an answer with a trailer)' : ''}`, async () => {
      const app = newApp()
      await withPlugin(app, { lockTimeout: 100, maxLockHold: 200 })
      const signer = failingSigner(app)
      const path = `/later-onsend/client-left/${trailer ? 'trailer' : 'plain'}`
      const gate = new Gate()
      app.post(path, {
        config: { idempotency: true },
        // The app's own check, slower than the client's patience: the client is gone when the lease is taken.
        preHandler: async () => { await gate.hold() }
      }, async (request, reply) => {
        if (trailer) reply.trailer('x-checksum', async () => 'sum')
        return await order(path)(request, reply)
      })
      const url = `${await listen(app)}${path}`
      const key = newKey()
      const controller = new AbortController()
      const first = fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify({ sku: 'A1' }), signal: controller.signal })
      await gate.entered
      controller.abort()
      await expect(first).rejects.toThrow()
      await new Promise((resolve) => setTimeout(resolve, 50))
      gate.open()
      await vi.waitFor(() => { expect(ran(path)).toBe(1) })
      await expectReplayOnceRecovered(signer, url, key, path)
    })
  }
})

const sqlStores = (await storeCases()).filter((store) => store.knex !== undefined)

for (const store of sqlStores) {
  describe.skipIf(!store.available)(`an onSend hook after the plugin's that fails, in transaction mode, on ${store.name}${store.reason}`, () => {
    afterAll(async () => { await store.cleanup() })

    it('the handler\'s writes commit with its answer, the retry is replayed, and no transaction is left open', async () => {
      const storage = await store.create()
      const knex = store.knex!()
      const table = `composition_orders_${process.pid}_${Date.now()}`
      await knex.schema.createTable(table, (t) => { t.increments('id'); t.string('sku') })
      try {
        const app = newApp()
        await withPlugin(app, { storage, transaction: true, lockTimeout: 200, maxLockHold: 400 })
        const signer = failingSigner(app)
        const path = `/later-onsend/transaction/${store.name}`
        app.post(path, { config: { idempotency: true } }, async (request, reply) => {
          runs.set(path, ran(path) + 1)
          await transactionOf(request).insert({ sku: 'A1' }).into(table)
          reply.code(201)
          return { id: ran(path) }
        })
        const url = `${await listen(app)}${path}`
        // A request that waits for a connection that an open transaction holds gets no answer: 0.
        const send = async (key: string): Promise<Answer | { status: 0, replayed: false, body: string }> => {
          try {
            return await answer(await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify({ sku: 'A1' }), signal: AbortSignal.timeout(5000) }))
          } catch (error) {
            return { status: 0, replayed: false, body: String(error) }
          }
        }
        const keys = [newKey(), newKey(), newKey()]
        // More requests than the pool holds when each keeps its transaction open (SQLite's holds one).
        const firsts = []
        for (const key of keys) firsts.push((await send(key)).status)
        expect(firsts).toStrictEqual([500, 500, 500])
        expect(ran(path)).toBe(3)
        const committed = await knex(table).count({ n: '*' })
        expect(Number(committed[0]!.n)).toBe(3)
        await new Promise((resolve) => setTimeout(resolve, 600))
        signer.recover()
        const retry = await send(keys[0]!)
        expect(retry.replayed, retry.body).toBe(true)
        expect(retry.status).toBe(201)
        expect(ran(path)).toBe(3)
      } finally {
        await knex.schema.dropTableIfExists(table)
      }
    })
  })
}

describe('a preHandler hook of the app that changes the body: the fingerprint is the body before it, with a body schema or without', () => {
  for (const schema of [false, true]) {
    it(`${schema ? 'with' : 'without'} a body schema: an identical retry is replayed, another body refused 409`, async () => {
      const app = newApp()
      await withPlugin(app)
      const path = `/prehandler-body/${schema ? 'schema' : 'none'}`
      app.post(path, {
        config: { idempotency: true },
        ...(schema ? { schema: { body: { type: 'object', properties: { sku: { type: 'string' } } } } } : {}),
        // The app stamps each request's body with when it was received.
        preHandler: async (request) => { (request.body as Record<string, unknown>).receivedAt = process.hrtime.bigint().toString() }
      }, order(path))
      await expectGuarded(`${await listen(app)}${path}`, path)
    })
  }
})

describe('a body the plugin cannot fingerprint, sent to a route whose preHandler hook refuses the request', () => {
  for (const schema of [false, true]) {
    it(`${schema ? 'with' : 'without'} a body schema: the app's refusal answers, not the plugin's`, async () => {
      const app = newApp()
      await withPlugin(app)
      const path = `/unfingerprintable/${schema ? 'schema' : 'none'}`
      app.post(path, {
        config: { idempotency: true },
        ...(schema ? { schema: { body: { type: 'array' } } } : {}),
        preHandler: async (_request, reply) => await reply.code(401).send({ error: 'sign in' })
      }, order(path))
      const deep = `${'['.repeat(1100)}${']'.repeat(1100)}`
      const refused = await answer(await fetch(`${await listen(app)}${path}`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': newKey() }, body: deep }))
      expect(refused.status, refused.body).toBe(401)
      expect(ran(path)).toBe(0)
    })
  }
})
