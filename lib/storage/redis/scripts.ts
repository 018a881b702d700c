/**
 * RedisStorage's Lua scripts, each on one key (KEYS[1]), and how they are sent. Every offset they
 * use comes from the value layout (codec.ts). Every driver (driver.ts) sends the same ones.
 */
import { createHash } from 'node:crypto'
import { FENCE_LENGTH, LEASE_TAG, SEPARATOR, WAITERS_OFFSET, WAITING } from './codec.js'
import { CHANNEL_SUFFIX } from './keys.js'

// Lua strings count from 1, GETRANGE and SETRANGE from 0 (GETRANGE's end included). The offsets
// a script passes to redis.call are written as Lua strings: a Lua number is turned into a string
// by Redis on every call, which cost the complete script a tenth of its instructions.
/** GETRANGE's end of the fence. */
const FENCE_LAST = FENCE_LENGTH - 1
/** Lua's position of the last byte of 'L' + token: the fence without its waiters byte. */
const LEASE_PREFIX_END = WAITERS_OFFSET
/** Lua's position of the waiters byte. */
const WAITERS_AT = WAITERS_OFFSET + 1
/** The channel of KEYS[1], as channelOf names it. */
const CHANNEL = `KEYS[1] .. '${CHANNEL_SUFFIX}'`

/**
 * Ends a lease: stores the entry when one is given (complete), deletes the key otherwise
 * (release). ARGV: the caller's fence as begin wrote it (fenceOf: 'L', token, '-'), [entry,
 * expiration ms].
 *
 * Built for the first request's cost on Redis: the fence is read with one bounded GETRANGE (never
 * the whole value, however long an entry sits there), and compared whole with ARGV[1], with no
 * string cut on the way: Lua strings are interned, so that test is one pointer comparison. Only a
 * head that differs is looked at again: the same lease with its waiters byte set ('W': publish the
 * end), or not the caller's lease. The channel is derived from the key here rather than sent.
 * Every argument costs Redis a Lua string and a slot in ARGV on each call.
 *
 * Returns 1, 0 when the lease was not the caller's, and 2 when the lease ended but its PUBLISH
 * was refused (an ACL without it): the entry is stored (a script's writes are never undone), and
 * the waiters were not told. PUBLISH goes through `pcall`, so such a refusal is not an error of
 * the script, which the caller would take for a response not stored.
 */
const END_LEASE_LUA = `
local head = redis.call('GETRANGE', KEYS[1], '0', '${FENCE_LAST}')
local waited = head ~= ARGV[1]
if waited and head ~= string.sub(ARGV[1], 1, ${LEASE_PREFIX_END}) .. '${WAITING}' then
  return 0
end
if ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else
  redis.call('DEL', KEYS[1])
end
if waited and type(redis.pcall('PUBLISH', ${CHANNEL}, '1')) == 'table' then
  return 2
end
return 1
`

/**
 * ARGV: the caller's fence (its waiters byte not compared), new lease end (epoch ms), lockTimeout
 * ms. The waiters byte and the fingerprint are kept from the current value, so the lease still
 * reports it to duplicates.
 * A Redis full under noeviction refuses the SET (it may grow the value), but not PEXPIRE: the
 * lease is then extended with the old lease end in its value (duplicates are told a Retry-After
 * too early, which is harmless), rather than let lapse while its response waits to be stored.
 */
const RENEW_LUA = `
local value = redis.call('GET', KEYS[1])
if not value or string.sub(value, 1, ${LEASE_PREFIX_END}) ~= string.sub(ARGV[1], 1, ${LEASE_PREFIX_END}) then
  return 0
end
local bar = string.find(value, '${SEPARATOR}', ${WAITERS_AT + 1}, true)
local set = redis.pcall('SET', KEYS[1], string.sub(value, 1, ${WAITERS_AT}) .. ARGV[2] .. string.sub(value, bar), 'PX', ARGV[3])
if type(set) == 'table' and set.err then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
`

/**
 * No ARGV. A waiter marks the lease so that its end is published; 0 when there is no lease (any
 * more): the waiter then has nothing to wait for. SETRANGE keeps the expiry.
 */
const MARK_WAITING_LUA = `
if redis.call('GETRANGE', KEYS[1], '0', '0') ~= '${LEASE_TAG}' then
  return 0
end
redis.call('SETRANGE', KEYS[1], '${WAITERS_OFFSET}', '${WAITING}')
return 1
`

/**
 * The operators' `forget`. ARGV: '1' to remove a lease too. Returns 0 (nothing
 * there), 1 (an entry, removed), 2 (a lease, removed), or -1 (a lease, kept) with its remaining PTTL.
 */
const FORGET_LUA = `
local head = redis.call('GETRANGE', KEYS[1], '0', '${WAITERS_OFFSET}')
if head == '' then
  return {0, 0}
end
local lease = string.sub(head, 1, 1) == '${LEASE_TAG}'
if lease and ARGV[1] ~= '1' then
  return {-1, redis.call('PTTL', KEYS[1])}
end
redis.call('DEL', KEYS[1])
if not lease then
  return {1, 0}
end
if string.sub(head, ${WAITERS_AT}, ${WAITERS_AT}) == '${WAITING}' then
  redis.pcall('PUBLISH', ${CHANNEL}, '1')
end
return {2, 0}
`

/**
 * A script, sent as `EVALSHA`, and as `EVAL` (which also loads it into the server) the first time
 * through each driver and whenever the server answers NOSCRIPT: after a restart, a failover or a
 * SCRIPT FLUSH, or on a cluster node that has not seen it yet (`evalScript`). Sent as plain
 * commands rather than through a client's own script helpers (ioredis's `defineCommand` adds an
 * extra promise, a callback adapter and a rejection hook to every call: 8.2 against 10.6 µs of
 * client CPU per call, docs/benchmarks.md#measurements-behind-the-design), and defines nothing on
 * the client.
 */
export class Script {
  readonly lua: string
  readonly sha: string

  constructor (lua: string) {
    this.lua = lua
    this.sha = createHash('sha1').update(lua).digest('hex')
  }
}

/** How a script is sent: `EVAL` with its source, or `EVALSHA` with its digest. */
export type ScriptForm = 'eval' | 'evalsha'

/**
 * Run `script` on `key` through `send` (a driver's EVALSHA or EVAL of one key): EVAL the first
 * time (`loaded` records it), EVALSHA from then on, EVAL again after NOSCRIPT. With `form`, in
 * that form alone (the start-up proof tries each, since an ACL may allow one and not the other).
 */
export async function evalScript (
  loaded: Set<Script>,
  script: Script,
  send: (name: ScriptForm, body: string) => Promise<unknown>,
  replyCode: (error: unknown) => string | null,
  form?: ScriptForm
): Promise<unknown> {
  if (form === 'evalsha') return await send('evalsha', script.sha)
  if (form === undefined && loaded.has(script)) {
    try {
      return await send('evalsha', script.sha)
    } catch (error) {
      if (replyCode(error) !== 'NOSCRIPT') throw error
    }
  }
  loaded.add(script)
  return await send('eval', script.lua)
}

export const END_LEASE = new Script(END_LEASE_LUA)
export const RENEW = new Script(RENEW_LUA)
export const MARK_WAITING = new Script(MARK_WAITING_LUA)
/** The operators' `inspect`: the value and its remaining time to live, of the same moment. */
export const READ_WITH_TTL = new Script("return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}")
export const FORGET = new Script(FORGET_LUA)
