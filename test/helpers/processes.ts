/**
 * Several server processes (test/fixtures/server.ts) sharing one store, for the tests that prove
 * exactly-once execution across processes and survive a SIGKILL.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { Redis } from 'ioredis'
import knexFactory from 'knex'
import { afterAll, beforeAll } from 'vitest'
import { bundle } from './bundle.js'
import { REDIS, deleteRedisPrefix, mysqlConnection, pgConnection } from './services.js'
import { postWithKey, type HttpAnswer } from './http-client.js'
import { scaled } from './pace.js'

const fixture = fileURLToPath(new URL('../fixtures/server.ts', import.meta.url))
/** The fixture as one module, bundled once per test process: the servers start as plain node. */
let program: Promise<string> | undefined
const bundled = (): Promise<string> => (program ??= bundle(fixture, fileURLToPath(new URL('../../.tmp/bundles', import.meta.url))))

export interface ServerProcess {
  port: number
  url: string
  child: ChildProcess
  /** Resolves with the key once a request with `x-hang: 1` has entered the handler. */
  hanging: (key: string) => Promise<void>
  kill: (signal?: NodeJS.Signals) => Promise<void>
}

export async function startServer (env: Record<string, string>): Promise<ServerProcess> {
  const child = spawn(process.execPath, [await bundled()], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe']
  })
  const hangingKeys = new Set<string>()
  const hangWaiters = new Map<string, () => void>()
  let stderr = ''
  child.stderr!.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
  const lines = createInterface({ input: child.stdout! })
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start within 30 s: ${stderr}`)), 30_000)
    child.once('exit', (code) => { clearTimeout(timer); reject(new Error(`server exited with ${code}: ${stderr}`)) })
    lines.on('line', (line) => {
      const [word, value] = line.split(' ')
      if (word === 'LISTENING') { clearTimeout(timer); resolve(Number(value)) }
      if (word === 'HANGING' && value !== undefined) {
        hangingKeys.add(value)
        hangWaiters.get(value)?.()
      }
    })
  })
  const exited = new Promise<void>((resolve) => { child.once('exit', () => resolve()) })
  return {
    port,
    url: `http://127.0.0.1:${port}`,
    child,
    hanging: (key) => hangingKeys.has(key) ? Promise.resolve() : new Promise<void>((resolve) => hangWaiters.set(key, resolve)),
    kill: async (signal = 'SIGTERM') => {
      if (child.exitCode === null && child.signalCode === null) child.kill(signal)
      await exited
    }
  }
}

export async function startServers (count: number, env: Record<string, string>): Promise<ServerProcess[]> {
  return Promise.all(Array.from({ length: count }, () => startServer(env)))
}

/**
 * The server processes a describe's tests share, on one store under `namespace`: three, and two in
 * wait mode, with `env()` (read when they start, before the first test). Killed after the last
 * test, and what they stored is dropped. The arrays are filled once they have started.
 */
export function sharedServers (store: string, namespace: string, env: () => Promise<Record<string, string>>): { servers: ServerProcess[], waiting: ServerProcess[] } {
  const servers: ServerProcess[] = []
  const waiting: ServerProcess[] = []
  beforeAll(async () => {
    const base = await env()
    servers.push(...await startServers(3, base))
    waiting.push(...await startServers(2, { ...base, WAIT: '1' }))
  }, scaled(120_000))
  afterAll(async () => {
    await Promise.all([...servers, ...waiting].map((server) => server.kill()))
    await dropNamespace(store, namespace)
  })
  return { servers, waiting }
}

export type Answer = HttpAnswer

export async function postOrder (server: ServerProcess, key: string, body: object, headers: Record<string, string> = {}): Promise<Answer> {
  return await postWithKey(`${server.url}/orders`, key, body, headers)
}

export async function effectCount (server: ServerProcess, key: string): Promise<number> {
  const res = await fetch(`${server.url}/effects?key=${encodeURIComponent(key)}`)
  return ((await res.json()) as { count: number }).count
}

/** Remove what a store's namespace (key prefix or table, and its effects table) left on the shared server. */
export async function dropNamespace (store: string, namespace: string): Promise<void> {
  if (store === 'redis') {
    const client = new Redis({ host: REDIS.host, port: REDIS.port })
    await deleteRedisPrefix(client, `${namespace}:`)
    await client.quit()
  } else if (store === 'postgres' || store === 'mysql') {
    const knex = knexFactory(store === 'postgres' ? { client: 'pg', connection: pgConnection } : { client: 'mysql2', connection: mysqlConnection })
    await knex.schema.dropTableIfExists(namespace)
    await knex.schema.dropTableIfExists(`${namespace}_effects`)
    await knex.destroy()
  }
}
