/**
 * The driver for ioredis 5 and 6 and for iovalkey (the ioredis fork for Valkey), Redis and Cluster.
 *
 * On a `Redis` client, each command goes straight to the client's `sendCommand`, and the client's
 * socket is corked until the end of the event-loop turn (`setImmediate`), so the commands of all
 * the requests handled in one turn leave in one write. ioredis's `enableAutoPipelining` batches
 * over the same span, but with more work per command (a Pipeline per batch, every command queued
 * twice, the batch concatenated into one string, callbacks deferred once more), and its batches
 * keep objects alive long enough to be promoted out of V8's young generation (a loop of SETs
 * through one client promoted 2.2 MB per scavenge auto-pipelined, 25 KB without). Measured at a
 * fixed 10,000 req/s (`npm run bench:rate`, the same auto-pipelined client, two alternating runs
 * each), server CPU per request: first requests 46.3–46.9 µs through the auto-pipeline,
 * 34.5–36.1 µs this way; replays 37.5–43.1 and 25.1–26.1. Sent one by one without the cork,
 * every command is a write of its own: 44.5 and 30.7 µs.
 *
 * The socket stays the client's: only the timing of its writes changes, within one turn. Commands
 * the application sends on the same client in that turn leave in the same write, as they would
 * with auto-pipelining; nothing stays corked past the turn.
 *
 * The Command objects are built with the class of the library that made the client (read once from
 * a pipeline it makes and never runs: this module loads no copy of ioredis itself, which an app on
 * node-redis or GLIDE does not have): a client of another copy of ioredis than the one an app
 * imports, or of iovalkey, takes the same path. A Cluster's sockets are its nodes', and it routes each command
 * itself: there the driver calls the client's own Buffer methods, and the client's auto-pipelining
 * (when enabled) batches them. Either way the client puts its `keyPrefix` in front of each key.
 */
import type { Cluster, Redis } from 'ioredis'
import { mastersOfSlots, untilReady, type CommandArg, type NodeReply, type RedisDriver, type Subscription, type SubscriptionEvents } from './driver.js'
import { evalScript, type Script, type ScriptForm } from './scripts.js'

type IoredisClient = Redis | Cluster

interface CommandClass {
  new (name: string, args: CommandArg[], options: { keyPrefix?: string, errorStack?: Error }): { promise: Promise<unknown> }
}

interface Corkable { cork: () => void, uncork: () => void }

/** A client's own command method (`setBuffer`, `evalshaBuffer`): replies as Redis sent them. */
type Method = (...args: CommandArg[]) => Promise<unknown>

/** Whether `client` is an ioredis or iovalkey Redis or Cluster (`defineCommand` is theirs alone). */
export function isIoredis (client: object): client is IoredisClient {
  const candidate = client as { defineCommand?: unknown, evalsha?: unknown }
  return typeof candidate.defineCommand === 'function' && typeof candidate.evalsha === 'function'
}

/**
 * The Command class of the library that made `client`: what its pipelines queue. A pipeline sends
 * nothing until it is executed; this one never is. `null` where none shows (the client's methods
 * are used then).
 */
function commandClassOf (client: Redis): CommandClass | null {
  const pipeline = client.pipeline() as unknown as { echo: (text: string) => unknown, _queue?: unknown[] }
  pipeline.echo('')
  const queued = pipeline._queue?.[0] as { constructor?: unknown } | undefined
  return typeof queued?.constructor === 'function' ? queued.constructor as CommandClass : null
}

/**
 * Resolves once `client` emits one of `settled` (see `untilReady`). ioredis reports a connection
 * only through its status and events; a client made with `lazyConnect` (status `wait`) connects
 * on its first command, so it is asked to now, as that command would. `end`: it gave up for good,
 * and its next command says so.
 */
async function connected (client: IoredisClient, settled: readonly string[], signal: AbortSignal | undefined, family: string): Promise<void> {
  const { status } = client as { status: string }
  if (status === 'ready' || status === 'end') return
  if (status === 'wait') client.connect().catch(() => {})
  await untilReady(client, settled, signal, family)
}

