/**
 * Recovery-point records written by earlier versions. They were kept under `\u0000step:` and a
 * hash of the request's storage key and the step's name, a key nothing could find without the
 * step's name; records are now kept under a prefix derived from the request's storage key (see
 * `stepRecordPrefix`), so that `forget` removes them with the request's entry. A step that finds
 * no record where records are kept now looks once where they were kept before, so a handler that
 * ran some steps before an upgrade and is retried after it still finds what they recorded.
 *
 * It costs a step that runs (not one that replays) one more store call. Records expire
 * `expiration` after they were written, so once every route's `expiration` has passed since the
 * upgrade, none of them is left to find.
 */
import type { BeginAcquired, BeginCompleted, BeginInFlight } from '../storage/types.js'
import type { RouteEngine } from './route-engine.js'
import type { StoreDoor } from './store-door.js'

/** What a step goes on with: its own lease, or the record (or lease) found at the earlier key, and the key it is under. */
export interface StepRecord {
  result: BeginAcquired | BeginInFlight | BeginCompleted
  recordKey: string
}

/**
 * `acquired` is the lease just taken on `stepKey`. When the earlier key holds a record or a lease,
 * that lease is given back and the earlier key's state is what the step goes on with.
 */
export async function orLegacyRecord ({ door }: RouteEngine, fingerprint: string, stepKey: string, acquired: BeginAcquired, legacyKey: string): Promise<StepRecord> {
  let found: BeginAcquired | BeginInFlight | BeginCompleted | null
  try {
    found = await legacyState(door, legacyKey, fingerprint)
  } catch (error) {
    await door.giveBack(stepKey, acquired.token)
    throw error
  }
  if (found === null) return { result: acquired, recordKey: stepKey }
  await door.giveBack(stepKey, acquired.token)
  return { result: found, recordKey: legacyKey }
}

/** The earlier key's record or lease, or `null` when it holds neither (read without keeping a lease). */
async function legacyState (door: StoreDoor, legacyKey: string, fingerprint: string): Promise<BeginInFlight | BeginCompleted | null> {
  const inspected = door.inspect(legacyKey)
  if (inspected !== null) {
    const found = await inspected
    if (found.state === 'absent') return null
    if (found.state === 'in-flight') return { state: 'in-flight', fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt }
    return { state: 'completed', fingerprint: found.fingerprint, response: found.response }
  }
  // A store that cannot read without taking: take the earlier key's lease, and give it back.
  const found = await door.beginOnly(legacyKey, fingerprint)
  if (found.state !== 'acquired') return found
  await door.giveBack(legacyKey, found.token)
  return null
}
