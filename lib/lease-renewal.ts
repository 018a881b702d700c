/**
 * Keeps the leases of running handlers alive: one timer per route, not one per request. (A
 * `setInterval` and `clearInterval` for every first request cost more than the rest of the lease
 * bookkeeping together; adding to and deleting from a Map costs next to nothing.)
 *
 * The timer ticks every `lockTimeout / 4` while leases are held and stops on the first tick that
 * finds none. A tick renews each lease taken or renewed at least `lockTimeout / 8` before, so a
 * lease is first renewed at most 3/8 of `lockTimeout` after it was taken, then every
 * `lockTimeout / 4`: always well before it would lapse, with room for a late timer.
 */

/** What the renewal keeps on each lease it holds. */
export interface RenewedLease {
  /** Its entry in the renewal's map: a number, because an object key costs V8 an identity hash. */
  renewalId: number
  /** When it was taken or last renewed (epoch ms). */
  renewedAt: number
}

export class LeaseRenewal<Lease extends RenewedLease> {
  readonly #held = new Map<number, Lease>()
  readonly #period: number
  readonly #renew: (lease: Lease) => void
  #ids = 0
  #timer: NodeJS.Timeout | null = null

  constructor (lockTimeout: number, renew: (lease: Lease) => void) {
    this.#period = Math.max(1, Math.floor(lockTimeout / 4))
    this.#renew = renew
  }

  /** Renew `lease` from now on, until `drop`. */
  hold (lease: Lease): void {
    lease.renewalId = ++this.#ids
    lease.renewedAt = Date.now()
    this.#held.set(lease.renewalId, lease)
    if (this.#timer !== null) return
    this.#timer = setInterval(() => { this.#tick() }, this.#period)
    // Never what keeps a process alive: a lease outliving its process lapses, as it must.
    this.#timer.unref()
  }

  drop (lease: Lease): void {
    this.#held.delete(lease.renewalId)
  }

  /** Stop renewing everything (the server is closing). */
  stop (): void {
    this.#held.clear()
    if (this.#timer !== null) clearInterval(this.#timer)
    this.#timer = null
  }

  #tick (): void {
    if (this.#held.size === 0) {
      this.stop()
      return
    }
    const now = Date.now()
    const due = now - this.#period / 2
    for (const lease of this.#held.values()) {
      if (lease.renewedAt > due) continue
      lease.renewedAt = now
      this.#renew(lease)
    }
  }
}
