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
export { retryDecision, type RetryDecision } from './run/retry-decision.js'
export { runScope } from './engine/storage-key.js'
/** Every error `run` can throw; `retryDecision` says what each means for a message. */
export {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyLeaseLostError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError,
  isIdempotencyError
} from './errors.js'
