/**
 * RedisStorage's operations (docs/operations.md): reading a key without taking it, forgetting it,
 * and listing the leases held. None of them is on a request's path; `forget` and `listInFlight`
 * walk the keyspace with SCAN (on every master of a Cluster), which never blocks Redis, and
 * `listInFlight` stops after a bounded number of keys.
 */
import { tokenIssuedAt } from '../tokens.js'
import type { StorageForgetOptions, StorageForgetResult, HeldLease, LeaseListing, StoredState } from '../types.js'
import { decodeValue, LEASE_TAG } from './codec.js'
import { redisKeyOf, storageKeyOf } from './keys.js'
import type { RedisDriver } from './driver.js'
import { FORGET, READ_WITH_TTL } from './scripts.js'

/** What the operations need of a RedisStorage. */
export interface RedisView {
  driver: RedisDriver
  /** The storage's prefix and the opening brace of the hash tag. */
  open: string
}

/** Keys `listInFlight` looks at, at most, before it gives up and says its listing is incomplete. */
export const MAX_SCANNED_KEYS = 1_000_000
const SCAN_COUNT = 1000
/** A lease value is short ('L', token, waiters byte, lease end, '|', fingerprint): read this much of every value. */
const LEASE_HEAD_BYTES = 1024
const LEASE_BYTE = LEASE_TAG.charCodeAt(0)

const PREVIOUS = { 0: 'absent', 1: 'completed', 2: 'in-flight' } as const

/** A glob that matches `text` literally (SCAN's MATCH). */
function literalGlob (text: string): string {
  return text.replace(/[\\*?[\]]/g, (char) => `\\${char}`)
}

/**
 * Every key whose name starts with `start` (a name as the storage's commands give it, without the
 * client's keyPrefix), batch by batch, on each master. SCAN's pattern and the names it returns are
 * not rewritten by any client: the keyPrefix goes in front of the one and is taken off the others,
 * which go back to the driver's commands.
 */
async function * scan ({ driver }: RedisView, start: string): AsyncGenerator<string[]> {
  const { keyPrefix } = driver
  for await (const keys of driver.scan(literalGlob(keyPrefix + start) + '*', SCAN_COUNT)) {
    yield keyPrefix === '' ? keys : keys.map((name) => name.slice(keyPrefix.length))
  }
}

/** A value as `inspect` reports it; an entry's expiry is the key's remaining time to live (`ttl` ms). */
function storedState (value: Buffer, ttl: number): StoredState {
  const found = decodeValue(value)
  if (found.state === 'in-flight') return { state: 'in-flight', fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt, since: tokenIssuedAt(found.token) }
  const { fingerprint, response, storedAt } = found
  return { state: 'completed', fingerprint, response, storedAt, expiresAt: Date.now() + ttl }
}

export async function inspectKey ({ driver, open }: RedisView, key: string): Promise<StoredState> {
  // One script, so the value and its time to live are of the same moment.
  const [value, ttl] = await driver.script(READ_WITH_TTL, redisKeyOf(open, key), []) as [Buffer | null, number]
  return value === null ? { state: 'absent' } : storedState(value, Number(ttl))
}

export async function forgetKey (view: RedisView, key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
  const [reply, ttl] = await view.driver.script(FORGET, redisKeyOf(view.open, key), [options.force ? '1' : '0']) as [number, number]
  const outcome = Number(reply)
  if (outcome === -1) return { outcome: 'refused', lockExpiresAt: Date.now() + Number(ttl) }
  // The related keys: the prefix's Redis key without its closing brace, then anything.
  let related = 0
  for await (const keys of scan(view, redisKeyOf(view.open, options.relatedPrefix).slice(0, -1))) {
    // One DEL per key: in a Cluster they live in different slots.
    const deleted = await Promise.all(keys.map((name) => view.driver.call('del', name, [])))
    related += deleted.reduce((sum: number, count) => sum + Number(count), 0)
  }
  return { outcome: 'forgotten', previous: PREVIOUS[outcome as 0 | 1 | 2], related }
}

export async function listLeases (view: RedisView, limit: number): Promise<LeaseListing> {
  const leases: HeldLease[] = []
  let scanned = 0
  for await (const keys of scan(view, view.open)) {
    const heads = await Promise.all(keys.map((name) => view.driver.call('getrange', name, ['0', String(LEASE_HEAD_BYTES - 1)]) as Promise<Buffer>))
    for (const [index, head] of heads.entries()) {
      const key = storageKeyOf(view.open, keys[index]!)
      if (key === null || head[0] !== LEASE_BYTE) continue
      // A value as long as what was read may be longer: read it whole (it may also be gone by now).
      const value = head.length < LEASE_HEAD_BYTES ? head : await view.driver.call('get', keys[index]!, []) as Buffer | null
      const found = value === null ? null : storedState(value, 0)
      if (found?.state !== 'in-flight') continue
      if (leases.length === limit) return { leases, complete: false }
      leases.push({ key, fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt, since: found.since })
    }
    scanned += keys.length
    if (scanned >= MAX_SCANNED_KEYS) return { leases, complete: false }
  }
  return { leases, complete: true }
}
