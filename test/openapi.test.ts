/**
 * What guarded routes add to @fastify/swagger's document, through `idempotencyTransform`: the key
 * header, the replay header, the problem answers, never in place of what a route declares itself
 * (a specific status, `4xx`, `5xx`, `default`), on JSON Schema, TypeBox and zod routes (through
 * fastify-type-provider-zod's own transform), and a `$ref` headers schema. The route's compiled
 * schemas are never touched: its answers are tested over HTTP in test/composition.test.ts.
 */
import { describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance, type RouteOptions } from 'fastify'
import swagger from '@fastify/swagger'
import { Type, type TypeBoxTypeProvider } from '@fastify/type-provider-typebox'
import { jsonSchemaTransform, serializerCompiler, validatorCompiler, type ZodTypeProvider } from 'fastify-type-provider-zod'
import { z } from 'zod'
import idempotency, { idempotencyErrorHandler, idempotencyTransform, type IdempotencyOptions } from '../lib/index.js'

type Parameter = { in: string, name: string, required: boolean, description?: string }
type Response = { description?: string, headers?: Record<string, unknown>, content?: Record<string, { schema: Record<string, unknown> }> }
type Operation = { parameters?: Parameter[], responses: Record<string, Response> }

const OPENAPI = { info: { title: 'orders', version: '1' } }

async function documentOf (app: FastifyInstance): Promise<Record<string, { post: Operation }>> {
  await app.ready()
  const paths = app.swagger().paths as Record<string, { post: Operation }>
  await app.close()
  return paths
}

async function document (options: IdempotencyOptions = {}) {
  const app = Fastify()
  await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform() })
  await app.register(idempotency, options)
  app.setErrorHandler(idempotencyErrorHandler())
  const shared = { type: 'object', properties: { id: { type: 'string' } } }
  app.post('/orders', { config: { idempotency: true }, schema: { response: { 201: shared } } }, async (_req, reply) => { reply.code(201); return { id: 'o1', hidden: true } })
  app.post('/payments', { config: { idempotency: { required: true } } }, async () => ({ ok: true }))
  app.post('/plain', { schema: { response: { 201: shared } } }, async () => ({}))
  return { paths: await documentOf(app), shared }
}

const keyHeader = (operation: Operation) => (operation.parameters ?? []).filter((p) => p.in === 'header' && p.name.toLowerCase() === 'idempotency-key')

