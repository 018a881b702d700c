/**
 * The waiting side of KnexStorage on PostgreSQL: LISTEN/NOTIFY, so that a request waiting for a
 * key's lease (wait mode) is woken from any process the moment the lease ends.
 *
 * One connection per storage, outside knex's pool (so it never holds a pool slot), opened on the
 * first wait and shared by all. A waiter listens first, then marks the row (`waiting`), which both
 * asks `complete`/`release` to notify and tells whether the lease is still held: an end that comes
 * after the wait began cannot be missed. A lease that lapses ends without a notification, so a
 * waiter also wakes at the lease end. Behind a pooler the listening connection first checks that
 * a notification reaches it (`#hears`): in transaction pooling none does, and waits reject (the
 * plugin polls).
 */
import { randomUUID } from 'node:crypto'
import type { Knex } from 'knex'
import { KeyWaiters, type Waiter } from '../waiters.js'
import type { PgConnection, PostgresDialect } from './postgres.js'
import { trimmed } from './rows.js'

/**
 * How long a probe notification may take to reach the listening connection behind a pooler. It
 * comes in a millisecond or two when it comes at all; a busy machine that misses this only costs
 * polling.
 */
const PROBE_WAIT = 1000

/** The listening connection (a pg `Client` of knex's driver, outside knex's pool), once it listens. */
interface Listener {
  /** Resolves once LISTEN is in effect. */
  ready: Promise<PgConnection>
  connection: PgConnection | undefined
  /** Why the connection is gone (it failed, or the storage closed it). */
  failure: Error | undefined
}

/** The part of knex's (untyped) pg client that opens connections outside its pool. */
interface KnexPgClient {
  acquireRawConnection?: () => Promise<PgConnection>
  connectionSettings?: unknown
  config?: { connectionPool?: unknown }
}

export interface PgListenerContext {
  /** The storage's dialect: its knex, its table's channel, and the statement that marks a lease waited for. */
  dialect: PostgresDialect
  /** Runs a statement, again if the server picked it as a deadlock victim. */
  retrying: <T>(statement: () => PromiseLike<T>) => Promise<T>
  /** Resolves once the storage has started (its table created). */
  started: () => Promise<void>
}

export class PgListener {
  readonly #context: PgListenerContext
  #listener: Listener | undefined
  /** Waits by the key as notifications carry it: its UTF-8 bytes in base64. */
  readonly #waiters = new KeyWaiters()
  /**
   * Set once a LISTEN through a pooler turned out to receive nothing (transaction pooling): every
   * wait then rejects at once, and the plugin polls.
   */
  #deaf: Error | undefined

  constructor (context: PgListenerContext) {
    this.#context = context
  }

  /**
   * Whether a storage on `knex` can open its own listening connection: knex's pg client opens
   * connections from its configuration. With an external `connectionPool`, knex has no
   * configuration to open one with, and the plugin polls instead.
   */
  static canListen (knex: Knex): boolean {
    const client = knex.client as KnexPgClient | undefined
    return typeof client?.acquireRawConnection === 'function' && client.config?.connectionPool === undefined
  }

  /**
   * Resolves once the lease on the key `id` was completed or released (from any process), or
   * lapsed, or after `timeout` ms. Rejects when the listening connection fails (the plugin then
   * polls); the next call opens a new one.
   */
  async waitFor (id: Buffer, timeout: number): Promise<void> {
    if (typeof timeout !== 'number' || !(timeout > 0)) return
    // The timer runs from the call: a slow connect or mark counts against the timeout.
    const waiter = this.#waiters.add(id.toString('base64'), timeout)
    void this.#subscribe(id, waiter)
    await waiter.promise
  }

  /** End the listening connection; pending waits resolve (their callers ask `begin` again). */
  async close (): Promise<void> {
    const listener = this.#listener
    this.#listener = undefined
    this.#waiters.wakeAll()
    if (listener === undefined) return
    listener.failure ??= new Error('KnexStorage: closed')
    try {
      await (await listener.ready).end()
    } catch {
      // It failed to open, or is gone already: nothing left to end.
    }
  }

