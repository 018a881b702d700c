/**
 * Every operation is reported twice over, as a request's outcome is (engine/report.ts): on its
 * `node:diagnostics_channel` channel, and as a log line (the app's logger, or the command's
 * stderr), whether it succeeded or failed, so an audit sees who looked at or removed what.
 */
import { operationChannels, type IdempotencyOperation, type IdempotencyOperationEvent } from '../diagnostics.js'

/** Where the line goes: `error` is set when the operation failed. */
export type AuditLog = (event: IdempotencyOperationEvent, message: string) => void

/** What an operation says about itself once it is done: its event's fields, and its line. */
export interface Outcome {
  fields: Partial<IdempotencyOperationEvent>
  message: string
}

export class Audit {
  readonly #log: AuditLog
  readonly #via: IdempotencyOperationEvent['via']
  readonly #store: string

  constructor (log: AuditLog, via: IdempotencyOperationEvent['via'], store: string) {
    this.#log = log
    this.#via = via
    this.#store = store
  }

  /**
   * Run `call`, then report what `outcome` says of its result, or its failure, with what `partial`
   * says was done before it (a purge's deleted entries).
   */
  async run<T> (operation: IdempotencyOperation, actor: string | null, fields: Partial<IdempotencyOperationEvent>, subject: string,
    call: () => Promise<T>, outcome: (result: T) => Outcome, partial?: () => Outcome): Promise<T> {
    const started = performance.now()
    const base = { operation, actor, via: this.#via, store: this.#store, ...fields }
    const by = actor === null ? '' : ` by ${actor}`
    let result: T
    try {
      result = await call()
    } catch (error) {
      const done = partial?.()
      this.#report({ ...base, ...done?.fields, error, durationMs: performance.now() - started },
        `idempotency ${operation}${subject}${by} failed${done === undefined ? '' : ` ${done.message}`}: ${String((error as Error)?.message ?? error).replace(/^fastify-idempotency: /, '')}`)
      throw error
    }
    const told = outcome(result)
    this.#report({ ...base, ...told.fields, durationMs: performance.now() - started }, `idempotency ${operation}${subject}${by}: ${told.message}`)
    return result
  }

  #report (event: IdempotencyOperationEvent, message: string): void {
    const channel = operationChannels[event.operation]
    if (channel.hasSubscribers) channel.publish(event)
    this.#log(event, message)
  }
}

/** The part of a pino logger (Fastify's `fastify.log`) an audit line goes to. */
export interface AuditLogger {
  /** Logs at `info` level. */
  info: (object: object, message: string) => void
  /** Logs at `error` level. */
  error: (object: object, message: string) => void
}

/** Audit lines to the app's logger: `info`, or `error` with the failure as `err`. */
export function loggerAudit (log: AuditLogger): AuditLog {
  return (event, message) => {
    const { error, ...fields } = event
    if (error === undefined) log.info({ idempotencyOperation: fields }, message)
    else log.error({ err: error, idempotencyOperation: fields }, message)
  }
}
