/**
 * What RedisStorage needs of a Redis client, whichever library it comes from: one command on one
 * key, a script on one key, a SCAN of every master, a subscriber connection, and the client's end.
 * One driver per client family (ioredis.ts: ioredis 5 and 6, iovalkey; node-redis.ts: `redis` 5
 * and 6; glide.ts: Valkey GLIDE 2), each a Redis and a Cluster, chosen by `driverFor` from the
 * client the storage is given. The storage sends the same commands, scripts and channels through
 * each.
 */
import { GlideDriver, isGlide } from './glide.js'
import { IoredisDriver, isIoredis } from './ioredis.js'
import { keyPrefixText } from './keys.js'
import { isNodeRedis, NodeRedisDriver, nodeRedisKeyPrefix } from './node-redis.js'
import type { Script, ScriptForm } from './scripts.js'

/** One master's reply to a command sent to every master; `node` is its `host:port` ('' for a Redis). */
export interface NodeReply {
  node: string
  reply: unknown
}

/** A command's argument, as every client takes it. */
export type CommandArg = string | Buffer

/** The storage's side of a subscriber connection (wait mode). */
export interface Subscription {
  subscribe: (channel: string) => Promise<void>
  unsubscribe: (channel: string) => Promise<void>
  /** Close it; nothing more is heard. */
  close: () => void
}

export interface SubscriptionEvents {
  /** A message on `channel` (a name as Redis has it). */
  message: (channel: string) => void
  /** The connection is gone for good: the waits in progress can no longer be woken. */
  lost: (error: Error) => void
}

export interface RedisDriver {
  /** The client family, as messages name it. */
  readonly family: string
  /** A cluster client: it routes each command to its key's slot. */
  readonly cluster: boolean
  /**
   * What Redis sees in front of every key this driver sends (the client's `keyPrefix`), '' for
   * none: names the storage builds outside key arguments (SCAN patterns, channels) carry it too.
   */
  readonly keyPrefix: string
  /** `name key ...args`, routed by `key`; string replies as Buffers (or null). */
  call: (name: string, key: string, args: CommandArg[]) => Promise<unknown>
  /**
   * `script` on `key` (EVALSHA, and EVAL when the server lacks it; with `form`, in that form
   * alone); integer replies as numbers.
   */
  script: (script: Script, key: string, args: CommandArg[], form?: ScriptForm) => Promise<unknown>
  /**
   * A cluster's masters (`host:port`), each with the slots the client routes to it (a client that
   * is no cluster is never asked). Rejects when the client knows none.
   */
  clusterMasters: () => Promise<Map<string, Set<number>>>
  /**
   * A command of no key (`INFO`, `CONFIG GET`) on every master: each master's reply, with the
   * master's `host:port` on a cluster ('' for a Redis).
   */
  eachMaster: (args: string[]) => Promise<NodeReply[]>
  /**
   * Resolves once the client is connected and ready for commands (a client still connecting, or
   * one made with `lazyConnect`, is waited for: with ioredis's `enableOfflineQueue: false` a
   * command sent meanwhile fails at once), or once it has given up for good (its next command
   * says why). Rejects, with the client's last error, when `signal` is aborted first.
   */
  whenReady: (signal?: AbortSignal) => Promise<void>
  /** The names matching `pattern` (as Redis has them), batch by batch, on every master. */
  scan: (pattern: string, count: number) => AsyncGenerator<string[]>
  /**
   * A subscriber connection of the storage's own, opened now. Its lifetime is the driver's to keep
   * within the client's: see `closesWithClient`.
   */
  subscribe: (events: SubscriptionEvents) => Promise<Subscription>
  /**
   * Call `listener` once when the client ends for good (its owner closed it). `false` when the
   * client never says: the storage then closes its subscriber as soon as nobody waits.
   */
  onClientEnd: (listener: () => void) => boolean
  /** The client has been closed by its owner. */
  readonly ended: boolean
  /**
   * The error Redis answered with, by its first word (`NOSCRIPT`, `OOM`, `WRONGTYPE`), or `null`
   * for an error that is not Redis's answer (a timeout, a connection lost): such a command may
   * have run.
   */
  replyCode: (error: unknown) => string | null
}

