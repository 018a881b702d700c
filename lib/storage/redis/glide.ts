/**
 * The driver for Valkey GLIDE 2 (`@valkey/valkey-glide`): a `GlideClient` or a
 * `GlideClusterClient`, on RESP2 or RESP3. GLIDE's core (in Rust) multiplexes every request over
 * one connection per node and writes them as they come, so the driver adds no batching.
 *
 * Commands go through `customCommand` with the Bytes decoder (a body is bytes); on a cluster each
 * is routed explicitly to the primary of its key's slot. GLIDE has no `duplicate()` and no event
 * for its close: the subscriber of wait mode is a second client made from the client's own
 * configuration (its addresses, credentials, TLS), with pub/sub on RESP3, and it is closed as soon
 * as nobody waits, so that it never holds a process open that its owner has closed.
 */
import { mastersOfSlots, nodeReplies, type CommandArg, type NodeReply, type RedisDriver, type Subscription, type SubscriptionEvents } from './driver.js'
import { evalScript, type Script, type ScriptForm } from './scripts.js'

/**
 * The kinds of Redis answers GLIDE's core names in its messages, as Redis's own codes (GLIDE drops
 * the code: `- PermissionDenied: this user has no permissions ...` for `NOPERM this user ...`).
 * The kinds it names that are no answer (IoError, ClientError...) are left out.
 */
const GLIDE_KINDS = new Map([
  ['NoScriptError', 'NOSCRIPT'],
  ['PermissionDenied', 'NOPERM'],
  ['ReadOnly', 'READONLY'],
  ['BusyLoadingError', 'LOADING'],
  ['ExecAbortError', 'EXECABORT'],
  ['TryAgain', 'TRYAGAIN'],
  ['ClusterDown', 'CLUSTERDOWN'],
  ['CrossSlot', 'CROSSSLOT'],
  ['MasterDown', 'MASTERDOWN'],
  ['NotBusy', 'NOTBUSY'],
  ['Moved', 'MOVED'],
  ['Ask', 'ASK']
])

/**
 * How long a SUBSCRIBE (or UNSUBSCRIBE) of the subscriber may go unconfirmed. GLIDE's core retries
 * a refused SUBSCRIBE (a Redis user without it, or without the channel) for ever and only logs
 * why; a call that waits without a limit never settles, and holds the process open even once the
 * connection is closed.
 */
const SUBSCRIBE_MS = 2000

/** SUBSCRIBE to `channel`, confirmed within SUBSCRIBE_MS; else why not, as far as GLIDE tells. */
async function confirmed (connection: SubscriberClient, channel: string): Promise<void> {
  try {
    await connection.subscribe(new Set([channel]), SUBSCRIBE_MS)
  } catch (error) {
    if ((error as Error).name !== 'TimeoutError') throw error
    throw new Error(`the server did not confirm SUBSCRIBE to ${channel} within ${SUBSCRIBE_MS} ms: the client's Redis user may not SUBSCRIBE to it? (Valkey GLIDE retries it in the background, and logs why)`)
  }
}

/** GLIDE's `Decoder.Bytes` and `ProtocolVersion.RESP3`, by value (the package is not a dependency). */
const BYTES = 0
const RESP3 = 0

type Route = 'allPrimaries' | 'randomNode' | { type: 'primarySlotKey', key: string } | { type: 'routeByAddress', host: string }

/** What the storage uses of a GLIDE client. */
export interface GlideLikeClient {
  customCommand: (args: CommandArg[], options?: { decoder?: number, route?: Route }) => Promise<unknown>
  close: (errorMessage?: string) => void
}

interface SubscriberClient extends GlideLikeClient {
  subscribe: (channels: Set<string>, timeoutMs: number) => Promise<void>
  unsubscribe: (channels: Set<string>, timeoutMs: number) => Promise<void>
}

interface GlideClass {
  createClient: (configuration: object) => Promise<SubscriberClient>
}

/** Whether `client` is a GLIDE client (`invokeScript` and `customCommand` are theirs together). */
export function isGlide (client: object): client is GlideLikeClient {
  const candidate = client as { customCommand?: unknown, invokeScript?: unknown }
  return typeof candidate.customCommand === 'function' && typeof candidate.invokeScript === 'function'
}

export class GlideDriver implements RedisDriver {
  readonly family: string
  readonly keyPrefix = ''
  readonly #client: GlideLikeClient
  readonly cluster: boolean
  readonly #loaded = new Set<Script>()

