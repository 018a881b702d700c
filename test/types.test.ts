/**
 * Public types. The assertions are checked by `npm run typecheck` (tsc over test/), the
 * `@ts-expect-error` lines fail it if a wrong use stops being an error; vitest runs the rest.
 */
import { describe, expectTypeOf, it } from 'vitest'
import Fastify, { type FastifyRequest, type RouteShorthandOptions } from 'fastify'
import { createIdempotency, retryDecision as standaloneRetryDecision, IdempotencyLeaseLostError as StandaloneLeaseLost, type RetryDecision as StandaloneRetryDecision, type StandaloneIdempotency } from '../lib/standalone.js'
import idempotency, {
  idempotency as named,
  IdempotencyResultNotRecordedError,
  IdempotencyLeaseLostError,
  IdempotencyRequestInProgressError,
  retryDecision,
  runScope,
  type RetryDecision,
  type IdempotencyApi,
  type RunContext,
  type RunFunction,
  type RunOptions,
  type ValueCodec,
  IdempotencyError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  idempotencyErrorHandler,
  isIdempotencyError,
  IdempotencyOperationNotSupportedError,
  IdempotencyScopeError,
  IdempotencyServerClosingError,
  IdempotencyStoredResponseUnreadableError,
  IdempotencyStoreUnavailableError,
  isBodyNestedTooDeeplyError,
  isBodyTooLargeError,
  isStoreContentionError,
  isStoreTimeoutError,
  isUnreadableEntryError,
  StoreTimeoutError,
  type BodyNestedTooDeeplyError,
  type BodyTooLargeError,
  type StoreContentionError,
  MemoryStorage,
  scopeByHeader,
  UnreadableEntryError,
  type BeginResult,
  type EncryptionOptions,
  type Redact,
  type StoreIf,
  type Scope,
  type FingerprintOptions,
  type IdempotencyRequestContext,
  type IdempotencyOptions,
  type IdempotencyStorage,
  type ForgetResult,
  type InFlightListing,
  type StorageForgetOptions,
  type StorageForgetResult,
  type StoredInspection,
  type StoredResponse,
  type StoredState,
  storeCheckChannel,
  idempotencyTransform,
  type IdempotencyStoreCheckEvent,
  type StoreCheck,
  type StoreProofOptions,
  type TransformInput,
  type TransformResult,
  type IdempotencyTransactionOptions,
  type IsolationLevel,
  type StorageTransaction,
  type TransactionalStorage,
  type TransactionOptions
} from '../lib/index.js'
import { KnexStorage, transactionOf } from '../lib/knex.js'
import { RedisStorage, type RedisStorageOptions } from '../lib/redis.js'
import type { FastifyDynamicSwaggerOptions } from '@fastify/swagger'
import { jsonSchemaTransform } from 'fastify-type-provider-zod'
import type { Knex } from 'knex'