describe('OpenAPI through @fastify/swagger and idempotencyTransform', () => {
  it('documents the Idempotency-Key header, optional or required as configured', async () => {
    const { paths } = await document()
    expect(paths['/orders']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: false }))
    expect(paths['/payments']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: true }))
    expect(paths['/plain']!.post.parameters ?? []).toEqual([])
  })

  it('documents the replay header on success and the problem+json answers', async () => {
    const { paths, shared } = await document()
    const orders = paths['/orders']!.post.responses
    expect(orders['201']!.headers).toHaveProperty('Idempotent-Replayed')
    for (const code of ['400', '409', '503']) expect(orders[code]!.content).toHaveProperty(['application/problem+json'])
    expect(paths['/payments']!.post.responses['2XX']!.headers).toHaveProperty('Idempotent-Replayed')
    expect(paths['/plain']!.post.responses['409']).toBeUndefined()
    expect(shared).toEqual({ type: 'object', properties: { id: { type: 'string' } } })
  })

  it('follows the options: 422 for a mismatch, no 503 with failOpen, no replay header when disabled', async () => {
    const { paths } = await document({ mismatchStatusCode: 422, failOpen: true, replayHeader: false })
    const orders = paths['/orders']!.post.responses
    expect(orders['422']!.content).toHaveProperty(['application/problem+json'])
    expect(orders['503']).toBeUndefined()
    expect(orders['201']!.headers ?? {}).not.toHaveProperty('Idempotent-Replayed')
  })

  it('never takes the place of what the route declares: a specific status, 4xx, 5xx and default keep their own schema, the problem beside it', async () => {
    const app = Fastify()
    await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform() })
    await app.register(idempotency)
    const error = { type: 'object', description: 'An error of ours', properties: { error: { type: 'string' } } }
    const config = { idempotency: true }
    app.post('/specific', { config, schema: { response: { 201: { type: 'object' }, 409: error } } }, async () => ({}))
    app.post('/ranges', { config, schema: { response: { '2xx': { type: 'object' }, '4xx': error, '5xx': error } } }, async () => ({}))
    app.post('/default', { config, schema: { response: { default: error } } }, async () => ({}))
    app.post('/content', { config, schema: { response: { '4xx': { description: 'Ours', content: { 'application/json': { schema: error } } } } } }, async () => ({}))
    const paths = await documentOf(app)
    const own = { schema: expect.objectContaining({ properties: { error: { type: 'string' } } }) }
    const problem = { schema: expect.objectContaining({ required: ['type', 'title', 'status'] }) }

    const specific = paths['/specific']!.post.responses
    expect(specific['409']).toEqual({ description: 'An error of ours', content: { 'application/json': own, 'application/problem+json': problem } })
    expect(specific['400']!.content).toEqual({ 'application/problem+json': problem })

    const ranges = paths['/ranges']!.post.responses
    expect(Object.keys(ranges).sort()).toEqual(['2XX', '4XX', '5XX'])
    expect(ranges['4XX']!.content).toEqual({ 'application/json': own, 'application/problem+json': problem })
    expect(ranges['4XX']!.content!['application/problem+json']!.schema.description).toMatch(/400: .*; 409: /)
    expect(ranges['5XX']!.content).toEqual({ 'application/json': own, 'application/problem+json': problem })
    expect(ranges['2XX']!.headers).toHaveProperty('Idempotent-Replayed')

    const fallback = paths['/default']!.post.responses
    expect(Object.keys(fallback)).toEqual(['default'])
    expect(fallback.default!.content).toEqual({ 'application/json': own, 'application/problem+json': problem })
    expect(fallback.default!.headers).toHaveProperty('Idempotent-Replayed')

    expect(paths['/content']!.post.responses['4XX']).toEqual({ description: 'Ours', content: { 'application/json': own, 'application/problem+json': problem } })
  })

  it('documents the key on routes with their own headers schema, whatever the case of its names, and never twice', async () => {
    const app = Fastify()
    await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform() })
    await app.register(idempotency, { required: true })
    const auth = { type: 'object', properties: { authorization: { type: 'string' } }, required: ['authorization'] }
    app.post('/lower', { config: { idempotency: true }, schema: { headers: auth } }, async () => ({}))
    app.post('/mixed', { config: { idempotency: true }, schema: { headers: { type: 'object', properties: { 'X-Tenant': { type: 'string' } } } } }, async () => ({}))
    app.post('/declared', { config: { idempotency: true }, schema: { headers: { type: 'object', properties: { 'idempotency-key': { type: 'string', description: 'ours' } } } } }, async () => ({}))
    const paths = await documentOf(app)
    for (const path of ['/lower', '/mixed', '/declared']) expect(keyHeader(paths[path]!.post), path).toHaveLength(1)
    expect(paths['/lower']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'authorization', required: true }))
    expect(paths['/lower']!.post.parameters).toContainEqual(expect.objectContaining({ in: 'header', name: 'idempotency-key', required: true }))
    expect(keyHeader(paths['/declared']!.post)[0]!.description).toBe('ours')
    expect(auth).toEqual({ type: 'object', properties: { authorization: { type: 'string' } }, required: ['authorization'] })
  })

  it('documents the key beside a headers schema given as a $ref to a shared schema, or as a combinator', async () => {
    const app = Fastify()
    await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform() })
    await app.register(idempotency)
    app.addSchema({ $id: 'tenantHeaders', type: 'object', properties: { 'x-tenant': { type: 'string' } }, required: ['x-tenant'] })
    app.post('/ref', { config: { idempotency: true }, schema: { headers: { $ref: 'tenantHeaders#' } } }, async () => ({}))
    app.post('/all-of', { config: { idempotency: true }, schema: { headers: { allOf: [{ $ref: 'tenantHeaders#' }] } } }, async () => ({}))
    const paths = await documentOf(app)
    for (const path of ['/ref', '/all-of']) {
      expect(keyHeader(paths[path]!.post), path).toEqual([expect.objectContaining({ required: false })])
      expect(paths[path]!.post.parameters, path).toContainEqual(expect.objectContaining({ in: 'header', name: 'x-tenant', required: true }))
    }
  })

  it('on TypeBox routes', async () => {
    const app = Fastify().withTypeProvider<TypeBoxTypeProvider>()
    await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform() })
    await app.register(idempotency)
    app.post('/products', {
      config: { idempotency: { required: true } },
      schema: { body: Type.Object({ name: Type.String() }), response: { 201: Type.Object({ id: Type.Integer() }), '4xx': Type.Object({ error: Type.String() }) } }
    }, async (_request, reply) => await reply.code(201).send({ id: 1 }))
    const responses = (await documentOf(app as unknown as FastifyInstance))['/products']!.post
    expect(keyHeader(responses)).toEqual([expect.objectContaining({ required: true })])
    expect(responses.responses['201']!.headers).toHaveProperty('Idempotent-Replayed')
    expect(Object.keys(responses.responses['4XX']!.content!).sort()).toEqual(['application/json', 'application/problem+json'])
  })

  it("on zod routes, after fastify-type-provider-zod's jsonSchemaTransform", async () => {
    const app = Fastify()
    app.setValidatorCompiler(validatorCompiler)
    app.setSerializerCompiler(serializerCompiler)
    await app.register(swagger, { openapi: OPENAPI, transform: idempotencyTransform(jsonSchemaTransform) })
    await app.register(idempotency)
    app.withTypeProvider<ZodTypeProvider>().post('/transfers', {
      config: { idempotency: { required: true } },
      schema: { body: z.object({ amount: z.number() }), response: { 201: z.object({ id: z.string() }), 409: z.object({ error: z.string() }) } }
    }, async (_request, reply) => await reply.code(201).send({ id: 't1' }))
    const operation = (await documentOf(app))['/transfers']!.post as Operation & { requestBody: { content: Record<string, { schema: Record<string, unknown> }> } }
    expect(operation.requestBody.content['application/json']!.schema).toMatchObject({ type: 'object', properties: { amount: { type: 'number' } } })
    expect(keyHeader(operation)).toEqual([expect.objectContaining({ required: true })])
    expect(operation.responses['201']!.headers).toHaveProperty('Idempotent-Replayed')
    expect(operation.responses['409']!.content).toEqual({
      'application/json': { schema: expect.objectContaining({ properties: { error: { type: 'string' } } }) },
      'application/problem+json': { schema: expect.objectContaining({ required: ['type', 'title', 'status'] }) }
    })
    expect(operation.responses['400']!.content).toHaveProperty(['application/problem+json'])
  })

  it("a route with a swaggerTransform of its own, wrapped the same way, and what the document says without the plugin's transform", async () => {
    const app = Fastify()
    await app.register(swagger, { openapi: OPENAPI })
    await app.register(idempotency)
    const own = ({ schema, url }: { schema: object, url: string }) => ({ schema: { ...schema, summary: 'Pay' }, url })
    app.post('/pay', { config: { idempotency: true, swaggerTransform: idempotencyTransform(own) } }, async () => ({}))
    app.post('/orders', { config: { idempotency: true }, schema: { response: { 201: { type: 'object' } } } }, async () => ({}))
    const paths = await documentOf(app) as Record<string, { post: Operation & { summary?: string } }>
    expect(paths['/pay']!.post.summary).toBe('Pay')
    expect(keyHeader(paths['/pay']!.post)).toHaveLength(1)
    expect(keyHeader(paths['/orders']!.post)).toHaveLength(0)
    expect(Object.keys(paths['/orders']!.post.responses)).toEqual(['201'])
  })
})