  constructor (client: GlideLikeClient) {
    this.#client = client
    // Only a cluster client routes functions (fcallWithRoute).
    this.cluster = typeof (client as { fcallWithRoute?: unknown }).fcallWithRoute === 'function'
    this.family = this.cluster ? 'Valkey GLIDE cluster' : 'Valkey GLIDE'
  }

  call (name: string, key: string, args: CommandArg[]): Promise<unknown> {
    return this.#send(key, [name, key, ...args])
  }

  script (script: Script, key: string, args: CommandArg[], form?: ScriptForm): Promise<unknown> {
    return evalScript(this.#loaded, script, (name, body) => this.#send(key, [name, body, '1', key, ...args]), this.replyCode, form)
  }

  /** GLIDE keeps its slot table to itself: the cluster's own, from a node. */
  async clusterMasters (): Promise<Map<string, Set<number>>> {
    const owners: Array<string | undefined> = new Array(16384)
    for (const [start, end, master] of await this.#client.customCommand(['CLUSTER', 'SLOTS'], { route: 'randomNode' }) as Array<[unknown, unknown, unknown[]]>) {
      owners.fill(`${String(master[0])}:${String(master[1])}`, Number(start), Number(end) + 1)
    }
    return mastersOfSlots(owners)
  }

  async eachMaster (args: string[]): Promise<NodeReply[]> {
    if (!this.cluster) return [{ node: '', reply: await this.#client.customCommand(args) }]
    return nodeReplies(await this.#client.customCommand(args, { route: 'allPrimaries' }))
  }

  /** A GLIDE client is connected once `createClient` has resolved: nothing to wait for. */
  async whenReady (): Promise<void> {}

  #send (key: string, args: CommandArg[]): Promise<unknown> {
    return this.#client.customCommand(args, this.cluster ? { decoder: BYTES, route: { type: 'primarySlotKey', key } } : { decoder: BYTES })
  }

  async * scan (pattern: string, count: number): AsyncGenerator<string[]> {
    const command = (cursor: string): string[] => ['SCAN', cursor, 'MATCH', pattern, 'COUNT', String(count)]
    if (!this.cluster) {
      let cursor = '0'
      do {
        const [next, keys] = await this.#client.customCommand(command(cursor), { decoder: BYTES }) as [Buffer, Buffer[]]
        cursor = next.toString()
        if (keys.length > 0) yield keys.map((name) => name.toString())
      } while (cursor !== '0')
      return
    }
    // The first page from every primary at once, then each primary on its own cursor.
    const first = await this.#client.customCommand(command('0'), { decoder: BYTES, route: 'allPrimaries' }) as Array<{ key: Buffer | string, value: [Buffer, Buffer[]] }>
    for (const { key, value } of first) {
      const address = String(key)
      let [next, keys] = value
      for (;;) {
        if (keys.length > 0) yield keys.map((name) => name.toString())
        const cursor = next.toString()
        if (cursor === '0') break
        ;[next, keys] = await this.#client.customCommand(command(cursor), { decoder: BYTES, route: { type: 'routeByAddress', host: address } }) as [Buffer, Buffer[]]
      }
    }
  }

  async subscribe (events: SubscriptionEvents): Promise<Subscription> {
    const own = this.#client as unknown as { constructor: GlideClass, config?: object }
    const connection = await own.constructor.createClient({
      ...own.config,
      protocol: RESP3,
      pubsubSubscriptions: { channelsAndPatterns: {}, callback: (message: { channel: unknown }) => { events.message(String(message.channel)) } }
    })
    return {
      subscribe: async (channel) => { await confirmed(connection, channel) },
      unsubscribe: (channel) => connection.unsubscribe(new Set([channel]), SUBSCRIBE_MS),
      close: () => { connection.close() }
    }
  }

  onClientEnd (): boolean {
    return false
  }

  get ended (): boolean {
    return (this.#client as unknown as { isClosed?: boolean }).isClosed === true
  }

  /**
   * GLIDE answers a Redis error with a RequestError: `WRONGTYPE: …`, or `An error was signalled by
   * the server: - NoScriptError: …` for the kinds its core names; the same class also carries
   * errors of its own connection (IoError and others), which are not answers.
   */
  replyCode (this: void, error: unknown): string | null {
    if (!(error instanceof Error) || error.name !== 'RequestError') return null
    const named = /^An error was signalled by the server: - (\w+): (.*)$/s.exec(error.message)
    if (named === null) return /^[A-Z]+\b/.exec(error.message)?.[0] ?? null
    if (named[1] === 'ResponseError' || named[1] === 'ExtensionError') return /^[A-Z]+\b/.exec(named[2]!)?.[0] ?? named[1]
    return GLIDE_KINDS.get(named[1]!) ?? null
  }
}
