/**
 * A throw-away Redis Cluster for tests: N masters, no replicas, on free loopback ports, with its
 * config files in a temporary directory. It never touches the shared Redis of the other tests.
 *
 *   const cluster = await startRedisCluster()
 *   const client = new Cluster(cluster.nodes)
 *   ...
 *   await cluster.stop()          // kills the nodes and removes the directory; safe to call twice
 *
 * `redisClusterAvailability()` says whether redis-server and redis-cli are installed, in the same
 * shape as `service()` in services.ts (and, like it, throws under CI=true instead of skipping).
 */
import { execFile, spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { promisify } from 'node:util'
import type { Availability } from './services.js'

const run = promisify(execFile)

export interface RedisClusterNode {
  host: string
  port: number
}

export interface RedisClusterHandle {
  /** The masters, ready to pass to `new Cluster(nodes)`. */
  nodes: RedisClusterNode[]
  /** Where the nodes keep their config files (removed by `stop`). */
  dir: string
  /** Stop every node and remove `dir`. Resolves once the processes have exited. Idempotent. */
  stop: () => Promise<void>
}

export interface StartRedisClusterOptions {
  /** Number of masters. Default 3 (the fewest `redis-cli --cluster create` accepts). */
  masters?: number
  /** Give up after this many milliseconds. Default 30 000. */
  timeout?: number
  /** More settings for every node's command line (`['--cluster-require-full-coverage', 'no']`). */
  settings?: string[]
}

const HOST = '127.0.0.1'
// The cluster bus listens on port + 10 000, so data ports stay low enough for both to be valid
// and clear of the usual ephemeral range.
const PORT_MIN = 10_000
const PORT_MAX = 22_000
const BUS_OFFSET = 10_000

let installed: string | null | undefined
function missingBinary (): string | null {
  if (installed !== undefined) return installed
  installed = null
  for (const binary of ['redis-server', 'redis-cli']) {
    const probe = spawnSync(binary, ['--version'], { stdio: 'ignore' })
    if (probe.error !== undefined || probe.status !== 0) {
      installed = `${binary} not found on the PATH (${(probe.error as NodeJS.ErrnoException | undefined)?.code ?? `exit ${probe.status}`})`
      break
    }
  }
  return installed
}

/** Whether a throw-away cluster can be started here; skip reason in `reason`, as `service()` does. */
export function redisClusterAvailability (): Availability {
  const problem = missingBinary()
  if (problem === null) return { available: true, reason: '' }
  if (process.env.CI === 'true') throw new Error(`${problem}: under CI=true a missing service is a failure, not a skip`)
  return { available: false, reason: ` [skipped: ${problem}]` }
}

function portIsFree (port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const server = createServer()
    server.once('error', () => resolve(false))
    server.listen({ port, host: HOST, exclusive: true }, () => server.close(() => resolve(true)))
  })
}

async function freePort (taken: Set<number>): Promise<number> {
  for (let attempt = 0; attempt < 200; attempt++) {
    const port = PORT_MIN + Math.floor(Math.random() * (PORT_MAX - PORT_MIN))
    if (taken.has(port)) continue
    if (await portIsFree(port) && await portIsFree(port + BUS_OFFSET)) return port
  }
  throw new Error('redis-cluster: found no free pair of loopback ports')
}

interface StartedNode {
  port: number
  process: ChildProcess
  exited: Promise<void>
}

/**
 * Start one node and wait for "Ready to accept connections". Resolves null when the port was lost
 * to someone else in the meantime (the caller picks another), rejects on any other failure.
 */
function startNode (port: number, dir: string, deadline: number, settings: string[] = clusterSettings(port, dir)): Promise<StartedNode | null> {
  const child = spawn('redis-server', [
    '--port', String(port),
    '--bind', HOST,
    ...settings,
    '--dir', dir,
    '--save', '',
    '--appendonly', 'no',
    '--daemonize', 'no',
    '--logfile', ''
  ], { stdio: ['ignore', 'pipe', 'pipe'] })
  const exited = new Promise<void>((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) resolve()
    else child.once('exit', () => resolve())
  })
  return new Promise((resolve, reject) => {
    let output = ''
    const timer = setTimeout(() => {
      child.kill('SIGKILL')
      reject(new Error(`redis-cluster: node on port ${port} not ready in time:\n${output}`))
    }, Math.max(deadline - Date.now(), 1))
    const onData = (chunk: Buffer) => {
      output += chunk.toString()
      if (output.includes('Ready to accept connections')) {
        clearTimeout(timer)
        // Keep draining the pipes, or a chatty node would block on a full pipe.
        child.stdout!.removeListener('data', onData)
        child.stdout!.resume()
        child.stderr!.resume()
        resolve({ port, process: child, exited })
      }
    }
    child.stdout!.on('data', onData)
    child.stderr!.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.once('error', (error) => {
      clearTimeout(timer)
      reject(error)
    })
    child.once('exit', (code, signal) => {
      clearTimeout(timer)
      if (/Address already in use/i.test(output)) resolve(null)
      else reject(new Error(`redis-cluster: node on port ${port} exited (${signal ?? code}):\n${output}`))
    })
  })
}

