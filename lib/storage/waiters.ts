/**
 * Requests waiting, per key, for a lease to end (`waitFor`): one registry for every store, each
 * of which only says when a key's lease may have ended (`wake`), or that it can no longer tell
 * (`wakeAll` with an error: the plugin then polls).
 */

/** setTimeout's longest delay; a longer one fires at once. */
const MAX_TIMER_MS = 2 ** 31 - 1

export interface Waiter {
  /** Resolves when woken or at the timeout; rejects when woken with an error. */
  readonly promise: Promise<void>
  /** Wake this waiter alone (with `error`, it rejects). Later calls do nothing. */
  settle: (error?: unknown) => void
  /** Time out sooner than asked, `ms` from now (a lease known to lapse before the timeout). */
  shorten: (ms: number) => void
  readonly settled: boolean
}

export class KeyWaiters {
  readonly #byKey = new Map<string, Set<Waiter>>()
  /** Called when the last waiter of a key is gone (a store unsubscribes from it, say). */
  readonly #onIdle: (key: string) => void

  constructor (onIdle: (key: string) => void = () => {}) {
    this.#onIdle = onIdle
  }

  /** Whether anybody waits for `key` now. */
  has (key: string): boolean {
    return this.#byKey.has(key)
  }

  /** A new waiter for `key`, resolved after `timeout` ms unless woken first. */
  add (key: string, timeout: number): Waiter {
    let waiters = this.#byKey.get(key)
    if (waiters === undefined) this.#byKey.set(key, (waiters = new Set()))
    const set = waiters
    let resolveWait!: () => void
    let rejectWait!: (error: unknown) => void
    const promise = new Promise<void>((resolve, reject) => { resolveWait = resolve; rejectWait = reject })
    let timer: NodeJS.Timeout
    const deadline = performance.now() + timeout
    const waiter = {
      promise,
      settled: false,
      settle: (error?: unknown): void => {
        if (waiter.settled) return
        waiter.settled = true
        clearTimeout(timer)
        set.delete(waiter)
        if (set.size === 0 && this.#byKey.get(key) === set) {
          this.#byKey.delete(key)
          this.#onIdle(key)
        }
        if (error === undefined) resolveWait()
        else rejectWait(error)
      },
      shorten: (ms: number): void => {
        if (waiter.settled || performance.now() + ms >= deadline) return
        clearTimeout(timer)
        timer = setTimeout(() => { waiter.settle() }, Math.max(0, ms))
      }
    }
    timer = setTimeout(() => { waiter.settle() }, Math.min(Math.max(0, timeout), MAX_TIMER_MS))
    set.add(waiter)
    return waiter
  }

  /** Wake every waiter of `key`. */
  wake (key: string, error?: unknown): void {
    const waiters = this.#byKey.get(key)
    if (waiters !== undefined) for (const waiter of [...waiters]) waiter.settle(error)
  }

  /** Wake every waiter of every key. */
  wakeAll (error?: unknown): void {
    for (const waiters of [...this.#byKey.values()]) for (const waiter of [...waiters]) waiter.settle(error)
  }
}