describe('public types', () => {
  it('the start-up proof: a store\'s checks, its options, the event and the option to accept eviction', () => {
    expectTypeOf<IdempotencyStorage['prove']>().toEqualTypeOf<((options: StoreProofOptions) => Promise<StoreCheck[]>) | undefined>()
    expectTypeOf<StoreCheck['outcome']>().toEqualTypeOf<'passed' | 'failed' | 'warning'>()
    expectTypeOf<StoreProofOptions>().toEqualTypeOf<{ wait: boolean, signal?: AbortSignal }>()
    expectTypeOf<IdempotencyStoreCheckEvent['via']>().toEqualTypeOf<'app' | 'command'>()
    expectTypeOf(storeCheckChannel.publish).toBeFunction()
    expectTypeOf<RedisStorageOptions['allowEviction']>().toEqualTypeOf<boolean | undefined>()
    expectTypeOf<RedisStorage['prove']>().returns.resolves.toEqualTypeOf<StoreCheck[]>()
    expectTypeOf<KnexStorage['ready']>().parameter(0).toEqualTypeOf<Partial<StoreProofOptions> | undefined>()
    // @ts-expect-error: outcome is one of three words
    const wrong: StoreCheck = { name: 'x', outcome: 'ok', found: 'x' }
    expectTypeOf(wrong).not.toBeAny()
  })

  it('exports the plugin as default and as `idempotency`', () => {
    expectTypeOf(named).toEqualTypeOf(idempotency)
  })

  it('types the options, fingerprint options included', async () => {
    const options: IdempotencyOptions = {
      storage: new MemoryStorage({ maxEntries: 10 }),
      expiration: '24h',
      lockTimeout: 60_000,
      fingerprint: { body: { include: ['/amount'] }, headers: ['x-tenant'] },
      scope: (request: FastifyRequest) => String(request.headers['x-tenant']),
      mismatchStatusCode: 422,
      replayHeader: false
    }
    const app = Fastify()
    await app.register(idempotency, options)
    // @ts-expect-error 400 is not a mismatch status
    const bad: IdempotencyOptions = { mismatchStatusCode: 400 }
    // @ts-expect-error body pointers are strings
    const badFingerprint: FingerprintOptions = { body: { include: [1] } }
    expectTypeOf(bad).toMatchTypeOf<IdempotencyOptions>()
    expectTypeOf(badFingerprint).toMatchTypeOf<FingerprintOptions>()
    await app.close()
  })

  it('types config.idempotency on routes through FastifyContextConfig', () => {
    const app = Fastify()
    app.post('/a', { config: { idempotency: true } }, async () => ({}))
    app.post('/b', { config: { idempotency: { required: true, expiration: '1h', fingerprint: { query: true } } } }, async () => ({}))
    // Inline literals are inferred generically by Fastify's route overloads (no excess-property
    // check there; the JSON Schema check refuses them at start-up), so check through the type.
    // @ts-expect-error unknown route option
    const typo: RouteShorthandOptions = { config: { idempotency: { requird: true } } }
    // @ts-expect-error storage is plugin-wide only
    const storage: RouteShorthandOptions = { config: { idempotency: { storage: new MemoryStorage() } } }
    // @ts-expect-error a string is not a route config
    const text: RouteShorthandOptions = { config: { idempotency: 'yes' } }
    expectTypeOf([typo, storage, text]).toMatchTypeOf<RouteShorthandOptions[]>()
  })

  it('types encryption (plugin-wide) and redact (per route)', () => {
    const encryption: EncryptionOptions = { keys: [Buffer.alloc(32), 'base64=='], keyHashSecret: Buffer.alloc(32) }
    const redact: Redact = async (response, request) => ({ ...response, headers: { ...response.headers, by: request.method }, bodyOmitted: true })
    const options: IdempotencyOptions = { encryption, redact, scope: scopeByHeader('authorization') }
    expectTypeOf(options.redact).toEqualTypeOf<Redact | undefined>()
    // @ts-expect-error keyHashSecret is required with encryption
    const noSecret: EncryptionOptions = { keys: [Buffer.alloc(32)] }
    // @ts-expect-error encryption is plugin-wide only
    const routeEncryption: RouteShorthandOptions = { config: { idempotency: { encryption } } }
    // @ts-expect-error redact returns a stored response
    const badRedact: Redact = () => 'nothing'
    expectTypeOf([noSecret, routeEncryption, badRedact]).not.toBeAny()
    expectTypeOf(new IdempotencyStoredResponseUnreadableError('k', null)).toMatchTypeOf<IdempotencyError>()
  })

  it('types storeIf (plugin and route): a boolean, or a promise of one, from the response and the request', () => {
    const storeIf: StoreIf = (response, request) => response.statusCode === 201 && Buffer.isBuffer(response.body) && request.method === 'POST'
    const later: StoreIf = async (response) => response.headers['x-keep'] === 'yes'
    const options: IdempotencyOptions = { storeIf }
    expectTypeOf(options.storeIf).toEqualTypeOf<StoreIf | undefined>()
    const route: RouteShorthandOptions = { config: { idempotency: { storeIf: later } } }
    // @ts-expect-error storeIf answers a boolean
    const truthy: StoreIf = () => 'yes'
    // @ts-expect-error storeIf is a function
    const flag: IdempotencyOptions = { storeIf: false }
    expectTypeOf([route, truthy, flag]).not.toBeAny()
  })

  it('types the error of a body the server made unfingerprintable, and what a store throws for a value it cannot read', () => {
    const unsupported = new IdempotencyFingerprintUnsupportedError('k', 'POST /orders', '/items/0', 'the body holds an instance of Point', null)
    expectTypeOf(unsupported).toMatchTypeOf<IdempotencyError>()
    expectTypeOf(unsupported.route).toEqualTypeOf<string>()
    expectTypeOf(unsupported.path).toEqualTypeOf<string>()
    expectTypeOf(new UnreadableEntryError('a later layout')).toMatchTypeOf<Error>()
  })

  it('types the errors: static type and title, instance members, the guard', () => {
    expectTypeOf(IdempotencyFingerprintMismatchError.type).toEqualTypeOf<string>()
    expectTypeOf(IdempotencyFingerprintMismatchError.title).toEqualTypeOf<string>()
    const error = new IdempotencyFingerprintMismatchError('k')
    expectTypeOf(error.statusCode).toEqualTypeOf<number>()
    expectTypeOf(error.idempotencyKey).toEqualTypeOf<string | undefined>()
    expectTypeOf(error).toMatchTypeOf<IdempotencyError>()
    const unknownError: unknown = error
    if (isIdempotencyError(unknownError)) expectTypeOf(unknownError).toEqualTypeOf<IdempotencyError>()
    expectTypeOf(idempotencyErrorHandler).parameter(0).toEqualTypeOf<{ fallback?: Parameters<typeof idempotencyErrorHandler>[0] extends infer O ? O extends { fallback?: infer F } ? F : never : never } | undefined>()
    Fastify().setErrorHandler(idempotencyErrorHandler())
  })

  it('types scope (a caller\'s id, or undefined for none), scopeByHeader and closeTimeout', async () => {
    const byUser: Scope = (request) => request.headers['x-user'] === undefined ? undefined : String(request.headers['x-user'])
    const options: IdempotencyOptions = { scope: byUser, closeTimeout: '5s' }
    const route: RouteShorthandOptions = { config: { idempotency: { scope: async () => null } } }
    expectTypeOf(scopeByHeader('x-api-key')).returns.toEqualTypeOf<string | undefined>()
    // @ts-expect-error a scope returns a string, not a number
    const numeric: Scope = () => 42
    // @ts-expect-error closeTimeout is plugin-wide only
    const routeClose: RouteShorthandOptions = { config: { idempotency: { closeTimeout: '5s' } } }
    expectTypeOf([options, route, numeric, routeClose]).not.toBeAny()
    expectTypeOf(new IdempotencyScopeError('k')).toMatchTypeOf<IdempotencyError>()
    expectTypeOf(new IdempotencyServerClosingError('k')).toMatchTypeOf<IdempotencyError>()
  })

  it('types the errors a cause can be, each with its guard', () => {
    const refused = new IdempotencyStoreUnavailableError('k', new StoreTimeoutError('begin', 5000))
    const cause: unknown = refused.cause
    if (isStoreTimeoutError(cause)) expectTypeOf(cause).toEqualTypeOf<StoreTimeoutError>()
    if (isStoreContentionError(cause)) expectTypeOf(cause).toEqualTypeOf<StoreContentionError>()
    if (isUnreadableEntryError(cause)) expectTypeOf(cause).toEqualTypeOf<UnreadableEntryError>()
    if (isBodyNestedTooDeeplyError(cause)) expectTypeOf(cause).toEqualTypeOf<BodyNestedTooDeeplyError>()
    if (isBodyTooLargeError(cause)) expectTypeOf(cause.statusCode).toEqualTypeOf<number>()
    expectTypeOf<BodyTooLargeError>().toMatchTypeOf<Error>()
  })

  it('types request.idempotency and transactionOf', () => {
    const app = Fastify()
    app.post('/o', { config: { idempotency: { transaction: true } } }, async (request) => {
      expectTypeOf(request.idempotency).toEqualTypeOf<IdempotencyRequestContext | null>()
      expectTypeOf(transactionOf(request)).toEqualTypeOf<Knex.Transaction>()
      return { key: request.idempotency?.key }
    })
  })

  it('types transaction mode\'s isolation level: plugin, route and run', async () => {
    expectTypeOf<IsolationLevel>().toEqualTypeOf<'read committed' | 'repeatable read' | 'serializable'>()
    expectTypeOf<IdempotencyTransactionOptions>().toEqualTypeOf<{ isolationLevel?: IsolationLevel }>()
    expectTypeOf<IdempotencyOptions['transaction']>().toEqualTypeOf<boolean | IdempotencyTransactionOptions | undefined>()
    const app = Fastify()
    app.post('/a', { config: { idempotency: { transaction: { isolationLevel: 'serializable' } } } }, async () => ({}))
    app.post('/b', { config: { idempotency: { transaction: {} } } }, async () => ({}))
    // Through the type, as above: Fastify's route overloads make no excess-property check.
    // @ts-expect-error 'snapshot' is not a level the plugin sets
    const snapshot: RouteShorthandOptions = { config: { idempotency: { transaction: { isolationLevel: 'snapshot' } } } }
    // @ts-expect-error readOnly is not an option of transaction mode
    const readOnly: RouteShorthandOptions = { config: { idempotency: { transaction: { readOnly: true } } } }
    expectTypeOf(snapshot).toEqualTypeOf(readOnly)
    const jobs = createIdempotency()
    const run = async () => await jobs.run('k', null, () => 1, { transaction: { isolationLevel: 'repeatable read' } })
    expectTypeOf(run).returns.resolves.toEqualTypeOf<number>()
    await jobs.close()
  })

  it('types the storage contract of transaction mode', () => {
    expectTypeOf<TransactionOptions>().toEqualTypeOf<{ request?: boolean, isolationLevel?: IsolationLevel, lease?: { key: string, token: string, lockTimeout: number } }>()
    expectTypeOf<StorageTransaction['renew']>().toEqualTypeOf<((key: string, token: string, lockTimeout: number) => Promise<boolean>) | undefined>()
    expectTypeOf<TransactionalStorage['isConflict']>().toEqualTypeOf<((error: unknown) => boolean) | undefined>()
  })

  it('lets a custom class implement the storage contract', () => {
    class Custom implements IdempotencyStorage {
      async begin (_key: string, _fingerprint: string, _lockTimeout: number): Promise<BeginResult> { return { state: 'acquired', token: 't' } }
      async complete (_key: string, _token: string, _response: StoredResponse, _expiration: number): Promise<boolean> { return true }
      async release (_key: string, _token: string): Promise<boolean> { return true }
      async renew (_key: string, _token: string, _lockTimeout: number): Promise<boolean> { return true }
    }
    expectTypeOf(new Custom()).toMatchTypeOf<IdempotencyStorage>()
    expectTypeOf<StoredResponse['body']>().toEqualTypeOf<Buffer>()
    expectTypeOf<BeginResult['state']>().toEqualTypeOf<'acquired' | 'in-flight' | 'completed'>()
  })

  it('types fastify.idempotency, and the optional operations methods of a store', async () => {
    const app = Fastify()
    await app.register(idempotency)
    const inspection = await app.idempotency.inspect('k', { scope: 'acme', body: true, actor: 'alice' })
    expectTypeOf(inspection.state).toEqualTypeOf<'absent' | 'in-flight' | 'stored'>()
    if (inspection.state === 'stored') expectTypeOf(inspection).toEqualTypeOf<StoredInspection>()
    if (inspection.state === 'in-flight') expectTypeOf(inspection.since).toEqualTypeOf<number | null>()
    const forgotten = await app.idempotency.forget('k', { force: true })
    expectTypeOf(forgotten).toEqualTypeOf<ForgetResult>()
    if (forgotten.outcome === 'refused') expectTypeOf(forgotten.lockExpiresAt).toEqualTypeOf<number>()
    const listing: InFlightListing = await app.idempotency.inFlight({ olderThan: '5m', limit: 10 })
    expectTypeOf(listing.leases).items.toHaveProperty('key').toEqualTypeOf<string | null>()
    expectTypeOf(app.idempotency.purge).returns.resolves.toEqualTypeOf<{ purged: number }>()
    // @ts-expect-error: force is forget's alone
    await app.idempotency.inspect('k', { force: true })
    class WithOperations extends MemoryStorage {}
    expectTypeOf<IdempotencyStorage['inspect']>().toEqualTypeOf<((key: string) => Promise<StoredState>) | undefined>()
    expectTypeOf(new WithOperations().forget).toEqualTypeOf<(key: string, options: StorageForgetOptions) => Promise<StorageForgetResult>>()
    expectTypeOf(IdempotencyOperationNotSupportedError).toBeConstructibleWith('inspect', 'Store', 'inspect')
    await app.close()
  })
  it('types run: the result of the function, its context, its options, and the standalone entry', async () => {
    const app = Fastify()
    await app.register(idempotency)
    const total = await app.idempotency.run('job-1', { ids: [1, 2] }, async (context: RunContext) => {
      expectTypeOf(context.key).toEqualTypeOf<string>()
      expectTypeOf(context.transaction).toEqualTypeOf<unknown>()
      return await context.step('sum', () => 3n)
    }, { scope: 'jobs', wait: true, expiration: '1h' })
    expectTypeOf(total).toEqualTypeOf<bigint>()
    const codec: ValueCodec<Date> = { serialize: (date) => date.toISOString(), deserialize: (data) => new Date(data.toString()) }
    expectTypeOf(await app.idempotency.run('job-2', null, () => new Date(), { codec })).toEqualTypeOf<Date>()
    // Type errors only, never called.
    const wrong = async () => {
      // @ts-expect-error: the codec's type is the function's result's
      await app.idempotency.run('job-3', null, () => 'text', { codec })
      // @ts-expect-error: HTTP-only options are not run's
      await app.idempotency.run('job-4', null, () => 1, { headerName: 'x' })
      // @ts-expect-error: HTTP-only options are not createIdempotency's
      createIdempotency({ replayHeader: false })
    }
    expectTypeOf(wrong).toBeFunction()
    const standalone: StandaloneIdempotency = createIdempotency({ storage: new MemoryStorage(), closeTimeout: '2s' })
    expectTypeOf(standalone.run).toEqualTypeOf<IdempotencyApi['run']>()
    expectTypeOf(standalone.close).returns.resolves.toBeVoid()
    expectTypeOf<RunFunction<number>>().returns.toEqualTypeOf<number | Promise<number>>()
    expectTypeOf<RunOptions['scope']>().toEqualTypeOf<string | null | undefined>()
    expectTypeOf(new IdempotencyResultNotRecordedError('k', 'why').reason).toEqualTypeOf<string>()
    expectTypeOf<RunOptions['sharedWithRequests']>().toEqualTypeOf<boolean | undefined>()
    expectTypeOf(new IdempotencyLeaseLostError('k', 'lease-lost').reason).toEqualTypeOf<string>()
    expectTypeOf(new IdempotencyRequestInProgressError('k', 1).leaseEndsInMs).toEqualTypeOf<number>()
    expectTypeOf(runScope).toEqualTypeOf<(scope: string | null) => string>()
    expectTypeOf(standaloneRetryDecision).toEqualTypeOf(retryDecision)
    expectTypeOf<StandaloneRetryDecision>().toEqualTypeOf<RetryDecision>()
    expectTypeOf(StandaloneLeaseLost).toEqualTypeOf(IdempotencyLeaseLostError)
    const decision = retryDecision(new Error('x'))
    expectTypeOf(decision.kind).toEqualTypeOf<'retry' | 'release' | 'done' | 'give-up' | 'failed'>()
    if (decision.kind === 'retry') expectTypeOf(decision.delayMs).toEqualTypeOf<number>()
    if (decision.kind === 'give-up') expectTypeOf(decision.why).toEqualTypeOf<string>()
    // @ts-expect-error: a decision's kind is one of five
    if (decision.kind === 'requeue') expectTypeOf(decision).toBeNever()
    await standalone.close()
    await app.close()
  })

  it("idempotencyTransform is @fastify/swagger's transform, alone or around another one (zod's)", () => {
    const alone: FastifyDynamicSwaggerOptions['transform'] = idempotencyTransform()
    const aroundZod: FastifyDynamicSwaggerOptions['transform'] = idempotencyTransform(jsonSchemaTransform)
    const own = (input: TransformInput): TransformResult => ({ schema: { ...input.schema, summary: 'ours' }, url: input.url })
    expectTypeOf(idempotencyTransform(own)).toEqualTypeOf<(input: TransformInput) => TransformResult>()
    expectTypeOf(alone).not.toBeUndefined()
    expectTypeOf(aroundZod).not.toBeUndefined()
    // @ts-expect-error a transform must return the schema and the URL
    idempotencyTransform((input: TransformInput) => input.url)
  })
})
