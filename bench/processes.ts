/**
 * Child processes of the orchestrator: a scenario's server (bench/server.ts) and the memory check
 * (bench/memory.ts), both run by Node with tsx's loader and an IPC channel.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import { Redis } from 'ioredis'
import { benchEnv, type ExecutionStats } from './scenarios/common.js'
import type { FromServer, ToServer } from './server.js'
import type { MemoryReport } from './memory.js'

export const REPO_ROOT = fileURLToPath(new URL('..', import.meta.url))
const SERVER = fileURLToPath(new URL('./server.ts', import.meta.url))
const MEMORY = fileURLToPath(new URL('./memory.ts', import.meta.url))
// Which better-sqlite3 knex loads on this Node (12 on Node 20, 13 on 22 and later): see the file.
const SQLITE_DRIVER = fileURLToPath(new URL('../scripts/sqlite-driver.cjs', import.meta.url))

/** `wrapper` runs Node under another program (bench/instructions.ts: valgrind); the child's pid stays Node's. */
function nodeChild (script: string, args: string[], nodeArgs: string[], env: NodeJS.ProcessEnv, wrapper: readonly string[] = []): ChildProcess {
  const command = [...wrapper, process.execPath, ...nodeArgs, '--require', SQLITE_DRIVER, '--import', 'tsx', script, ...args]
  return spawn(command[0]!, command.slice(1), {
    cwd: REPO_ROOT,
    env: { ...process.env, ...env },
    stdio: ['ignore', 'inherit', 'inherit', 'ipc']
  })
}

function exited (child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => child.once('exit', () => resolve()))
}

export interface ServerStats {
  stats: ExecutionStats
  memory: NodeJS.MemoryUsage
  /** The server process's CPU time so far (user and system, microseconds). */
  cpu: NodeJS.CpuUsage
  /** The server's monotonic clock, in the microseconds V8 stamps profile samples with. */
  clockMicros: number
}

/** A running scenario server. */
export class ServerProcess {
  readonly name: string
  readonly port: number
  readonly #child: ChildProcess
  readonly #pending = new Map<number, (value: ServerStats) => void>()
  #nextId = 0

  private constructor (name: string, port: number, child: ChildProcess) {
    this.name = name
    this.port = port
    this.#child = child
    child.on('message', (message: FromServer) => {
      if (message.type !== 'stats') return
      const resolve = this.#pending.get(message.id)
      this.#pending.delete(message.id)
      resolve?.({ stats: message.stats, memory: message.memory, cpu: message.cpu, clockMicros: message.clockMicros })
    })
  }

  static async start (name: string, env: NodeJS.ProcessEnv, nodeArgs: string[] = [], options: { wrapper?: readonly string[], startSeconds?: number } = {}): Promise<ServerProcess> {
    const child = nodeChild(SERVER, [name], nodeArgs, env, options.wrapper)
    const startSeconds = options.startSeconds ?? 60
    const port = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => {
        child.kill()
        reject(new Error(`server ${name} did not start within ${startSeconds} s`))
      }, startSeconds * 1000)
      child.on('message', (message: FromServer) => {
        if (message.type === 'ready') {
          clearTimeout(timer)
          resolve(message.port)
        } else if (message.type === 'failed') {
          clearTimeout(timer)
          reject(new Error(`server ${name} failed to start: ${message.message}`))
        }
      })
      child.once('exit', (code, signal) => {
        clearTimeout(timer)
        reject(new Error(`server ${name} exited during start (${signal ?? code})`))
      })
    })
    return new ServerProcess(name, port, child)
  }

  get url (): string {
    return `http://127.0.0.1:${this.port}`
  }

  get pid (): number | undefined {
    return this.#child.pid
  }

  /** Handler executions since the last reset (and reset them when asked). */
  async stats (reset: boolean): Promise<ServerStats> {
    const id = ++this.#nextId
    const result = new Promise<ServerStats>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`server ${this.name} did not answer stats`)), 10_000)
      this.#pending.set(id, (value) => {
        clearTimeout(timer)
        resolve(value)
      })
    })
    this.#child.send({ type: 'stats', id, reset } satisfies ToServer)
    return await result
  }

  /** Ask the server to close (it frees its own resources); kill it if it has not exited in 15 s. */
  async close (): Promise<void> {
    if (this.#child.exitCode !== null || this.#child.signalCode !== null) return
    if (this.#child.connected) this.#child.send({ type: 'close' } satisfies ToServer)
    const timer = setTimeout(() => this.#child.kill('SIGKILL'), 15_000)
    await exited(this.#child)
    clearTimeout(timer)
  }
}

/** Run the memory check in a fresh process (its own heap, `--expose-gc`). */
export async function runMemoryCheck (requests: number): Promise<MemoryReport> {
  const child = nodeChild(MEMORY, [String(requests)], ['--expose-gc'], {})
  const report = await new Promise<MemoryReport>((resolve, reject) => {
    child.once('message', (message) => resolve(message as MemoryReport))
    child.once('exit', (code, signal) => reject(new Error(`memory check exited without a report (${signal ?? code})`)))
  })
  await exited(child)
  return report
}

/** Delete every Redis key whose name starts with `prefix` (what a run's servers wrote); how many there were. */
export async function removeRedisKeys (prefix: string): Promise<number> {
  const env = benchEnv()
  const client = new Redis({ host: env.redisHost, port: env.redisPort })
  let removed = 0
  try {
    let cursor = '0'
    do {
      const [next, keys] = await client.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 1000)
      cursor = next
      if (keys.length > 0) removed += await client.unlink(...keys)
    } while (cursor !== '0')
  } finally {
    await client.quit()
  }
  return removed
}
