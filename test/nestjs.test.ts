/**
 * NestJS 11 on its Fastify adapter, on every store, over real HTTP. Nest installs its own Fastify
 * error handler when it starts, so the plugin's refusals reach Nest's exception filters instead
 * of idempotencyErrorHandler: they must still carry their retry signals, and with the exception
 * filter of docs/frameworks/nestjs.md they are the same problem+json as idempotencyErrorHandler's,
 * and are not logged as errors.
 *
 * The decorators are applied as functions (Reflect.decorate, which is what TypeScript's own output
 * calls): vitest compiles with esbuild and the repository's settings, which have neither
 * experimentalDecorators nor decorator metadata. Nothing here needs metadata: no constructor
 * injection.
 */
import 'reflect-metadata'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { Body, Catch, Controller, Module, Post, UseGuards, type ArgumentsHost, type CallHandler, type CanActivate, type ExceptionFilter, type ExecutionContext, type LoggerService, type MiddlewareConsumer, type NestInterceptor, type NestModule, type Type } from '@nestjs/common'
import { APP_FILTER, NestFactory } from '@nestjs/core'
import { FastifyAdapter, RouteConfig, type NestFastifyApplication } from '@nestjs/platform-fastify'
import { map, type Observable } from 'rxjs'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import idempotency, { IdempotencyError, IdempotencyFingerprintMismatchError, idempotencyErrorHandler, scopeByHeader, toProblem } from '../lib/index.js'
import type { IdempotencyStorage } from '../lib/storage/types.js'
import { newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'
import { storeCases } from './helpers/stores.js'

const cases = await storeCases()

/** The handler of the request the test holds, if any. */
let held: { key: string, gate: Gate } | null = null
let runs = 0

/** Wraps every answer, as many Nest apps do: a replay must give the wrapped shape as sent. */
class EnvelopeInterceptor implements NestInterceptor {
  intercept (_context: unknown, next: CallHandler): Observable<unknown> {
    return next.handle().pipe(map((data: unknown) => ({ data })))
  }
}

class OrdersController {
  async create (body: { key?: string }): Promise<object> {
    const run = ++runs
    if (held !== null && body.key === held.key) await held.gate.hold()
    return { run, received: body }
  }

  async pay (): Promise<object> {
    return { paid: true }
  }

  async secure (): Promise<object> {
    return { secret: 'for holders of the good API key', run: ++runs }
  }
}

const API_KEY = 'good-key'

/** A Nest guard: it runs inside the route's Fastify handler. */
class ApiKeyGuard implements CanActivate {
  canActivate (context: ExecutionContext): boolean {
    return context.switchToHttp().getRequest<FastifyRequest>().headers['x-api-key'] === API_KEY
  }
}

/** Nest middleware: on the Fastify adapter it runs in Fastify's onRequest, before the plugin's hooks. */
function requireApiKey (request: IncomingMessage, response: ServerResponse, next: () => void): void {
  if (request.headers['x-api-key'] === API_KEY) {
    next()
    return
  }
  response.statusCode = 401
  response.end()
}
Reflect.decorate([Controller()], OrdersController)
const method = (name: keyof OrdersController, decorators: MethodDecorator[]): void => {
  Reflect.decorate(decorators, OrdersController.prototype, name, Object.getOwnPropertyDescriptor(OrdersController.prototype, name))
}
method('create', [Post('orders'), RouteConfig({ idempotency: true })])
method('pay', [Post('payments'), RouteConfig({ idempotency: { required: true } })])
method('secure', [Post('secure'), UseGuards(ApiKeyGuard), RouteConfig({ idempotency: true })])
Body()(OrdersController.prototype, 'create', 0)

/** The filter of docs/frameworks/nestjs.md. */
class IdempotencyExceptionFilter implements ExceptionFilter<IdempotencyError> {
  catch (error: IdempotencyError, host: ArgumentsHost): void {
    void host.switchToHttp().getResponse<FastifyReply>()
      .code(error.statusCode)
      .type('application/problem+json')
      .send(toProblem(error))
  }
}
Reflect.decorate([Catch(IdempotencyError)], IdempotencyExceptionFilter)

/** What Nest logged, by level. */
class CapturedLogger implements LoggerService {
  readonly lines: Array<{ level: string, text: string }> = []
  log (message: unknown): void { this.push('log', message) }
  error (message: unknown): void { this.push('error', message) }
  warn (message: unknown): void { this.push('warn', message) }
  debug (message: unknown): void { this.push('debug', message) }
  verbose (message: unknown): void { this.push('verbose', message) }
  fatal (message: unknown): void { this.push('fatal', message) }
  errors (): string[] { return this.lines.filter((line) => line.level === 'error' || line.level === 'fatal').map((line) => line.text) }
  private push (level: string, message: unknown): void { this.lines.push({ level, text: message instanceof Error ? `${message.name}: ${message.message}` : String(message) }) }
}

interface Answer { status: number, headers: Headers, body: string }
type Send = (path: string, key: string | null, body?: object, headers?: Record<string, string>) => Promise<Answer>

function poster (origin: string): Send {
  return async (path, key, body = {}, headers = {}) => {
    const res = await fetch(origin + path, { method: 'POST', headers: { 'content-type': 'application/json', ...headers, ...(key === null ? {} : { 'idempotency-key': key }) }, body: JSON.stringify(body) })
    return { status: res.status, headers: res.headers, body: await res.text() }
  }
}

interface NestSetup {
  /** How the documented filter is registered, if at all. */
  filter?: 'useGlobalFilters' | 'APP_FILTER'
  /** /secure behind requireApiKey. */
  middleware?: boolean
  /** Keys scoped by the API key. */
  scoped?: boolean
}

function appModule ({ filter, middleware = false }: NestSetup): Type {
  class AppModule implements NestModule {
    configure (consumer: MiddlewareConsumer): void {
      if (middleware) consumer.apply(requireApiKey).forRoutes('secure')
    }
  }
  Reflect.decorate([Module({
    controllers: [OrdersController],
    providers: filter === 'APP_FILTER' ? [{ provide: APP_FILTER, useClass: IdempotencyExceptionFilter }] : []
  })], AppModule)
  return AppModule
}

async function nest (storage: IdempotencyStorage, setup: NestSetup = {}): Promise<{ app: NestFastifyApplication, post: Send, logger: CapturedLogger }> {
  const logger = new CapturedLogger()
  const app = await NestFactory.create<NestFastifyApplication>(appModule(setup), new FastifyAdapter(), { logger })
  await app.register(idempotency, { storage, ...(setup.scoped === true ? { scope: scopeByHeader('x-api-key') } : {}) })
  app.useGlobalInterceptors(new EnvelopeInterceptor())
  if (setup.filter === 'useGlobalFilters') app.useGlobalFilters(new IdempotencyExceptionFilter())
  await app.listen(0, '127.0.0.1')
  return { app, post: poster(await app.getUrl()), logger }
}

/** The same routes in a plain Fastify app with idempotencyErrorHandler: the answers to match. */
async function plain (storage: IdempotencyStorage): Promise<{ app: FastifyInstance, post: Send }> {
  const app = Fastify()
  await app.register(idempotency, { storage })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/orders', { config: { idempotency: true } }, async () => ({ data: { plain: true } }))
  app.post('/payments', { config: { idempotency: { required: true } } }, async () => ({ data: { paid: true } }))
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, post: poster(`http://127.0.0.1:${(app.server.address() as { port: number }).port}`) }
}