function clusterSettings (port: number, dir: string): string[] {
  return ['--cluster-enabled', 'yes', '--cluster-config-file', join(dir, `nodes-${port}.conf`), '--cluster-node-timeout', '5000']
}

/**
 * One throw-away Redis (not a cluster) on a free loopback port, with `settings` on its command
 * line (`['--maxmemory', '2mb']`, say), for a test that must push a server to its limits.
 */
export async function startRedisServer (settings: string[]): Promise<{ port: number, stop: () => Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), 'redis-server-'))
  const deadline = Date.now() + 30_000
  for (;;) {
    const node = await startNode(await freePort(new Set()), dir, deadline, settings)
    if (node === null) continue
    let stopped = false
    return {
      port: node.port,
      stop: async () => {
        if (stopped) return
        stopped = true
        await stopNodes([node])
        await rm(dir, { recursive: true, force: true })
      }
    }
  }
}

async function clusterInfo (port: number): Promise<string> {
  const { stdout } = await run('redis-cli', ['-h', HOST, '-p', String(port), 'cluster', 'info'], { timeout: 5000 })
  return stdout
}

async function waitUntilFormed (ports: number[], deadline: number): Promise<void> {
  let last = ''
  while (Date.now() < deadline) {
    const infos = await Promise.all(ports.map((port) => clusterInfo(port).catch((error: Error) => error.message)))
    const formed = infos.every((info) =>
      info.includes('cluster_state:ok') &&
      info.includes('cluster_slots_assigned:16384') &&
      info.includes(`cluster_known_nodes:${ports.length}`))
    if (formed) return
    last = infos.join('\n')
    await sleep(100)
  }
  throw new Error(`redis-cluster: the cluster did not reach cluster_state:ok in time; last cluster info:\n${last}`)
}

// Nodes still running when the test process exits are killed on the way out.
const live = new Set<ChildProcess>()
let exitHookInstalled = false
function killLeftovers (): void {
  for (const child of live) child.kill('SIGKILL')
}

async function stopNodes (nodes: StartedNode[]): Promise<void> {
  await Promise.all(nodes.map(async (node) => {
    if (node.process.exitCode === null && node.process.signalCode === null) {
      node.process.kill('SIGTERM')
      const killed = await Promise.race([node.exited.then(() => true), sleep(5000).then(() => false)])
      if (!killed) {
        node.process.kill('SIGKILL')
        await node.exited
      }
    }
    live.delete(node.process)
  }))
}

/** Start a cluster of `masters` nodes on free loopback ports and wait until it serves all slots. */
export async function startRedisCluster (options: StartRedisClusterOptions = {}): Promise<RedisClusterHandle> {
  const masters = options.masters ?? 3
  const deadline = Date.now() + (options.timeout ?? 30_000)
  const problem = missingBinary()
  if (problem !== null) throw new Error(`redis-cluster: ${problem}`)
  if (!exitHookInstalled) {
    exitHookInstalled = true
    process.once('exit', killLeftovers)
  }

  const dir = await mkdtemp(join(tmpdir(), 'fastify-idempotency-cluster-'))
  const nodes: StartedNode[] = []
  let stopped: Promise<void> | undefined
  const stop = (): Promise<void> => {
    stopped ??= stopNodes(nodes).finally(() => rm(dir, { recursive: true, force: true }))
    return stopped
  }

  try {
    const taken = new Set<number>()
    while (nodes.length < masters) {
      if (Date.now() > deadline) throw new Error('redis-cluster: could not start the nodes in time')
      const port = await freePort(taken)
      taken.add(port)
      const node = await startNode(port, dir, deadline, [...clusterSettings(port, dir), ...(options.settings ?? [])])
      if (node === null) continue
      live.add(node.process)
      nodes.push(node)
    }
    const ports = nodes.map((node) => node.port)
    await run('redis-cli', [
      '--cluster', 'create', ...ports.map((port) => `${HOST}:${port}`),
      '--cluster-replicas', '0', '--cluster-yes'
    ], { timeout: Math.max(deadline - Date.now(), 1) })
    await waitUntilFormed(ports, deadline)
    return { nodes: ports.map((port) => ({ host: HOST, port })), dir, stop }
  } catch (error) {
    await stop()
    throw error
  }
}
