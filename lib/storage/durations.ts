/**
 * The durations every store is given (lockTimeout, expiration), checked the same way everywhere:
 * a positive number of milliseconds, rounded up to a whole one (SQL columns and Redis's PX take
 * integers, and a zero or negative TTL would delete a key at once).
 */

/** The longest duration accepted: PX and BIGINT epoch arithmetic stay exact far beyond it. */
export const MAX_DURATION_MS = 2 ** 47

export function duration (store: string, name: string, value: number): number {
  if (typeof value === 'number' && value > 0 && value <= MAX_DURATION_MS) return Math.ceil(value)
  throw new RangeError(`${store}: ${name} must be a number of milliseconds from 1 to ${MAX_DURATION_MS}, got ${String(value)}`)
}
