/**
 * One call reports an outcome of a guarded request twice over: to its `node:diagnostics_channel`
 * channel (for metrics and traces) and to the request's log (for people), so the two never
 * disagree and no call site has to remember both.
 */
import { channels, type IdempotencyEvent, type IdempotencyOutcome } from '../diagnostics.js'
import type { RequestState } from './request-state.js'

/** The part of a pino logger the engine writes to (Fastify's `request.log`). */
export interface Logger {
  /** Logs at `debug` level. */
  debug: (object: object, message: string) => void
  /** Logs at `warn` level. */
  warn: (object: object, message: string) => void
  /** Logs at `error` level. */
  error: (object: object, message: string) => void
}

type Level = 'debug' | 'warn' | 'error'

/** Extra event fields; `error` also goes to the log as `err`. */
export type Details = Partial<Pick<IdempotencyEvent, 'statusCode' | 'stored' | 'bodyOmitted' | 'reason' | 'waitedMs' | 'phase' | 'failOpen' | 'error' | 'step'>>

export class Reporter {
  /** The store's class name and the route's URL pattern, in every event. */
  readonly #store: string
  readonly #route: string

  constructor (store: string, route: string) {
    this.#store = store
    this.#route = route
  }

  /**
   * Publish `outcome` for this request (the event is built only when someone listens) and, when
   * `message` is given, log it at `level` with the key and the error.
   */
  report (state: RequestState, outcome: IdempotencyOutcome, details: Details, level?: Level, message?: string): void {
    const channel = channels[outcome]
    if (channel.hasSubscribers) {
      channel.publish({
        outcome,
        idempotencyKey: state.key,
        method: state.method,
        route: this.#route,
        store: this.#store,
        durationMs: performance.now() - state.started,
        ...details
      } satisfies IdempotencyEvent)
    }
    if (level === undefined || message === undefined) return
    const fields = details.error === undefined ? { idempotencyKey: state.key } : { err: details.error, idempotencyKey: state.key }
    state.log[level](fields, message)
  }
}