/**
 * The driver for `client`, by what it is; `null` for a client of no family this storage knows.
 * node-redis 4 (no type mapping: its replies cannot be bytes) is refused by name.
 */
export function driverFor (client: unknown): RedisDriver | null {
  if (typeof client !== 'object' || client === null) return null
  if (typeof (client as { commandOptions?: unknown }).commandOptions === 'function' && !isNodeRedis(client)) {
    throw new TypeError('RedisStorage: node-redis 4 is not supported (its replies cannot be read as bytes): use `redis` 5 or 6, ioredis, iovalkey or Valkey GLIDE')
  }
  if (isIoredis(client)) return new IoredisDriver(client, keyPrefixText((client as { options?: { keyPrefix?: unknown } }).options?.keyPrefix))
  if (isNodeRedis(client)) return new NodeRedisDriver(client, keyPrefixText(nodeRedisKeyPrefix(client)))
  if (isGlide(client)) return new GlideDriver(client)
  return null
}

/** What `untilReady` needs of a client: its events. */
interface Emitter {
  on: (event: string, listener: (...args: any[]) => void) => unknown
  off?: (event: string, listener: (...args: any[]) => void) => unknown
  removeListener?: (event: string, listener: (...args: any[]) => void) => unknown
}

/** A client that connected to the server, which then answered nothing before the time was up. */
export class SilentServerError extends Error {}

/**
 * Resolves once `client` emits one of `settled` (ready, or gone for good), rejects once `signal`
 * is aborted, with the last error the client reported meanwhile: a client still connecting, or
 * connected (its `connect` event) and waiting for the server's first answers (a paused server
 * takes connections in the kernel's backlog and answers nothing).
 */
export async function untilReady (client: Emitter, settled: readonly string[], signal: AbortSignal | undefined, family: string, opened: () => boolean = () => true): Promise<void> {
  let lastError = ''
  let reached = false
  const listeners: Array<[string, (...args: any[]) => void]> = []
  const remove = client.off ?? client.removeListener
  try {
    await new Promise<void>((resolve, reject) => {
      const listen = (event: string, listener: (...args: any[]) => void): void => {
        listeners.push([event, listener])
        client.on(event, listener)
      }
      // An error ends what `connect` said: the connection failed, or is being made again.
      listen('error', (error: unknown) => { lastError = error instanceof Error ? error.message : String(error); reached = false })
      listen('connect', () => { reached = true })
      for (const event of settled) listen(event, () => { resolve() })
      const aborted = (): void => {
        const last = lastError === '' ? '' : ` (its last error: ${lastError})`
        if (!opened()) reject(new Error(`the ${family} client was never connected: call its connect() before the app starts`))
        else if (reached) reject(new SilentServerError(`the ${family} client connected, but Redis did not answer before the time was up${last}`))
        else reject(new Error(`the ${family} client was still connecting when the time was up${last}`))
      }
      if (signal?.aborted === true) aborted()
      signal?.addEventListener('abort', aborted, { once: true })
      listeners.push(['abort', aborted])
    })
  } finally {
    for (const [event, listener] of listeners) {
      if (event === 'abort') signal?.removeEventListener('abort', listener)
      else remove?.call(client, event, listener)
    }
  }
}

/** The masters of a slot table (the master's `host:port` of each slot, `undefined` for a slot of none), each with its slots. */
export function mastersOfSlots (owners: ArrayLike<string | undefined>): Map<string, Set<number>> {
  const masters = new Map<string, Set<number>>()
  for (let slot = 0; slot < owners.length; slot++) {
    const node = owners[slot]
    if (node === undefined) continue
    if (!masters.has(node)) masters.set(node, new Set())
    masters.get(node)!.add(slot)
  }
  if (masters.size === 0) throw new Error('the client knows no slot of the cluster yet')
  return masters
}

/** A reply of GLIDE's to a command routed to every primary (`{ key: address, value }` pairs) as each node's reply. */
export function nodeReplies (reply: unknown): NodeReply[] {
  return (reply as Array<{ key: unknown, value: unknown }>).map((item) => ({ node: String(item.key), reply: item.value }))
}
