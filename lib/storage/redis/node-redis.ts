/**
 * The driver for node-redis (`redis` 5 and 6, `@redis/client`): a client of `createClient` or a
 * cluster of `createCluster`, on RESP2 or RESP3.
 *
 * Commands go through the client's raw `sendCommand`, with two options on each: bulk strings as
 * Buffers (a body is bytes), and no command timeout. node-redis 6 arms an `AbortSignal.timeout`
 * for every command by default (`commandOptions.timeout`, 5 s), which multiplies the client's cost
 * of a command by about five (131k against 20.5k instructions per GET, Node 20); the plugin bounds
 * every store call itself (`storeTimeout`), so the storage does not pay for a second timer.
 *
 * node-redis writes the commands of one event-loop turn in one write by itself, so the driver adds
 * no batching of its own. The raw path skips node-redis 6's `keyPrefix`, so the driver puts it in
 * front of each key itself, as the client's own commands do.
 *
 * A cluster routes each command by its key (`sendCommand(key, …)`); its SCAN runs on each
 * master's own client.
 */
import { mastersOfSlots, untilReady, type CommandArg, type NodeReply, type RedisDriver, type Subscription, type SubscriptionEvents } from './driver.js'
import { evalScript, type Script, type ScriptForm } from './scripts.js'

/** node-redis's RESP type of a bulk string (`RESP_TYPES.BLOB_STRING`), mapped to Buffer. */
const BLOB_STRING = 36

interface SendOptions { typeMapping?: Record<number, unknown>, timeout?: number }

/** Bulk strings as Buffers, and no per-command timer (see above). */
const COMMAND_OPTIONS: SendOptions = { typeMapping: { [BLOB_STRING]: Buffer }, timeout: 0 }

/** What the storage uses of a node-redis client (`createClient`). */
export interface NodeRedisClient {
  sendCommand: (args: CommandArg[], options?: SendOptions) => Promise<unknown>
  withCommandOptions: (options: SendOptions) => NodeRedisClient
  duplicate: () => NodeRedisClient
  connect: () => Promise<unknown>
  destroy: () => void
  subscribe: (channel: string, listener: (message: unknown, channel: string) => void) => Promise<void>
  unsubscribe: (channel: string, listener?: (message: unknown, channel: string) => void) => Promise<void>
  on: (event: string, listener: (...args: unknown[]) => void) => unknown
  once: (event: string, listener: (...args: unknown[]) => void) => unknown
  readonly isOpen: boolean
}

/** What the storage uses of a node-redis cluster (`createCluster`). */
export interface NodeRedisCluster {
  sendCommand: (firstKey: CommandArg | undefined, isReadonly: boolean | undefined, args: CommandArg[], options?: SendOptions) => Promise<unknown>
  withCommandOptions: (options: SendOptions) => NodeRedisCluster
  readonly masters: readonly unknown[]
  nodeClient: (node: never) => NodeRedisClient | Promise<NodeRedisClient>
  subscribe: (channel: string, listener: (message: unknown, channel: string) => void) => Promise<void>
  unsubscribe: (channel: string, listener?: (message: unknown, channel: string) => void) => Promise<void>
  readonly isOpen: boolean
}

/** Whether `client` is a node-redis 5 or 6 client or cluster (`withTypeMapping` is theirs alone). */
export function isNodeRedis (client: object): client is NodeRedisClient | NodeRedisCluster {
  const candidate = client as { sendCommand?: unknown, withTypeMapping?: unknown }
  return typeof candidate.sendCommand === 'function' && typeof candidate.withTypeMapping === 'function'
}

/** The `keyPrefix` node-redis 6 puts in front of every key of its own commands ('' in node-redis 5). */
export function nodeRedisKeyPrefix (client: NodeRedisClient | NodeRedisCluster): unknown {
  const options = client as { options?: { keyPrefix?: unknown }, _options?: { keyPrefix?: unknown } }
  return options.options?.keyPrefix ?? options._options?.keyPrefix
}

export class NodeRedisDriver implements RedisDriver {
  readonly family: string
  readonly cluster: boolean
  readonly keyPrefix: string
  readonly #client: NodeRedisClient | null
  readonly #cluster: NodeRedisCluster | null
  /**
   * What commands are sent through, and the options sent with each. node-redis merges a command's
   * options into the client's own with an object spread, which for a second source takes V8's slow
   * path: about 5.7k instructions per command (Node 20). Where the client's `sendCommand` reads the
   * options of a `withCommandOptions` view of it (node-redis 6), commands go through such a view,
   * made once, with none of their own. node-redis 5 reads the client's own options even through a
   * view, so there they go with each command.
   */
  readonly #sender: NodeRedisClient | null
  readonly #clusterSender: NodeRedisCluster | null
  readonly #perCommand: SendOptions | undefined
  readonly #loaded = new Set<Script>()

  constructor (client: NodeRedisClient | NodeRedisCluster, keyPrefix: string) {
    const isCluster = typeof (client as NodeRedisCluster).nodeClient === 'function'
    this.#cluster = isCluster ? client as NodeRedisCluster : null
    this.#client = isCluster ? null : client as NodeRedisClient
    const viewed = readsViewOptions(client.sendCommand)
    this.#perCommand = viewed ? undefined : COMMAND_OPTIONS
    const sender = viewed ? client.withCommandOptions(COMMAND_OPTIONS) : client
    this.#sender = isCluster ? null : sender as NodeRedisClient
    this.#clusterSender = isCluster ? sender as NodeRedisCluster : null
    this.cluster = isCluster
    this.family = isCluster ? 'node-redis cluster' : 'node-redis'
    this.keyPrefix = keyPrefix
  }

