/**
 * RedisStorage's operations (docs/operations.md): reading a key without taking it, forgetting it,
 * and listing the leases held. None of them is on a request's path; `forget` and `listInFlight`
 * walk the keyspace with SCAN (on every master of a Cluster), which never blocks Redis, and
 * `listInFlight` stops after a bounded number of keys.
 */
import type { Cluster, Redis } from 'ioredis'
import { tokenIssuedAt } from '../tokens.js'
import type { StorageForgetOptions, StorageForgetResult, HeldLease, LeaseListing, StoredState } from '../types.js'
import { decodeValue, LEASE_TAG } from './codec.js'
import { redisKeyOf, storageKeyOf } from './keys.js'
import { FORGET_LUA } from './scripts.js'

/** What the operations need of a RedisStorage. */
export interface RedisView {
  client: Redis | Cluster
  /** The storage's prefix and the opening brace of the hash tag. */
  open: string
  /** What the client puts in front of every key argument (keys.ts, clientKeyPrefix). */
  keyPrefix: string
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
 * client's keyPrefix), batch by batch, on each master (a Cluster) or on the one server. SCAN's
 * pattern and the names it returns are not rewritten by the client: the keyPrefix goes in front of
 * the one and is taken off the others, which go back to the client's commands.
 */
async function * scan ({ client, keyPrefix }: RedisView, start: string): AsyncGenerator<string[]> {
  const servers = typeof (client as Cluster).nodes === 'function' ? (client as Cluster).nodes('master') : [client as Redis]
  const pattern = literalGlob(keyPrefix + start) + '*'
  for (const server of servers) {
    let cursor = '0'
    do {
      const [next, keys] = await server.scan(cursor, 'MATCH', pattern, 'COUNT', SCAN_COUNT)
      cursor = next
      if (keys.length > 0) yield keyPrefix === '' ? keys : keys.map((name) => name.slice(keyPrefix.length))
    } while (cursor !== '0')
  }
}

/** A value as `inspect` reports it; an entry's expiry is the key's remaining time to live (`ttl` ms). */
function storedState (value: Buffer, ttl: number): StoredState {
  const found = decodeValue(value)
  if (found.state === 'in-flight') return { state: 'in-flight', fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt, since: tokenIssuedAt(found.token) }
  const { fingerprint, response, storedAt } = found
  return { state: 'completed', fingerprint, response, storedAt, expiresAt: Date.now() + ttl }
}

export async function inspectKey (view: RedisView, key: string): Promise<StoredState> {
  const redisKey = redisKeyOf(view.open, key)
  // One transaction, so the value and its time to live are of the same moment.
  const replies = await view.client.multi().getBuffer(redisKey).pttl(redisKey).exec()
  const [[readError, value], [ttlError, ttl]] = replies as Array<[Error | null, unknown]> as [[Error | null, Buffer | null], [Error | null, number]]
  if (readError !== null) throw readError
  if (ttlError !== null) throw ttlError
  return value === null ? { state: 'absent' } : storedState(value, ttl)
}

export async function forgetKey (view: RedisView, key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
  const redisKey = redisKeyOf(view.open, key)
  const [outcome, ttl] = await view.client.eval(FORGET_LUA, 1, redisKey, options.force ? '1' : '0') as [number, number]
  if (outcome === -1) return { outcome: 'refused', lockExpiresAt: Date.now() + ttl }
  // The related keys: the prefix's Redis key without its closing brace, then anything.
  let related = 0
  for await (const keys of scan(view, redisKeyOf(view.open, options.relatedPrefix).slice(0, -1))) {
    // One DEL per key: in a Cluster they live in different slots.
    const deleted = await Promise.all(keys.map((name) => view.client.del(name)))
    related += deleted.reduce((sum, count) => sum + count, 0)
  }
  return { outcome: 'forgotten', previous: PREVIOUS[outcome as 0 | 1 | 2], related }
}

export async function listLeases (view: RedisView, limit: number): Promise<LeaseListing> {
  const leases: HeldLease[] = []
  let scanned = 0
  for await (const keys of scan(view, view.open)) {
    const heads = await Promise.all(keys.map((name) => view.client.getrangeBuffer(name, 0, LEASE_HEAD_BYTES - 1)))
    for (const [index, head] of heads.entries()) {
      const key = storageKeyOf(view.open, keys[index]!)
      if (key === null || head[0] !== LEASE_BYTE) continue
      // A value as long as what was read may be longer: read it whole (it may also be gone by now).
      const value = head.length < LEASE_HEAD_BYTES ? head : await view.client.getBuffer(keys[index]!)
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
