/**
 * A TCP proxy on a free loopback port in front of a real server, which a test can cut (every
 * connection reset, new ones refused), hang (every connection, old and new, accepted and never
 * answered: a server that is up but does not respond) or mute (what clients send reaches the
 * server, its answers do not come back: a connection lost after a command ran) and restore, to
 * stage an outage without touching the shared server.
 */
import { createServer, connect, type Server, type Socket } from 'node:net'

export interface Proxy {
  port: number
  /** Reset every open connection (those held while hung too) and refuse new ones until `restore`. */
  cut: () => void
  /** Resolves once `count` connections have been opened, and held, while hung (counted from the last `hang`). */
  held: (count: number) => Promise<void>
  /**
   * Forward nothing either way until `restore`, which delivers what waited, in order (a server
   * paused, then resumed); new connections are accepted and wait too.
   */
  hang: () => void
  /** Deliver what clients send; hold back what the server answers until `restore` (a `cut` loses it). */
  mute: () => void
  restore: () => void
  close: () => Promise<void>
}

export async function startProxy (targetHost: string, targetPort: number): Promise<Proxy> {
  const sockets = new Set<Socket>()
  let down = false
  let hung = false
  let muted = false
  /** Each server-side socket and the client it answers. */
  const answers = new Map<Socket, Socket>()
  /** Connections accepted while hung, forwarded once restored. */
  const held = new Set<Socket>()
  let heldSinceHang = 0
  const heldWaiters: Array<{ count: number, resolve: () => void }> = []
  const forward = (client: Socket): void => {
    const upstream = connect({ host: targetHost, port: targetPort })
    sockets.add(client)
    sockets.add(upstream)
    answers.set(upstream, client)
    const drop = () => {
      client.destroy()
      upstream.destroy()
      sockets.delete(client)
      sockets.delete(upstream)
      answers.delete(upstream)
    }
    client.on('error', drop).on('close', drop)
    upstream.on('error', drop).on('close', drop)
    client.pipe(upstream)
    if (!muted) upstream.pipe(client)
  }
  const server: Server = createServer((client) => {
    if (down) {
      client.resetAndDestroy()
      return
    }
    if (hung) {
      client.pause()
      held.add(client)
      client.on('error', () => {}).on('close', () => held.delete(client))
      heldSinceHang++
      for (const waiter of heldWaiters.filter(({ count }) => count <= heldSinceHang)) {
        heldWaiters.splice(heldWaiters.indexOf(waiter), 1)
        waiter.resolve()
      }
      return
    }
    forward(client)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as { port: number }).port,
    cut: () => {
      down = true
      // Newest first: the connections opened while hung (a cancel's, say) are reset before the ones they wait for.
      for (const socket of [...held, ...sockets]) socket.resetAndDestroy()
      sockets.clear()
      held.clear()
    },
    held: async (count) => {
      if (heldSinceHang >= count) return
      await new Promise<void>((resolve) => { heldWaiters.push({ count, resolve }) })
    },
    hang: () => {
      hung = true
      heldSinceHang = 0
      // Nothing is read from either side: what is sent waits in the sockets' buffers.
      for (const socket of sockets) socket.pause()
    },
    mute: () => {
      muted = true
      // What the server sends waits in its sockets' buffers.
      for (const upstream of answers.keys()) upstream.unpipe()
    },
    restore: () => {
      down = false
      if (muted) {
        muted = false
        for (const [upstream, client] of answers) upstream.pipe(client)
      }
      if (!hung) return
      hung = false
      for (const socket of sockets) socket.resume()
      for (const client of held) forward(client)
      held.clear()
    },
    close: async () => {
      down = true
      for (const socket of [...sockets, ...held]) socket.destroy()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    }
  }
}
