/**
 * Taking a key's lease so that the plugin can rely on it: for a request (acquire.ts) and for a
 * recovery point (steps.ts).
 *
 * A store measures a lease from some moment after `begin` was sent: a lease taken by a call sent
 * at `s` lasts at least until `s + lockTimeout`, and no longer may be assumed. A store may read
 * its clock before a wait (MySQL and MariaDB do, for the INSERT of a new key that waits for a gap
 * lock another transaction holds), and an answer may travel slowly. Renewal keeps a lease alive when
 * it is held soon enough after `s`; a lease granted later than that is renewed here first, before
 * anything runs under it, and one that lapsed meanwhile (a duplicate may have taken the key over
 * and be running) is not used: the call fails as a store failure does.
 *
 * A call the plugin gave up on (storeTimeout) may still be granted a lease: it is given back at
 * once, rather than block the key until it lapses.
 */
import type { BeginResult, IdempotencyStorage } from '../storage/types.js'
import type { RouteEngine } from './route-engine.js'

/** `begin` granted a lease that had lapsed before it could be used. */
export class LeaseLapsedError extends Error {
  constructor (answeredAfter: number, lockTimeout: number) {
    super(`fastify-idempotency: the store granted a lease ${answeredAfter} ms after begin was sent, and it lapsed before it could be used (lockTimeout ${lockTimeout} ms)`)
    this.name = 'LeaseLapsedError'
  }
}

export interface TakenLease {
  result: BeginResult
  /** When the store measures the lease from, at the earliest (epoch ms): where renewal counts from. */
  since: number
}

export async function takeLease (engine: RouteEngine, key: string, fingerprint: string): Promise<TakenLease> {
  const { storage, settings, deadline, renewal } = engine
  const sentAt = Date.now()
  const result = await deadline.run('begin', () => storage.begin(key, fingerprint, settings.lockTimeout), (late) => {
    if (late.state === 'acquired') giveBack(storage, key, late.token)
  })
  if (result.state !== 'acquired' || renewal.inTime(sentAt)) return { result, since: sentAt }
  const renewedAt = Date.now()
  let held: boolean
  try {
    held = await deadline.run('renew', () => storage.renew(key, result.token, settings.lockTimeout))
  } catch (error) {
    // Also when given up on: a renewal that goes through later finds the lease released, or is
    // followed by the release.
    giveBack(storage, key, result.token)
    throw error
  }
  if (!held) throw new LeaseLapsedError(renewedAt - sentAt, settings.lockTimeout)
  return { result, since: renewedAt }
}

/** Drop a lease nothing will run under; fenced, so it never touches another holder's lease. */
function giveBack (storage: IdempotencyStorage, key: string, token: string): void {
  // Through a promise: a store that throws instead of rejecting must not throw out of here.
  Promise.resolve().then(() => storage.release(key, token)).catch(() => {})
}
