/**
 * `fastify-idempotency/standalone`: the engine for code that runs without Fastify (a worker, a
 * queue consumer, a scheduled job): `createIdempotency({ storage, ... }).run(key, input, fn)`.
 * See docs/jobs.md.
 *
 * @module fastify-idempotency/standalone
 */
export { createIdempotency, type StandaloneIdempotency, type StandaloneOptions } from './run/standalone.js'
export type { IdempotencyApi, RunOptions } from './run/idempotency.js'
export type { RunContext, RunFunction } from './run/function-run.js'
export type { ValueCodec } from './engine/value-codec.js'
export type { Logger } from './engine/report.js'
export type { AuditLogger } from './operations/audit.js'
export { MemoryStorage } from './storage/memory.js'
export {
  IdempotencyError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError,
  isIdempotencyError
} from './errors.js'