/** The retry signals of an answer: whether it says when, and whether to retry at all. */
const signals = ({ headers }: Answer): object => ({
  'retry-after': headers.has('retry-after'),
  'retry-after-ms': headers.has('retry-after-ms'),
  'stripe-should-retry': headers.get('stripe-should-retry'),
  'x-should-retry': headers.get('x-should-retry')
})

/**
 * Each refusal a Nest route can meet, made on `post` (the app under test): in progress, mismatch,
 * an invalid key, a missing key. `alike` makes the same refusal on another app over the same store.
 */
async function refusals (post: Send, alike?: Send): Promise<Array<{ name: string, answer: Answer, other?: Answer }>> {
  const found: Array<{ name: string, answer: Answer, other?: Answer }> = []
  const key = newKey()
  const gate = new Gate()
  held = { key, gate }
  const first = post('/orders', key, { key })
  await gate.entered
  found.push({ name: 'in progress', answer: await post('/orders', key, { key }), other: await alike?.('/orders', key, { key }) })
  gate.open()
  held = null
  expect((await first).status).toBe(201)
  found.push({ name: 'mismatch', answer: await post('/orders', key, { key, other: true }), other: await alike?.('/orders', key, { key, other: true }) })
  found.push({ name: 'invalid key', answer: await post('/orders', ''), other: await alike?.('/orders', '') })
  found.push({ name: 'missing key', answer: await post('/payments', null), other: await alike?.('/payments', null) })
  return found
}

