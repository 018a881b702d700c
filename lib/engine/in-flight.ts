/**
 * The requests of one registration of the plugin that are between their first store call and the
 * end of their settling (their response stored, or their key given back, including the retries of
 * storing it in the background), so that closing the app can wait for them before anything closes
 * the store under them.
 *
 * Entering and leaving cost a map write each: no promise, no timer, until the app closes. Once it
 * is closing, no request enters: a request that has not touched the store yet is refused (a lease
 * taken now could outlive the store), one already in flight is waited for.
 */
import type { RequestState } from './request-state.js'
import type { Reporter } from './report.js'
import { isPromise, type MaybePromise } from './maybe-promise.js'
import type { RouteEngine } from './route-engine.js'

export class InFlight {
  /** Each request in flight, with the reporter of its route (to say what became of it at the bound). */
  readonly #requests = new Map<RequestState, Reporter>()
  #closing = false
  #closed = false
  #drained: (() => void) | null = null

  /** Closing has ended (every request settled, or the bound passed): background work gives up. */
  get closed (): boolean {
    return this.#closed
  }

  /** Track `state` until `leave`; `false` (and not tracked) once the app is closing. */
  enter (state: RequestState, reporter: Reporter): boolean {
    if (this.#closing) return false
    this.#requests.set(state, reporter)
    return true
  }

  leave (state: RequestState): void {
    if (!this.#requests.delete(state)) return
    if (this.#requests.size === 0) this.#drained?.()
  }

  /**
   * Refuse new requests, and wait until every request in flight has left, or `timeout` ms have
   * passed: resolves with those still in flight then (none when all left), and their reporters.
   */
  async drain (timeout: number): Promise<Array<[RequestState, Reporter]>> {
    this.#closing = true
    if (this.#requests.size > 0) {
      // A referenced timer: it is what bounds close, so it must not let the process end before it.
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, timeout)
        this.#drained = () => {
          clearTimeout(timer)
          resolve()
        }
      })
      this.#drained = null
    }
    this.#closed = true
    return [...this.#requests]
  }

  /** How many requests are in flight. */
  get size (): number {
    return this.#requests.size
  }
}

/** Say what became of a request still in flight when closing stopped waiting for it (`drain`). */
export function reportStillInFlight (state: RequestState, reporter: Reporter): void {
  // Still waiting for the store: it holds no lease, and will not run (engine/acquire.ts).
  if (state.phase === 'acquiring') return
  // Its lease is never given back while its handler may still run: a retry would run it alongside.
  const what = state.phase === 'running' ? 'its handler is still running' : 'its response is still being stored'
  reporter.report(state, 'lease-lost', { phase: 'close' }, 'error', `idempotency request still in flight when app.close() stopped waiting for it (closeTimeout): ${what}. Its lease stays held until the response is stored or the lease lapses (within lockTimeout once the app has closed); a retry after that runs the handler again`)
}

/**
 * One store step of a request in flight: `step`'s value (now or later) goes to `then`; if `step`
 * throws or rejects, the request leaves the in-flight registry and the error goes on. Top-level
 * functions and their arguments rather than closures: on a store that answers at once, nothing is
 * allocated.
 */
export function inFlightStep<A, T, R> (
  engine: RouteEngine, state: RequestState, argument: A,
  step: (engine: RouteEngine, state: RequestState, argument: A) => MaybePromise<T>,
  then: (engine: RouteEngine, state: RequestState, value: T) => R
): MaybePromise<R> {
  let value: MaybePromise<T>
  try {
    value = step(engine, state, argument)
  } catch (error) {
    engine.inFlight.leave(state)
    throw error
  }
  if (!isPromise(value)) return then(engine, state, value)
  return value.then((resolved) => then(engine, state, resolved), (error: unknown) => {
    engine.inFlight.leave(state)
    throw error
  })
}
