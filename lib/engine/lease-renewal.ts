/**
 * Keeps the leases of running handlers alive: one timer per route, not one per request. (A
 * `setInterval` and `clearInterval` for every first request cost more than the rest of the lease
 * bookkeeping together.) Held leases form a linked list through fields on the leases themselves,
 * so taking and dropping one is a few pointer writes: no allocation, no hashing.
 *
 * The timer ticks every `lockTimeout / 4` while leases are held and stops on the first tick that
 * finds none. A tick renews each lease taken or renewed at least `lockTimeout / 8` before, so a
 * lease is first renewed at most 3/8 of `lockTimeout` after it was taken, then every
 * `lockTimeout / 4`: always well before it would lapse, with room for a late timer.
 */

/** What the renewal keeps on each lease (initialize to `false`, `0`, `null`, `null`). */
export interface RenewedLease {
  renewing: boolean
  /** When it was taken or last renewed (epoch ms). */
  renewedAt: number
  previousHeld: RenewedLease | null
  nextHeld: RenewedLease | null
}

export class LeaseRenewal<Lease extends RenewedLease> {
  #first: Lease | null = null
  readonly #period: number
  readonly #renew: (lease: Lease) => void
  #timer: NodeJS.Timeout | null = null

  constructor (lockTimeout: number, renew: (lease: Lease) => void) {
    this.#period = Math.max(1, Math.floor(lockTimeout / 4))
    this.#renew = renew
  }

  /** Renew `lease` from now on, until `drop`. */
  hold (lease: Lease): void {
    if (lease.renewing) return
    lease.renewing = true
    lease.renewedAt = Date.now()
    lease.previousHeld = null
    lease.nextHeld = this.#first
    if (this.#first !== null) this.#first.previousHeld = lease
    this.#first = lease
    if (this.#timer !== null) return
    this.#timer = setInterval(() => { this.#tick() }, this.#period)
    // Never what keeps a process alive: a lease outliving its process lapses, as it must.
    this.#timer.unref()
  }

  drop (lease: Lease): void {
    if (!lease.renewing) return
    lease.renewing = false
    const { previousHeld, nextHeld } = lease
    if (previousHeld === null) this.#first = nextHeld as Lease | null
    else previousHeld.nextHeld = nextHeld
    if (nextHeld !== null) nextHeld.previousHeld = previousHeld
    lease.previousHeld = null
    lease.nextHeld = null
  }

  /** Stop renewing everything (the server is closing). */
  stop (): void {
    while (this.#first !== null) this.drop(this.#first)
    if (this.#timer !== null) clearInterval(this.#timer)
    this.#timer = null
  }

  #tick (): void {
    if (this.#first === null) {
      this.stop()
      return
    }
    const now = Date.now()
    const due = now - this.#period / 2
    for (let lease = this.#first as RenewedLease | null; lease !== null; lease = lease.nextHeld) {
      if (lease.renewedAt > due) continue
      lease.renewedAt = now
      this.#renew(lease as Lease)
    }
  }
}
