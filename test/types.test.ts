/**
 * Public types. The assertions are checked by `npm run typecheck` (tsc over test/), the
 * `@ts-expect-error` lines fail it if a wrong use stops being an error; vitest runs the rest.
 */
import { describe, expectTypeOf, it } from 'vitest'
import Fastify, { type FastifyRequest, type RouteShorthandOptions } from 'fastify'
import idempotency, {
  idempotency as named,
  IdempotencyError,
  IdempotencyFingerprintMismatchError,
  idempotencyErrorHandler,
  isIdempotencyError,
  IdempotencyStoredResponseUnreadableError,
  MemoryStorage,
  scopeByHeader,
  type BeginResult,
  type EncryptionOptions,
  type Redact,
  type FingerprintOptions,
  type IdempotencyRequestContext,
  type IdempotencyOptions,
  type IdempotencyStorage,
  type StoredResponse
} from '../lib/index.js'
import { transactionOf } from '../lib/knex.js'
import type { Knex } from 'knex'

describe('public types', () => {
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

  it('types request.idempotency and transactionOf', () => {
    const app = Fastify()
    app.post('/o', { config: { idempotency: { transaction: true } } }, async (request) => {
      expectTypeOf(request.idempotency).toEqualTypeOf<IdempotencyRequestContext | null>()
      expectTypeOf(transactionOf(request)).toEqualTypeOf<Knex.Transaction>()
      return { key: request.idempotency?.key }
    })
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
})