for (const store of cases) {
  describe.skipIf(!store.available)(`NestJS on ${store.name}${store.reason}`, () => {
    let storage: IdempotencyStorage
    beforeAll(async () => { storage = await store.create() })
    afterAll(async () => { await store.cleanup() })

    describe('with Nest\'s own exception handling', () => {
      let target: Awaited<ReturnType<typeof nest>>
      beforeAll(async () => { target = await nest(storage) })
      afterAll(async () => { await target.app.close() })

      it('guards a route marked @RouteConfig({ idempotency: true }): a retry replays what the interceptor sent', async () => {
        const key = newKey()
        const first = await target.post('/orders', key, { amount: 1 })
        const replay = await target.post('/orders', key, { amount: 1 })
        expect(JSON.parse(first.body)).toMatchObject({ data: { received: { amount: 1 } } })
        expect([replay.status, replay.headers.get('idempotent-replayed'), replay.body]).toEqual([201, 'true', first.body])
      })

      it('every refusal carries its retry signals: retry after an in-progress 409, never after the others', async () => {
        const found = await refusals(target.post)
        expect(found.map(({ name, answer }) => [name, answer.status, answer.headers.get('x-should-retry'), answer.headers.get('stripe-should-retry')])).toEqual([
          ['in progress', 409, 'true', 'true'],
          ['mismatch', 409, 'false', 'false'],
          ['invalid key', 400, 'false', 'false'],
          ['missing key', 400, 'false', 'false']
        ])
        const inProgress = found[0]!.answer
        expect(Number(inProgress.headers.get('retry-after'))).toBeGreaterThanOrEqual(1)
        expect(Number(inProgress.headers.get('retry-after-ms'))).toBeGreaterThan(0)
        // Nest's own shape, not problem+json: what the documented filter is for.
        expect(inProgress.headers.get('content-type')).toMatch(/^application\/json/)
      })

      it('Nest logs each refusal at error level as an unknown exception (the documented filter stops that)', () => {
        expect(target.logger.errors()).toEqual(expect.arrayContaining([expect.stringMatching(/^IdempotencyRequestInProgressError/), expect.stringMatching(/^IdempotencyKeyMissingError/)]))
      })
    })

    describe('with the documented exception filter, through app.useGlobalFilters', () => {
      let target: Awaited<ReturnType<typeof nest>>
      let reference: Awaited<ReturnType<typeof plain>>
      beforeAll(async () => {
        target = await nest(storage, { filter: 'useGlobalFilters' })
        reference = await plain(storage)
      })
      afterAll(async () => {
        await target.app.close()
        await reference.app.close()
      })

      it('every refusal is the problem+json idempotencyErrorHandler sends, with the same retry signals, and none is logged as an error', async () => {
        for (const { name, answer, other } of await refusals(target.post, reference.post)) {
          expect({ name, status: answer.status, type: answer.headers.get('content-type'), body: JSON.parse(answer.body) }).toEqual({ name, status: other!.status, type: other!.headers.get('content-type'), body: JSON.parse(other!.body) })
          expect({ name, ...signals(answer) }).toEqual({ name, ...signals(other!) })
          expect(answer.headers.get('content-type')).toBe('application/problem+json; charset=utf-8')
        }
        expect(target.logger.errors()).toEqual([])
      })
    })

    it('the documented filter as an APP_FILTER provider: a refusal is problem+json', async () => {
      const target = await nest(storage, { filter: 'APP_FILTER' })
      try {
        const key = newKey()
        await target.post('/orders', key, { amount: 1 })
        const reused = await target.post('/orders', key, { amount: 2 })
        expect([reused.status, reused.headers.get('content-type'), JSON.parse(reused.body).type]).toEqual([409, 'application/problem+json; charset=utf-8', IdempotencyFingerprintMismatchError.type])
        expect(target.logger.errors()).toEqual([])
      } finally {
        await target.app.close()
      }
    })

    describe('a Nest guard runs after the plugin has decided', () => {
      const guarded = async (setup: NestSetup): Promise<{ accepted: Answer, refused: Answer }> => {
        const target = await nest(storage, setup)
        try {
          const key = newKey()
          const accepted = await target.post('/secure', key, {}, { 'x-api-key': API_KEY })
          const refused = await target.post('/secure', key, {}, { 'x-api-key': 'revoked-key' })
          return { accepted, refused }
        } finally {
          await target.app.close()
        }
      }

      it('alone, it never sees a replay: a request it would refuse gets the stored answer', async () => {
        const { accepted, refused } = await guarded({})
        expect(accepted.status).toBe(201)
        expect([refused.status, refused.headers.get('idempotent-replayed'), refused.body]).toEqual([201, 'true', accepted.body])
      })

      it('with keys scoped by the credential, that request runs, and the guard refuses it', async () => {
        const { accepted, refused } = await guarded({ scoped: true })
        expect(accepted.status).toBe(201)
        expect([refused.status, refused.headers.get('idempotent-replayed')]).toEqual([403, null])
      })

      it('with the credential checked in Nest middleware, that request is refused before the plugin', async () => {
        const { accepted, refused } = await guarded({ middleware: true })
        expect(accepted.status).toBe(201)
        expect([refused.status, refused.headers.get('idempotent-replayed'), refused.body]).toEqual([401, null, ''])
      })
    })
  })
}