  /** Listen, then mark the row; settles the waiter at once when the lease is not held any more. */
  async #subscribe (id: Buffer, waiter: Waiter): Promise<void> {
    const { dialect, retrying, started } = this.#context
    try {
      await started()
      if (this.#deaf !== undefined) throw this.#deaf
      const listener = this.#listening()
      await listener.ready
      if (waiter.settled) return
      if (listener.failure !== undefined) throw listener.failure
      // Subscribed before the mark: the notification may overtake the mark's answer.
      const remaining = await retrying(() => dialect.markWaiting(id))
      if (remaining === undefined) waiter.settle()
      // A lease that lapses ends without a notification: wake up then, if that is before the timeout.
      else waiter.shorten(remaining)
    } catch (error) {
      waiter.settle(trimmed(error))
    }
  }

  /** The listening connection, opened on first use and again after a failure or close. */
  #listening (): Listener {
    if (this.#listener !== undefined) return this.#listener
    const listener: Listener = { ready: undefined as unknown as Promise<PgConnection>, connection: undefined, failure: undefined }
    listener.ready = this.#open(listener)
    listener.ready.catch((error: unknown) => this.#drop(listener, error))
    this.#listener = listener
    return listener
  }

  async #open (listener: Listener): Promise<PgConnection> {
    const { knex, channel } = this.#context.dialect
    const client = knex.client as Required<KnexPgClient>
    // A connection given as a function is resolved by the pool when it first connects.
    if (client.connectionSettings === undefined) await knex.raw('SELECT 1')
    // knex's own pg driver and settings (host, TLS, searchPath...), outside the pool. knex listens
    // to its 'error' event too; neither lets one crash the process.
    const connection = await client.acquireRawConnection()
    listener.connection = connection
    connection.on('error', (error: unknown) => this.#drop(listener, error))
    connection.on('end', () => this.#drop(listener, new Error('the connection ended')))
    connection.on('notification', (message: { channel: string, payload?: string }) => {
      if (message.channel === channel && message.payload !== undefined) this.#waiters.wake(message.payload)
    })
    // It must not keep the process alive on its own: a pending wait holds its timer.
    connection.unref?.()
    if (listener.failure !== undefined) {
      // Closed while connecting: end it before close() returns.
      await connection.end().catch(() => {})
      throw listener.failure
    }
    await connection.query(`LISTEN "${channel}"`)
    if (this.#context.dialect.pooled) await this.#hears(connection)
    return connection
  }

  /**
   * Behind a pooler, whether a notification sent from another connection reaches `connection`. In
   * session pooling it keeps its server connection, which listens, and it does. In transaction
   * pooling the LISTEN ran on a server connection that went back to the pool: notifications reach
   * that server connection, never this client, so waits would sleep to their timeout. Then this
   * storage stops listening for good, and waits poll.
   */
  async #hears (connection: PgConnection): Promise<void> {
    const { knex, channel } = this.#context.dialect
    // Not base64, so no waiter's key.
    const probe = `probe:${randomUUID()}`
    let heard!: () => void
    const arrived = new Promise<void>((resolve) => { heard = resolve })
    const listen = (message: { channel: string, payload?: string }): void => { if (message.channel === channel && message.payload === probe) heard() }
    connection.on('notification', listen)
    let timer: NodeJS.Timeout | undefined
    try {
      await knex.raw('SELECT pg_notify(?, ?)', [channel, probe])
      const deaf = await Promise.race([arrived.then(() => false), new Promise<boolean>((resolve) => { timer = setTimeout(resolve, PROBE_WAIT, true) })])
      if (deaf) {
        this.#deaf = new Error('KnexStorage: a LISTEN through this pooler receives no notifications (transaction pooling): waits poll')
        throw this.#deaf
      }
    } finally {
      clearTimeout(timer)
      connection.off('notification', listen)
    }
  }

  /** The listening connection failed or ended: its waits reject (the plugin polls), the next wait opens anew. */
  #drop (listener: Listener, error: unknown): void {
    if (listener.failure === undefined) {
      const reason = error instanceof Error ? error.message : String(error)
      listener.failure = new Error(`KnexStorage: the listening connection failed: ${reason}`, { cause: error })
      if (this.#listener === listener) this.#listener = undefined
      // Every wait is on this connection (or waits to be): the next one opens only once this one
      // is dropped (or closed, which settles every waiter), and its waiters subscribe after that.
      this.#waiters.wakeAll(listener.failure)
    }
    listener.connection?.end().catch(() => {})
  }
}
