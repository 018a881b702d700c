/**
 * Every store call the plugin makes is bounded by `storeTimeout`, whatever the client library's
 * own settings (a database that accepts connections and never answers, a row locked by another
 * transaction, an exhausted pool, ioredis queueing commands while it reconnects): past it the call is
 * given up and the request gets its answer (503 before the handler, a retry after it).
 *
 * One timer per route, not one per call: pending calls form a linked list, and a tick every
 * `storeTimeout / 8` fails those past their deadline, so a call is given up between `storeTimeout`
 * and `9/8 × storeTimeout` after it began.
 */
import { shareIdentity } from '../storage/error-identity.js'

/** A store call that did not answer within `storeTimeout`. */
export class StoreTimeoutError extends Error {
  /** Fastify's error code. */
  readonly code = 'FST_IDEMPOTENCY_STORE_TIMEOUT'
  constructor (operation: string, timeout: number) {
    super(`fastify-idempotency: the store did not answer ${operation} within ${timeout} ms (storeTimeout)`)
    this.name = 'StoreTimeoutError'
  }
}
shareIdentity(StoreTimeoutError, 'StoreTimeoutError')

interface Pending {
  deadline: number
  operation: string
  reject: (error: Error) => void
  settled: boolean
  previous: Pending | null
  next: Pending | null
}

export class StoreDeadline {
  /** Milliseconds; 0 bounds nothing (a store that cannot hang). */
  readonly timeout: number
  readonly #period: number
  #first: Pending | null = null
  #timer: NodeJS.Timeout | null = null

  constructor (timeout: number) {
    this.timeout = timeout
    this.#period = Math.max(1, Math.floor(timeout / 8))
  }

  /**
   * `call`'s promise, or a rejection with StoreTimeoutError once `storeTimeout` has passed. A call
   * given up may still finish later: `late` then receives its result (to undo a lease taken too
   * late, say).
   */
  run<T> (operation: string, call: () => Promise<T>, late?: (result: T) => void): Promise<T> {
    if (this.timeout === 0) return call()
    let promise: Promise<T>
    try {
      promise = call()
    } catch (error) {
      // A store that throws instead of rejecting is a rejection too.
      return Promise.reject(error)
    }
    return new Promise<T>((resolve, reject) => {
      const pending: Pending = { deadline: Date.now() + this.timeout, operation, reject, settled: false, previous: null, next: this.#first }
      this.#add(pending)
      promise.then((result) => {
        if (pending.settled) {
          late?.(result)
          return
        }
        this.#remove(pending)
        resolve(result)
      }, (error: unknown) => {
        if (pending.settled) return
        this.#remove(pending)
        reject(error)
      })
    })
  }

  /** Stop the timer (the server is closing); calls still pending fail at once. */
  stop (): void {
    while (this.#first !== null) this.#expire(this.#first)
    if (this.#timer !== null) clearInterval(this.#timer)
    this.#timer = null
  }

  #add (pending: Pending): void {
    if (this.#first !== null) this.#first.previous = pending
    this.#first = pending
    if (this.#timer !== null) return
    this.#timer = setInterval(() => { this.#tick() }, this.#period)
    // A call outliving its process is of no concern to anyone.
    this.#timer.unref()
  }

  #remove (pending: Pending): void {
    pending.settled = true
    const { previous, next } = pending
    if (previous === null) this.#first = next
    else previous.next = next
    if (next !== null) next.previous = previous
  }

  #expire (pending: Pending): void {
    this.#remove(pending)
    pending.reject(new StoreTimeoutError(pending.operation, this.timeout))
  }

  #tick (): void {
    if (this.#first === null) {
      if (this.#timer !== null) clearInterval(this.#timer)
      this.#timer = null
      return
    }
    const now = Date.now()
    for (let pending: Pending | null = this.#first; pending !== null;) {
      const next: Pending | null = pending.next
      if (pending.deadline <= now) this.#expire(pending)
      pending = next
    }
  }
}
