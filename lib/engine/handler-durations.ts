/**
 * How long a route's recent requests held their key, so that a duplicate answered 409 can be told
 * when its retry is likely to find the response stored, instead of the rest of the lease (a
 * minute by default), which clients that obey `Retry-After` would sleep through.
 */

/** Samples kept: enough for a stable 90th percentile, few enough to sort on a 409. */
const SAMPLES = 32

export class HandlerDurations {
  readonly #samples = new Float64Array(SAMPLES)
  #count = 0
  #next = 0

  /** A request that held the key for `ms` has settled. */
  record (ms: number): void {
    this.#samples[this.#next] = ms
    this.#next = (this.#next + 1) % SAMPLES
    if (this.#count < SAMPLES) this.#count++
  }

  /** The 90th percentile of the recent durations in ms, or `fallback` before the first. */
  p90 (fallback: number): number {
    if (this.#count === 0) return fallback
    const sorted = this.#samples.slice(0, this.#count).sort()
    return sorted[Math.ceil(0.9 * this.#count) - 1]!
  }
}
