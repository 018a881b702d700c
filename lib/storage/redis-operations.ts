/**
 * RedisStorage's operations (docs/operations.md): reading a key without taking it, forgetting it,
 * and listing the leases held. None of them is on a request's path; `forget` and `listInFlight`
 * walk the keyspace with SCAN (on every master of a Cluster), which never blocks Redis, and
 * `listInFlight` stops after a bounded number of keys.
 */
import type { Cluster, Redis } from 'ioredis'
import { TOKEN_LENGTH } from './tokens.js'
import type { StorageForgetOptions, StorageForgetResult, HeldLease, LeaseListing, StoredState } from './types.js'

/** What the operations need of a RedisStorage. */
export interface RedisView {
  client: Redis | Cluster
  /** The storage's prefix and the opening brace of the hash tag. */
  open: string
  redisKey: (key: string) => string
  channel: (redisKey: string) => string
  /** A value read from the store, as `inspect` reports it; `ttl` is the key's PTTL. */
  decode: (value: Buffer, ttl: number) => StoredState
}

/** Keys `listInFlight` looks at, at most, before it gives up and says its listing is incomplete. */
export const MAX_SCANNED_KEYS = 1_000_000
const SCAN_COUNT = 1000
/** A lease value is short ('L', token, waiters byte, lease end, '|', fingerprint): read this much of every value. */
const LEASE_HEAD_BYTES = 1024

// Lua counts from 1: the waiters byte follows 'L' and the token (see the layout in redis.ts).
const WAITERS_BYTE = TOKEN_LENGTH + 2

// KEYS[1]: the key. ARGV: '1' to remove a lease too, the key's channel. Returns 0 (nothing there),
// 1 (an entry, removed), 2 (a lease, removed), or -1 (a lease, kept) with its remaining PTTL.
const FORGET_LUA = `
local head = redis.call('GETRANGE', KEYS[1], 0, ${WAITERS_BYTE - 1})
if head == '' then
  return {0, 0}
end
local lease = string.sub(head, 1, 1) == 'L'
if lease and ARGV[1] ~= '1' then
  return {-1, redis.call('PTTL', KEYS[1])}
end
redis.call('DEL', KEYS[1])
if not lease then
  return {1, 0}
end
if string.sub(head, ${WAITERS_BYTE}, ${WAITERS_BYTE}) == 'W' then
  redis.call('PUBLISH', ARGV[2], '1')
end
return {2, 0}
`

const PREVIOUS = { 0: 'absent', 1: 'completed', 2: 'in-flight' } as const

/** A glob that matches `text` literally (SCAN's MATCH). */
function literalGlob (text: string): string {
  return text.replace(/[\\*?[\]]/g, (char) => `\\${char}`)
}

const UNESCAPES = /%(25|7B|7D|u[0-9A-F]{4})/g

/** The key a RedisStorage was given, from the Redis key it stored it under; `null` for another key. */
function storageKeyOf (view: RedisView, redisKey: string): string | null {
  if (!redisKey.startsWith(view.open) || !redisKey.endsWith('}')) return null
  return redisKey.slice(view.open.length, -1).replace(UNESCAPES, (_match, code: string) => {
    if (code === '25') return '%'
    if (code === '7B') return '{'
    if (code === '7D') return '}'
    return String.fromCharCode(parseInt(code.slice(1), 16))
  })
}

/** Every key matching `pattern`, batch by batch, on each master (a Cluster) or on the one server. */
async function * scan (client: Redis | Cluster, pattern: string): AsyncGenerator<string[]> {
  const servers = typeof (client as Cluster).nodes === 'function' ? (client as Cluster).nodes('master') : [client as Redis]
  for (const server of servers) {
    let cursor = '0'
    do {
      const [next, keys] = await server.scan(cursor, 'MATCH', pattern, 'COUNT', SCAN_COUNT)
      cursor = next
      if (keys.length > 0) yield keys
    } while (cursor !== '0')
  }
}

export async function inspectKey (view: RedisView, key: string): Promise<StoredState> {
  const redisKey = view.redisKey(key)
  // One transaction, so the value and its time to live are of the same moment.
  const replies = await view.client.multi().getBuffer(redisKey).pttl(redisKey).exec()
  const [[readError, value], [ttlError, ttl]] = replies as Array<[Error | null, unknown]> as [[Error | null, Buffer | null], [Error | null, number]]
  if (readError !== null) throw readError
  if (ttlError !== null) throw ttlError
  return value === null ? { state: 'absent' } : view.decode(value, ttl)
}

export async function forgetKey (view: RedisView, key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
  const redisKey = view.redisKey(key)
  const [outcome, ttl] = await view.client.eval(FORGET_LUA, 1, redisKey, options.force ? '1' : '0', view.channel(redisKey)) as [number, number]
  if (outcome === -1) return { outcome: 'refused', lockExpiresAt: Date.now() + ttl }
  // The related keys: the prefix's Redis key without its closing brace, then anything.
  const pattern = literalGlob(view.redisKey(options.relatedPrefix).slice(0, -1)) + '*'
  let related = 0
  for await (const keys of scan(view.client, pattern)) {
    // One DEL per key: in a Cluster they live in different slots.
    const deleted = await Promise.all(keys.map((name) => view.client.del(name)))
    related += deleted.reduce((sum, count) => sum + count, 0)
  }
  return { outcome: 'forgotten', previous: PREVIOUS[outcome as 0 | 1 | 2], related }
}

export async function listLeases (view: RedisView, limit: number): Promise<LeaseListing> {
  const leases: HeldLease[] = []
  let scanned = 0
  for await (const keys of scan(view.client, literalGlob(view.open) + '*')) {
    const heads = await Promise.all(keys.map((name) => view.client.getrangeBuffer(name, 0, LEASE_HEAD_BYTES - 1)))
    for (const [index, head] of heads.entries()) {
      const key = storageKeyOf(view, keys[index]!)
      if (key === null || head[0] !== 0x4c) continue
      // A value as long as what was read may be longer: read it whole (it may also be gone by now).
      const value = head.length < LEASE_HEAD_BYTES ? head : await view.client.getBuffer(keys[index]!)
      const found = value === null ? null : view.decode(value, 0)
      if (found?.state !== 'in-flight') continue
      if (leases.length === limit) return { leases, complete: false }
      leases.push({ key, fingerprint: found.fingerprint, lockExpiresAt: found.lockExpiresAt, since: found.since })
    }
    scanned += keys.length
    if (scanned >= MAX_SCANNED_KEYS) return { leases, complete: false }
  }
  return { leases, complete: true }
}