describe('idempotencyTransform on schemas of every shape', () => {
  /** What the transform makes of `schema` for a route guarded with `config` (the schema is handed to the transform alone: Fastify would refuse some of these). */
  async function transformed (schema: Record<string, unknown>, config: object | true = true): Promise<Record<string, any>> {
    const app = Fastify()
    await app.register(idempotency)
    let route: RouteOptions | undefined
    app.addHook('onRoute', (options) => { if (options.method === 'POST') route = options })
    app.post('/x', { config: { idempotency: config } }, async () => ({}))
    await app.ready()
    await app.close()
    return idempotencyTransform()({ schema, url: '/x', route: route! }).schema as Record<string, any>
  }

  it('leaves alone what it cannot read, and what a route already says', async () => {
    expect((await transformed({ headers: true as unknown as object })).headers).toBe(true)
    expect((await transformed({ headers: { type: 'object', properties: 'odd' } })).headers).toEqual({ type: 'object', properties: 'odd' })
    expect((await transformed({ response: 'odd' as unknown as object })).response).toBe('odd')
    const problem = { schema: { type: 'object' } }
    const content = { description: 'Ours', content: { 'application/problem+json': problem } }
    expect((await transformed({ response: { '4xx': content } })).response['4xx']).toBe(content)
    expect((await transformed({ response: { '4xx': true } })).response['4xx']).toBe(true)
  })

  it('keeps what @fastify/swagger would have rendered of an entry it adds the problem to: description, media types, headers, a null body', async () => {
    const response = await transformed({
      produces: ['application/vnd.api+json'],
      response: {
        '2xx': { type: 'object', headers: { 'x-own': { type: 'string' } } },
        409: { type: 'object', 'x-response-description': 'Taken', headers: { 'x-own': { type: 'string' } }, properties: { error: { type: 'string' } } },
        '5xx': { type: 'null', description: 'Down' }
      }
    })
    expect(response.response['409']).toEqual({
      description: 'Taken',
      headers: { 'x-own': { type: 'string' } },
      content: {
        'application/vnd.api+json': { schema: { type: 'object', 'x-response-description': 'Taken', properties: { error: { type: 'string' } } } },
        'application/problem+json': { schema: expect.objectContaining({ description: expect.stringContaining('409: ') }) }
      }
    })
    expect(response.response['5xx']).toEqual({ description: 'Down', content: { 'application/problem+json': expect.any(Object) } })
    expect(response.response['2xx'].headers).toEqual({ 'x-own': { type: 'string' }, 'Idempotent-Replayed': expect.any(Object) })
  })

  it('documents no key header on a route whose key comes from a function of its own, and only its answers', async () => {
    const schema = await transformed({}, { key: (request: { headers: Record<string, unknown> }) => request.headers['x-event-id'] as string })
    expect(schema.headers).toBeUndefined()
    expect(Object.keys(schema.response as object).sort()).toEqual(['2xx', '400', '409', '503'])
    expect((await transformed({})).headers).toEqual({ type: 'object', properties: { 'idempotency-key': expect.any(Object) } })
  })
})