  call (name: string, key: string, args: CommandArg[]): Promise<unknown> {
    const redisKey = this.keyPrefix + key
    return this.#send(redisKey, [name, redisKey, ...args])
  }

  script (script: Script, key: string, args: CommandArg[], form?: ScriptForm): Promise<unknown> {
    const redisKey = this.keyPrefix + key
    return evalScript(this.#loaded, script, (name, body) => this.#send(redisKey, [name, body, '1', redisKey, ...args]), this.replyCode, form)
  }

  async clusterMasters (): Promise<Map<string, Set<number>>> {
    return mastersOfSlots(Array.from((this.#cluster as unknown as { slots: Array<{ master?: { address: string } } | undefined> }).slots, (shard) => shard?.master?.address))
  }

  async eachMaster (args: string[]): Promise<NodeReply[]> {
    if (this.#client !== null) return [{ node: '', reply: await this.#client.sendCommand(args, { timeout: 0 }) }]
    const cluster = this.#cluster!
    return await Promise.all(cluster.masters.map(async (master) => ({
      node: (master as { address: string }).address,
      reply: await (await cluster.nodeClient(master as never)).sendCommand(args, { timeout: 0 })
    })))
  }

  /**
   * A client or cluster whose `connect()` has not resolved yet (or not been called yet) refuses
   * commands, or queues them: it is waited for until it is ready (a client's `ready`, a
   * cluster's `connect` once it knows its slots).
   */
  async whenReady (signal?: AbortSignal): Promise<void> {
    const client = (this.#client ?? this.#cluster!) as unknown as { isReady?: boolean, isOpen: boolean, on: (event: string, listener: () => void) => unknown, off: (event: string, listener: () => void) => unknown }
    // A node-redis 5 cluster has no isReady: open is as much as it says.
    if (client.isReady ?? client.isOpen) return
    await untilReady(client, [this.#client === null ? 'connect' : 'ready'], signal, this.family, () => client.isOpen)
  }

  /** The client, or each master's client of a cluster. */
  async #servers (): Promise<NodeRedisClient[]> {
    return this.#client !== null
      ? [this.#client]
      : await Promise.all(this.#cluster!.masters.map((master) => this.#cluster!.nodeClient(master as never)))
  }

  #send (key: string, args: CommandArg[]): Promise<unknown> {
    if (this.#sender !== null) return this.#sender.sendCommand(args, this.#perCommand)
    return this.#clusterSender!.sendCommand(key, false, args, this.#perCommand)
  }

  async * scan (pattern: string, count: number): AsyncGenerator<string[]> {
    for (const server of await this.#servers()) {
      let cursor = '0'
      do {
        const [next, keys] = await server.sendCommand(['SCAN', cursor, 'MATCH', pattern, 'COUNT', String(count)], { timeout: 0 }) as [string, string[]]
        cursor = String(next)
        if (keys.length > 0) yield keys.map(String)
      } while (cursor !== '0')
    }
  }

  /**
   * A client's subscriber is a duplicate of it, connected now. A cluster subscribes through its own
   * pub/sub connection (separate from its command connections, and closed with the cluster); the
   * storage's listeners are its own, on channels of its own.
   */
  async subscribe (events: SubscriptionEvents): Promise<Subscription> {
    const listener = (_message: unknown, channel: unknown): void => { events.message(String(channel)) }
    const cluster = this.#cluster
    if (cluster !== null) {
      const channels = new Set<string>()
      return {
        subscribe: async (channel) => {
          channels.add(channel)
          await cluster.subscribe(channel, listener)
        },
        unsubscribe: async (channel) => {
          channels.delete(channel)
          await cluster.unsubscribe(channel, listener)
        },
        close: () => {
          for (const channel of channels) cluster.unsubscribe(channel, listener).catch(() => {})
          channels.clear()
        }
      }
    }
    const connection = this.#client!.duplicate()
    let closed = false
    connection.on('error', () => {})
    connection.on('end', () => { if (!closed) events.lost(new Error('RedisStorage: subscriber connection ended')) })
    await connection.connect()
    return {
      subscribe: (channel) => connection.subscribe(channel, listener),
      unsubscribe: (channel) => connection.unsubscribe(channel, listener),
      close: () => {
        closed = true
        connection.destroy()
      }
    }
  }

  /** A client says when it is closed; a cluster does not, and holds its pub/sub connection itself. */
  onClientEnd (listener: () => void): boolean {
    if (this.#client === null) return false
    this.#client.once('end', listener)
    return true
  }

  get ended (): boolean {
    return !(this.#client ?? this.#cluster!).isOpen
  }

  replyCode (this: void, error: unknown): string | null {
    return isErrorReply(error) ? (error as Error).message.split(' ', 1)[0]! : null
  }
}

/**
 * Whether a node-redis `sendCommand` merges the options of the view it is called on
 * (`...this._commandOptions`, node-redis 6) rather than the client's own
 * (`...this._self._commandOptions`, node-redis 5). Read from its source: a client whose source
 * says neither (bundled, minified) gets the options with each command, which is right on both.
 */
function readsViewOptions (sendCommand: unknown): boolean {
  return typeof sendCommand === 'function' && /\.\.\.this\._commandOptions\b/.test(Function.prototype.toString.call(sendCommand))
}

/** node-redis answers a Redis error with an ErrorReply (SimpleError, BlobError), each unnamed. */
function isErrorReply (error: unknown): boolean {
  if (!(error instanceof Error)) return false
  for (let proto: unknown = Object.getPrototypeOf(error); proto !== null && proto !== Error.prototype; proto = Object.getPrototypeOf(proto)) {
    if ((proto as { constructor?: { name?: string } }).constructor?.name === 'ErrorReply') return true
  }
  return false
}
