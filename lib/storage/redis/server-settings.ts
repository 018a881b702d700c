/**
 * The settings of a Redis server that break RedisStorage's promise without refusing any command,
 * read on every master: an eviction policy that may drop a lease (a duplicate then runs while the
 * first request still runs), and persistence turned off (a restart forgets every key). Read from
 * INFO, which managed Redis allows where CONFIG is disabled, and from CONFIG GET where INFO is
 * refused.
 */
import { beforeAbort, failed, messageOf, passed, warning } from '../proof.js'
import type { StoreCheck } from '../types.js'
import type { RedisDriver } from './driver.js'

/** `name:value` lines of an INFO reply. */
function infoFields (reply: unknown): Map<string, string> {
  const fields = new Map<string, string>()
  for (const line of String(reply).split(/\r?\n/)) {
    const colon = line.indexOf(':')
    if (colon > 0 && !line.startsWith('#')) fields.set(line.slice(0, colon), line.slice(colon + 1).trim())
  }
  return fields
}

/** A CONFIG GET reply (a flat array, or a map on RESP3) as its names and values. */
function configFields (reply: unknown): Map<string, string> {
  if (reply instanceof Map) return new Map([...reply].map(([name, value]) => [String(name), String(value)]))
  if (Array.isArray(reply)) {
    const fields = new Map<string, string>()
    for (let i = 0; i + 1 < reply.length; i += 2) fields.set(String(reply[i]), String(reply[i + 1]))
    return fields
  }
  return new Map(Object.entries(reply ?? {}).map(([name, value]) => [name, String(value)]))
}

interface Memory { node: string, maxmemory: number, policy: string }

/** Each master's maxmemory and policy: from INFO memory, else CONFIG GET; why neither could be read. */
async function memorySettings (driver: RedisDriver, signal: AbortSignal | undefined): Promise<Memory[] | string> {
  let refused: string
  try {
    const replies = await beforeAbort(driver.eachMaster(['INFO', 'memory']), signal, 'INFO memory')
    const memory = replies.map(({ node, reply }) => ({ node, fields: infoFields(reply) })).map(({ node, fields }) => ({ node, maxmemory: Number(fields.get('maxmemory')), policy: fields.get('maxmemory_policy') ?? '' }))
    if (memory.every(({ maxmemory, policy }) => Number.isFinite(maxmemory) && policy !== '')) return memory
    refused = 'INFO memory did not say'
  } catch (error) {
    refused = `INFO was refused (${messageOf(error)})`
  }
  try {
    const replies = await beforeAbort(driver.eachMaster(['CONFIG', 'GET', 'maxmemory', 'maxmemory-policy']), signal, 'CONFIG GET')
    return replies.map(({ node, reply }) => ({ node, fields: configFields(reply) })).map(({ node, fields }) => ({ node, maxmemory: Number(fields.get('maxmemory')), policy: fields.get('maxmemory-policy') ?? '' }))
  } catch (error) {
    return `${refused}, and CONFIG GET too (${messageOf(error)})`
  }
}

const NAME = 'eviction policy'

export async function evictionCheck (driver: RedisDriver, allowEviction: boolean, signal: AbortSignal | undefined): Promise<StoreCheck> {
  const memory = await memorySettings(driver, signal)
  if (typeof memory === 'string') {
    return warning(NAME, `the eviction policy could not be read, so it is not proven that Redis never evicts a lease: ${memory}`,
      'allow INFO to the client\'s Redis user (+info), or make sure by hand that maxmemory-policy is noeviction')
  }
  const evicting = memory.filter(({ maxmemory, policy }) => maxmemory > 0 && policy !== 'noeviction')
  if (evicting.length === 0) {
    const limited = memory.find(({ maxmemory }) => maxmemory > 0)
    return passed(NAME, limited === undefined
      ? 'no maxmemory: Redis never evicts a key'
      : `maxmemory-policy noeviction (maxmemory ${limited.maxmemory} bytes): a full Redis refuses new keys, and evicts none`)
  }
  const { maxmemory, policy } = evicting[0]!
  const where = memory.length === 1 ? '' : ` on ${evicting.length} of ${memory.length} masters (${evicting.map(({ node }) => node).join(', ')})`
  const first = policy === 'volatile-ttl' ? ', leases first (they have the shortest time to live)' : ''
  const found = `maxmemory-policy ${policy} with maxmemory ${maxmemory} bytes${where}: under memory pressure Redis evicts keys of the store (each has an expiry)${first}, and a duplicate of a request whose lease was evicted runs while the first still runs`
  if (allowEviction) return warning(NAME, found, 'allowEviction: true accepts this risk; maxmemory-policy noeviction removes it')
  return failed(NAME, found, 'set maxmemory-policy noeviction (on ElastiCache or MemoryDB, in the parameter group), or give the idempotency keys a Redis of their own; allowEviction: true starts anyway, accepting the risk')
}

/** Persistence, where INFO tells it; `null` where it cannot be read (the eviction check said why). */
export async function persistenceCheck (driver: RedisDriver, signal: AbortSignal | undefined): Promise<StoreCheck | null> {
  const name = 'persistence'
  let aof: boolean[]
  try {
    aof = (await beforeAbort(driver.eachMaster(['INFO', 'persistence']), signal, 'INFO persistence')).map(({ reply }) => infoFields(reply).get('aof_enabled') === '1')
  } catch {
    return null
  }
  if (aof.every(Boolean)) return passed(name, 'append-only file on: a restart keeps the keys')
  let save: string[] | null
  try {
    save = (await beforeAbort(driver.eachMaster(['CONFIG', 'GET', 'save']), signal, 'CONFIG GET save')).map(({ reply }) => configFields(reply).get('save') ?? '')
  } catch {
    save = null
  }
  if (save === null) return passed(name, 'no append-only file, and the snapshot schedule could not be read (CONFIG GET refused): a restart forgets what changed since the last snapshot, if any')
  if (save.some((schedule, master) => schedule.trim() === '' && aof[master] !== true)) {
    return warning(name, 'persistence is off (no append-only file, no snapshots): a restart of Redis forgets every lease and stored response, and the retries that follow run again',
      'appendonly yes on the Redis that holds idempotency keys, or accept that its restart forgets them')
  }
  return passed(name, `snapshots (save ${save[0]}), no append-only file: a restart forgets what changed since the last snapshot`)
}

/**
 * A replica that takes writes (`replica-read-only no`): the probe's writes succeed there, but
 * they reach neither the primary nor the app's other instances, so a key runs once per server.
 * A failure, or `null` (a primary; or INFO refused, which the eviction check says).
 */
export async function replicaCheck (driver: RedisDriver, signal: AbortSignal | undefined): Promise<StoreCheck | null> {
  let roles: string[]
  try {
    roles = (await beforeAbort(driver.eachMaster(['INFO', 'replication']), signal, 'INFO replication')).map(({ reply }) => infoFields(reply).get('role') ?? '')
  } catch {
    return null
  }
  if (!roles.includes('slave')) return null
  return failed('replica', 'the server is a replica (role:slave) that takes writes (replica-read-only no): what the store writes there never reaches the primary nor the app\'s other instances, and the next resync drops it',
    'point the client at the primary')
}