export class IoredisDriver implements RedisDriver {
  readonly family: string
  readonly cluster: boolean
  readonly keyPrefix: string
  readonly #client: IoredisClient
  /** The Command class of a Redis client's own library; `null` for a Cluster. */
  readonly #Command: CommandClass | null
  readonly #loaded = new Set<Script>()
  #corked: Corkable | null = null
  readonly #uncork = (): void => {
    const stream = this.#corked
    this.#corked = null
    stream?.uncork()
  }

  constructor (client: IoredisClient, keyPrefix: string) {
    this.#client = client
    this.keyPrefix = keyPrefix
    const isCluster = (client as { isCluster?: boolean }).isCluster === true
    this.cluster = isCluster
    this.family = isCluster ? 'ioredis Cluster' : 'ioredis'
    this.#Command = isCluster ? null : commandClassOf(client as Redis)
  }

  call (name: string, key: string, args: CommandArg[]): Promise<unknown> {
    return this.#send(name, [key, ...args])
  }

  script (script: Script, key: string, args: CommandArg[], form?: ScriptForm): Promise<unknown> {
    return evalScript(this.#loaded, script, (name, body) => this.#send(name, [body, '1', key, ...args]), this.replyCode, form)
  }

  async clusterMasters (): Promise<Map<string, Set<number>>> {
    return mastersOfSlots(Array.from((this.#client as Cluster).slots, (nodes) => nodes?.[0]))
  }

  async eachMaster (args: string[]): Promise<NodeReply[]> {
    const client = this.#client
    const servers = typeof (client as Cluster).nodes === 'function' ? (client as Cluster).nodes('master') : [client as Redis]
    return await Promise.all(servers.map(async (server) => ({
      node: this.cluster ? `${server.options.host ?? ''}:${server.options.port ?? ''}` : '',
      reply: await server.call(args[0]!, ...args.slice(1))
    })))
  }

  async whenReady (signal?: AbortSignal): Promise<void> {
    await connected(this.#client, ['ready', 'end'], signal, this.family)
  }

  /** Send `name` with `args`; string replies come back as Buffers (or null). */
  #send (name: string, args: CommandArg[]): Promise<unknown> {
    const Command = this.#Command
    if (Command === null) return (this.#client as unknown as Record<string, Method>)[`${name}Buffer`]!(...args)
    const client = this.#client as Redis
    this.#cork(client.stream)
    // What ioredis's own command methods pass, without a reply encoding: replies stay Buffers.
    const command = new Command(name, args, {
      keyPrefix: client.options.keyPrefix,
      errorStack: client.options.showFriendlyErrorStack === true ? new Error() : undefined
    })
    void client.sendCommand(command as never)
    return command.promise
  }

  /** Cork the socket once per event-loop turn (none yet: ioredis queues the command meanwhile). */
  #cork (stream: Corkable | null | undefined): void {
    if (this.#corked !== null || stream === undefined || stream === null) return
    stream.cork()
    this.#corked = stream
    setImmediate(this.#uncork)
  }

  async * scan (pattern: string, count: number): AsyncGenerator<string[]> {
    const client = this.#client
    const servers = typeof (client as Cluster).nodes === 'function' ? (client as Cluster).nodes('master') : [client as Redis]
    for (const server of servers) {
      let cursor = '0'
      do {
        const [next, keys] = await server.scan(cursor, 'MATCH', pattern, 'COUNT', count)
        cursor = next
        if (keys.length > 0) yield keys
      } while (cursor !== '0')
    }
  }

  /** A duplicate of the client: the same options, a connection of its own. */
  async subscribe (events: SubscriptionEvents): Promise<Subscription> {
    const connection = (this.#client as Redis).duplicate()
    let closed = false
    connection.on('message', (channel: unknown) => { events.message(String(channel)) })
    // Its errors must not go unhandled; the end of the connection says what matters.
    connection.on('error', () => {})
    connection.on('end', () => { if (!closed) events.lost(new Error('RedisStorage: subscriber connection ended')) })
    // Without an offline queue, a SUBSCRIBE sent while it connects would fail at once (and a
    // duplicate of a lazyConnect client would never connect): it is sent once the connection is
    // ready, or has failed (then SUBSCRIBE says why, and waits poll).
    if (connection.options.enableOfflineQueue === false) await connected(connection, ['ready', 'end', 'error'], undefined, this.family)
    return {
      subscribe: async (channel) => { await connection.subscribe(channel) },
      unsubscribe: async (channel) => { await connection.unsubscribe(channel) },
      close: () => {
        closed = true
        connection.disconnect()
      }
    }
  }

  onClientEnd (listener: () => void): boolean {
    this.#client.once('end', listener)
    return true
  }

  get ended (): boolean {
    return this.#client.status === 'end'
  }

  replyCode (this: void, error: unknown): string | null {
    return error instanceof Error && error.name === 'ReplyError' ? error.message.split(' ', 1)[0]! : null
  }
}
