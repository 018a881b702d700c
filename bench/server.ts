/**
 * One benchmark server: `node --import tsx bench/server.ts <scenario>`, started by bench/run.ts
 * as a child process with an IPC channel. It listens on 127.0.0.1 on a free port, says so over
 * IPC, answers requests for its handler-execution counts, and closes (freeing its Redis keys'
 * client, SQL table, SQLite file) when told to or when the orchestrator goes away.
 */
import { scenario } from './scenarios/index.js'
import type { ExecutionStats } from './scenarios/common.js'

export type ToServer =
  | { type: 'stats', id: number, reset: boolean }
  | { type: 'close' }

export type FromServer =
  | { type: 'ready', port: number, pid: number }
  | { type: 'stats', id: number, stats: ExecutionStats, memory: NodeJS.MemoryUsage, cpu: NodeJS.CpuUsage, clockMicros: number }
  | { type: 'failed', message: string }

function send (message: FromServer): void {
  process.send?.(message)
}

const name = process.argv[2]
if (name === undefined || process.send === undefined) {
  console.error('usage: started by bench/run.ts: node --import tsx bench/server.ts <scenario> (with an IPC channel)')
  process.exit(2)
}

try {
  const server = await scenario(name).start()
  let closing = false
  const close = async (): Promise<void> => {
    if (closing) return
    closing = true
    try {
      await server.close()
    } catch (error) {
      console.error(`bench server ${name}: close failed:`, error)
    }
    // A normal exit, so that `--cpu-prof` writes its profile.
    process.exit(0)
  }
  process.on('message', (message: ToServer) => {
    if (message.type === 'stats') {
      // The monotonic clock V8 stamps profile samples with, so a profile can be cut to the measured window.
      const clockMicros = Number(process.hrtime.bigint() / 1000n)
      send({ type: 'stats', id: message.id, stats: server.counter.snapshot(), memory: process.memoryUsage(), cpu: process.cpuUsage(), clockMicros })
      if (message.reset) server.counter.reset()
    } else if (message.type === 'close') {
      void close()
    }
  })
  process.on('disconnect', () => { void close() })
  process.on('SIGTERM', () => { void close() })
  send({ type: 'ready', port: server.port, pid: process.pid })
} catch (error) {
  send({ type: 'failed', message: error instanceof Error ? error.stack ?? error.message : String(error) })
  process.exit(1)
}
