/**
 * A TCP proxy on a free loopback port in front of a real server, which a test can cut (every
 * connection reset, new ones refused) and restore, to stage an outage without touching the
 * shared server.
 */
import { createServer, connect, type Server, type Socket } from 'node:net'

export interface Proxy {
  port: number
  /** Reset every open connection and refuse new ones until `restore`. */
  cut: () => void
  restore: () => void
  close: () => Promise<void>
}

export async function startProxy (targetHost: string, targetPort: number): Promise<Proxy> {
  const sockets = new Set<Socket>()
  let down = false
  const server: Server = createServer((client) => {
    if (down) {
      client.resetAndDestroy()
      return
    }
    const upstream = connect({ host: targetHost, port: targetPort })
    sockets.add(client)
    sockets.add(upstream)
    const drop = () => {
      client.destroy()
      upstream.destroy()
      sockets.delete(client)
      sockets.delete(upstream)
    }
    client.on('error', drop).on('close', drop)
    upstream.on('error', drop).on('close', drop)
    client.pipe(upstream)
    upstream.pipe(client)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as { port: number }).port,
    cut: () => {
      down = true
      for (const socket of sockets) socket.resetAndDestroy()
      sockets.clear()
    },
    restore: () => { down = false },
    close: async () => {
      down = true
      for (const socket of sockets) socket.destroy()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    }
  }
}
