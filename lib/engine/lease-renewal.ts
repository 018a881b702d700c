/**
 * Keeps the leases of running handlers alive: one timer per route, not one per request (a timer
 * per request showed in the profile of first requests, and a Map of leases cost 0.5 to 0.7 µs per
 * request: bench/analysis.md#measurements-behind-the-design). Held leases form a linked list
 * through fields on the leases themselves, so taking and dropping one is a few pointer writes: no
 * allocation, no hashing.
 *
 * The timer ticks every `lockTimeout / 8` while leases are held and stops on the first tick that
 * finds none. A tick renews each lease taken or renewed at least `lockTimeout / 16` before, so a
 * lease is first renewed at most 3/16 of `lockTimeout` after the call that took it was sent, then
 * every `lockTimeout / 8`.
 *
 * That cadence is what lets a lease outlive a stalled event loop: no timer can fire while the loop
 * is blocked (synchronous handler code, a long garbage collection, a process starved of CPU), and
 * a lease renewed every `lockTimeout / 8` still has at least 7/8 of it left when a stall begins,
 * so the tick that runs once the stall ends renews it in time. A tick that finds itself late by
 * half of `lockTimeout` or more tells `stalled`: the leases it renews were at risk, and a longer
 * stall would lose them.
 *
 * No lease is renewed past `maxHold` after it was acquired: the tick that finds it that old drops
 * it and hands it to `expire`, and the store lets it lapse within `lockTimeout`.
 */

/** What the renewal keeps on each lease (initialize to `false`, `0`, `null`, `null`). */
export interface RenewedLease {
  /** When the lease was first acquired (epoch ms), set by its owner: renewal stops `maxHold` later. */
  acquiredAt: number
  renewing: boolean
  /** When it was taken or last renewed (epoch ms). */
  renewedAt: number
  previousHeld: RenewedLease | null
  nextHeld: RenewedLease | null
}

export class LeaseRenewal<Lease extends RenewedLease> {
  #first: Lease | null = null
  readonly #period: number
  readonly #maxHold: number
  readonly #renew: (lease: Lease) => void
  readonly #expire: (lease: Lease) => void
  readonly #stalled: (lease: Lease, stalledMs: number) => void
  readonly #stallWarning: number
  #timer: NodeJS.Timeout | null = null
  /** When the timer last ticked, or was started (performance.now(): a stall, not a clock change). */
  #lastTick = 0

  constructor (lockTimeout: number, maxHold: number, renew: (lease: Lease) => void, expire: (lease: Lease) => void = () => {}, stalled: (lease: Lease, stalledMs: number) => void = () => {}) {
    this.#period = Math.max(1, Math.floor(lockTimeout / 8))
    this.#stallWarning = lockTimeout / 2
    this.#maxHold = maxHold
    this.#renew = renew
    this.#expire = expire
    this.#stalled = stalled
  }

  /**
   * Renew `lease` from now on, until `drop`. `since`: when the call that took or last renewed it
   * was sent, which the store measures the lease from at the earliest (default: now).
   */
  hold (lease: Lease, since = Date.now()): void {
    if (lease.renewing) return
    lease.renewing = true
    lease.renewedAt = since
    lease.previousHeld = null
    lease.nextHeld = this.#first
    if (this.#first !== null) this.#first.previousHeld = lease
    this.#first = lease
    if (this.#timer !== null) return
    this.#lastTick = performance.now()
    this.#timer = setInterval(() => { this.#tick() }, this.#period)
    // Never what keeps a process alive: a lease outliving its process lapses, as it must.
    this.#timer.unref()
  }

  /**
   * Whether a lease measured from `since` and held from now is renewed in time: its first renewal
   * is then sent within 3/16 of lockTimeout of `since`, as for any lease held at once. A lease taken
   * by a call that answered later than this must be renewed by its holder before it is relied on.
   */
  inTime (since: number): boolean {
    return Date.now() - since <= this.#period / 2
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
    const tickedAt = performance.now()
    const stalledMs = tickedAt - this.#lastTick - this.#period
    this.#lastTick = tickedAt
    for (let lease = this.#first as RenewedLease | null; lease !== null;) {
      const next = lease.nextHeld
      if (now - lease.acquiredAt >= this.#maxHold) {
        this.drop(lease as Lease)
        this.#expire(lease as Lease)
      } else if (lease.renewedAt <= due) {
        lease.renewedAt = now
        this.#renew(lease as Lease)
        if (stalledMs >= this.#stallWarning) this.#stalled(lease as Lease, Math.round(stalledMs))
      }
      lease = next
    }
  }
}
