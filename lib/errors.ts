/**
 * The plugin's errors. Each kind is a class of its own with a problem `type` URI (pointing at its
 * section in docs/errors.md) and a stable `title`, so `idempotencyErrorHandler` can render RFC 9457
 * problem details and users can map them in their own error handler with `isIdempotencyError`.
 */

/** Where each problem `type` URI points: one section of docs/errors.md per error kind. */
export const PROBLEM_TYPE_BASE = 'https://github.com/fastify-idempotency/fastify-idempotency/blob/main/docs/errors.md'

export abstract class IdempotencyError extends Error {
  /** Problem `type`: an absolute URI of this error's documentation. */
  static readonly type: string = `${PROBLEM_TYPE_BASE}#idempotency-errors`
  /** Problem `title`: the same for every occurrence of this kind. */
  static readonly title: string = 'Idempotency error'

  /** HTTP status the error handler answers with. */
  readonly statusCode: number
  /** Fastify-style error code, e.g. `FST_IDEMPOTENCY_FINGERPRINT_MISMATCH`. */
  abstract readonly code: string
  /** The request's `Idempotency-Key` (as sent, after unquoting), when it had a usable one. */
  readonly idempotencyKey: string | undefined
  /** Response headers that belong to this problem (e.g. `Retry-After`). Fastify's own handler sets them too. */
  readonly headers: Record<string, string>

  constructor (message: string, statusCode: number, idempotencyKey: string | undefined, headers: Record<string, string> = {}, options?: ErrorOptions) {
    // A 4xx reports the client's request, not a fault in code: its stack would only point into
    // the plugin's own hooks, and capturing one costs about 5 µs (measured on Node 20), more than
    // the rest of a refusal. A 503 keeps its stack.
    const stackTraceLimit = Error.stackTraceLimit
    if (statusCode < 500) Error.stackTraceLimit = 0
    try {
      super(message, options)
    } finally {
      Error.stackTraceLimit = stackTraceLimit
    }
    this.name = new.target.name
    this.statusCode = statusCode
    this.idempotencyKey = idempotencyKey
    this.headers = headers
  }

  /** This kind's problem `type` URI. */
  get type (): string {
    return (this.constructor as typeof IdempotencyError).type
  }

  /** This kind's problem `title`. */
  get title (): string {
    return (this.constructor as typeof IdempotencyError).title
  }
}

/** A stored or in-flight request used this key with a different fingerprint. */
export class IdempotencyFingerprintMismatchError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#fingerprint-mismatch`
  static override readonly title = 'Idempotency fingerprint mismatch'
  readonly code = 'FST_IDEMPOTENCY_FINGERPRINT_MISMATCH'

  constructor (idempotencyKey: string, statusCode: 409 | 422 = 409) {
    super('The request fingerprint does not match the existing entry for this Idempotency-Key; use a new key for a different operation.', statusCode, idempotencyKey)
  }
}

/** The route requires an `Idempotency-Key` and the request had none. */
export class IdempotencyKeyMissingError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#key-missing`
  static override readonly title = 'Idempotency key missing'
  readonly code = 'FST_IDEMPOTENCY_KEY_MISSING'

  constructor (headerName: string) {
    super(`This operation requires an ${headerName} header.`, 400, undefined)
  }
}

/** The `Idempotency-Key` header is malformed, too long, or sent more than once. */
export class IdempotencyKeyInvalidError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#key-invalid`
  static override readonly title = 'Idempotency key invalid'
  readonly code = 'FST_IDEMPOTENCY_KEY_INVALID'

  constructor (reason: string) {
    super(reason, 400, undefined)
  }
}

/** The request could not be fingerprinted (say, JSON nested too deeply to canonicalize). */
export class IdempotencyFingerprintError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#fingerprint-failed`
  static override readonly title = 'Idempotency fingerprint failed'
  readonly code = 'FST_IDEMPOTENCY_FINGERPRINT_FAILED'

  constructor (idempotencyKey: string, cause: unknown) {
    super('The request body could not be fingerprinted (for example, JSON nested too deeply); simplify it or send it without an Idempotency-Key.', 400, idempotencyKey, {}, { cause })
  }
}

/** A request with this key and the same fingerprint is still being processed. */
export class IdempotencyRequestInProgressError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#request-in-progress`
  static override readonly title = 'Idempotency request in progress'
  readonly code = 'FST_IDEMPOTENCY_REQUEST_IN_PROGRESS'
  /** Seconds until the first request's lease lapses at the latest (also sent as `Retry-After`). */
  readonly retryAfter: number

  constructor (idempotencyKey: string, retryAfterSeconds: number) {
    const retryAfter = Math.max(1, Math.ceil(retryAfterSeconds))
    super('A request with this Idempotency-Key is still being processed; retry after it completes.', 409, idempotencyKey, { 'retry-after': String(retryAfter) })
    this.retryAfter = retryAfter
  }
}

/** The idempotency store could not be reached, so the request was not run (fail closed). */
export class IdempotencyStoreUnavailableError extends IdempotencyError {
  static override readonly type = `${PROBLEM_TYPE_BASE}#store-unavailable`
  static override readonly title = 'Idempotency store unavailable'
  readonly code = 'FST_IDEMPOTENCY_STORE_UNAVAILABLE'

  constructor (idempotencyKey: string, cause: unknown) {
    super('The idempotency store is unavailable, so the request was not processed; retry later.', 503, idempotencyKey, { 'retry-after': '1' }, { cause })
  }
}

/** True for every error this plugin raises. */
export function isIdempotencyError (error: unknown): error is IdempotencyError {
  return error instanceof IdempotencyError
}
