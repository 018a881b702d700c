/**
 * How RedisStorage sends the commands on a request's path: begin's `SET … NX GET` and the
 * scripts that end, renew and mark a lease.
 *
 * On a Redis client, each command goes straight to the client's `sendCommand`, and the client's
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
 * with auto-pipelining.
 *
 * A Cluster's sockets are its nodes', and it routes each command itself: there the storage calls
 * the client's own methods, and the client's auto-pipelining (when enabled) batches them. So it
 * does for a client of another copy of ioredis than the one this module loads (an application can
 * have two): Command objects differ between ioredis versions.
 */
import { Command, Redis, type Cluster } from 'ioredis'

export type CommandArg = string | number | Buffer

/** A client's own command method (`setBuffer`, `evalshaBuffer`): replies as Redis sent them. */
type Method = (...args: CommandArg[]) => Promise<unknown>

interface Corkable { cork: () => void, uncork: () => void }

/** Sends RedisStorage's commands on a request's path, batched per event-loop turn (see above). */
export class RedisCommands {
  readonly client: Redis | Cluster
  /** A Redis client of the ioredis this module loads: it takes Command objects built here. */
  readonly #direct: Redis | null
  #corked: Corkable | null = null
  readonly #uncork = (): void => {
    const stream = this.#corked
    this.#corked = null
    stream?.uncork()
  }

  constructor (client: Redis | Cluster) {
    this.client = client
    // A client from another copy of ioredis (an application can have two) gets its own methods:
    // Command objects differ between ioredis versions.
    this.#direct = client instanceof Redis ? client : null
  }

  /** Send `name` with `args`; string replies come back as Buffers (or null). */
  send (name: string, args: CommandArg[]): Promise<unknown> {
    const client = this.#direct
    if (client === null) return (this.client as unknown as Record<string, Method>)[`${name}Buffer`]!(...args)
    this.#cork(client.stream)
    // What ioredis's own command methods pass, without a reply encoding: replies stay Buffers.
    const command = new Command(name, args, {
      keyPrefix: client.options.keyPrefix,
      errorStack: client.options.showFriendlyErrorStack === true ? new Error() : undefined
    })
    void client.sendCommand(command)
    return command.promise
  }

  /** Cork the socket once per event-loop turn (none yet: ioredis queues the command meanwhile). */
  #cork (stream: Corkable | null | undefined): void {
    if (this.#corked !== null || stream === undefined || stream === null) return
    stream.cork()
    this.#corked = stream
    setImmediate(this.#uncork)
  }
}
