/**
 * RedisStorage proves at start what requests will ask of Redis, on a redis-server of the test's own
 * (ACL users written command by command, maxmemory and eviction policies, a replica): a user that
 * may EVAL but not EVALSHA fails the start naming EVALSHA; a user without PUBLISH in wait mode
 * starts with waits that poll (said once) and a waiting duplicate is answered at once; PUBLISH
 * revoked while the app runs is never logged as a loss; an evicting Redis fails the start unless
 * `allowEviction` (then a warning and a diagnostics event); a replica fails it; a client still
 * connecting (ioredis without an offline queue, node-redis before `connect()` resolves) is waited for.
 */
import diagnostics from 'node:diagnostics_channel'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import { Redis } from 'ioredis'
import { createClient } from 'redis'
import { GlideClient } from '@valkey/valkey-glide'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions, type IdempotencyStoreCheckEvent } from '../lib/index.js'
import { RedisStorage, type RedisStorageOptions } from '../lib/redis.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'
import { Gate } from './helpers/gate.js'
import { newKey, withMethods } from './helpers/app.js'
import { scaled } from './helpers/pace.js'

const own = redisClusterAvailability()
const PREFIX = `test:proof:${process.pid}:`

interface Started {
  /** `null` when the app started, else why not. */
  error: string | null
  /** The log lines at warn and above, as JSON. */
  logs: Array<{ level: number, msg: string }>
  post: (key: string) => Promise<{ status: number, ms: number, replayed: boolean }>
  close: () => Promise<void>
}

/** An app on `storage` with `/orders` (held by `gate` when given), started. */
async function start (storage: RedisStorage, options: IdempotencyOptions = {}, gate?: Gate): Promise<Started> {
  const logs: Started['logs'] = []
  const app = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { logs.push(JSON.parse(line)) } } } })
  await app.register(idempotency, { storage, storeTimeout: '20s', ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => {
    await gate?.hold()
    reply.code(201)
    return { ok: true }
  })
  let error: string | null = null
  try {
    await app.ready()
  } catch (failure) {
    error = (failure as Error).message
  }
  return {
    error,
    logs,
    post: async (key) => {
      const started = Date.now()
      const res = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: {} })
      return { status: res.statusCode, ms: Date.now() - started, replayed: res.headers['idempotent-replayed'] === 'true' }
    },
    close: async () => { await app.close() }
  }
}

describe.skipIf(!own.available)('RedisStorage proves at start what requests will ask' + own.reason, () => {
  let server: Awaited<ReturnType<typeof startRedisServer>>
  let admin: Redis
  const clients: Array<{ quit: () => Promise<unknown> }> = []
  const apps: Started[] = []
  let users = 0

  beforeAll(async () => {
    server = await startRedisServer(['--save', '', '--appendonly', 'no'])
    admin = new Redis({ port: server.port })
  }, scaled(60_000))
  afterEach(async () => {
    await Promise.all(apps.splice(0).map((app) => app.close()))
    await admin.call('CONFIG', 'SET', 'maxmemory', '0', 'maxmemory-policy', 'noeviction')
  })
  afterAll(async () => {
    await Promise.all(clients.map((client) => client.quit().catch(() => {})))
    await admin?.quit()
    await server?.stop()
  })

  /** A client of a new ACL user of the server: every command on every key and channel, then `rules`. */
  async function userClient (...rules: string[]): Promise<Redis> {
    const name = `user${++users}`
    await admin.call('ACL', 'SETUSER', name, 'on', '>secret', '~*', '&*', '+@all', ...rules)
    const client = new Redis({ port: server.port, username: name, password: 'secret', maxRetriesPerRequest: 1 })
    clients.push(client)
    return client
  }

  async function started (storage: RedisStorage, options: IdempotencyOptions = {}, gate?: Gate): Promise<Started> {
    const app = await start(storage, options, gate)
    apps.push(app)
    return app
  }

  const storage = (client: RedisStorageOptions['client'], options: Partial<RedisStorageOptions> = {}): RedisStorage => new RedisStorage({ client, prefix: PREFIX, ...options })

  /** A first request held by `gate`, and its duplicate, once it waits: it has marked the lease (its waiters byte is W). */
  async function waitingDuplicate (app: Started, store: RedisStorage, gate: Gate): Promise<{ first: ReturnType<Started['post']>, duplicate: ReturnType<Started['post']> }> {
    const key = newKey()
    const first = app.post(key)
    await gate.entered
    const duplicate = app.post(key)
    while (await admin.getrange(store.redisKey(key), 37, 37) !== 'W') await new Promise((resolve) => setImmediate(resolve))
    return { first, duplicate }
  }

  it('a user that may EVAL but not EVALSHA fails the start, naming EVALSHA, the server\'s words and the cure', async () => {
    const app = await started(storage(await userClient('-evalsha')))
    expect(app.error).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: EVALSHA of the renew script was refused: NOPERM .*evalsha.*: allow EVAL and EVALSHA in the ACL of the client's Redis user \(\+eval \+evalsha\)/)
    expect(app.error).not.toContain('\n')
  })

  it('through Valkey GLIDE (which names NOPERM "PermissionDenied"), a user without EVALSHA fails the start naming EVALSHA, not an unreachable Redis', async () => {
    const name = `user${++users}`
    await admin.call('ACL', 'SETUSER', name, 'on', '>secret', '~*', '&*', '+@all', '-evalsha')
    const client = await GlideClient.createClient({ addresses: [{ host: '127.0.0.1', port: server.port }], credentials: { username: name, password: 'secret' } })
    clients.push({ quit: async () => { client.close() } })
    const app = await started(storage(client as unknown as RedisStorageOptions['client']), { wait: true })
    expect(app.error).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: EVALSHA of the renew script was refused: .*PermissionDenied: this user has no permissions to run the 'evalsha' command: allow EVAL and EVALSHA in the ACL of the client's Redis user \(\+eval \+evalsha\)/)
    expect(app.error).toMatch(/\(and 2 more checks failed: wait-mark script, complete and release script\)/)
  })

  it('through Valkey GLIDE, a user that may not SUBSCRIBE (GLIDE retries it for ever, saying nothing): the app starts, says that waits poll, and a duplicate polls', async () => {
    const name = `user${++users}`
    await admin.call('ACL', 'SETUSER', name, 'on', '>secret', '~*', '&*', '+@all', '-subscribe')
    const client = await GlideClient.createClient({ addresses: [{ host: '127.0.0.1', port: server.port }], credentials: { username: name, password: 'secret' } })
    clients.push({ quit: async () => { client.close() } })
    const gate = new Gate()
    const app = await started(storage(client as unknown as RedisStorageOptions['client']), { wait: true, storeTimeout: '5s' }, gate)
    expect(app.error).toBeNull()
    expect(app.logs.filter((line) => line.msg.includes('SUBSCRIBE to'))).toEqual([
      expect.objectContaining({ level: 40, msg: expect.stringMatching(/RedisStorage: SUBSCRIBE to test:proof:.* failed: the server did not confirm SUBSCRIBE to .* within 2000 ms: the client's Redis user may not SUBSCRIBE to it\? .*: waiting duplicates poll the store instead/) })
    ])
    const key = newKey()
    const first = app.post(key)
    await gate.entered
    const duplicate = app.post(key)
    await new Promise((resolve) => setTimeout(resolve, 100))
    gate.open()
    expect((await first).status).toBe(201)
    expect(await duplicate).toMatchObject({ status: 201, replayed: true })
  })

  it('a user with the ACL docs/stores/redis.md gives passes every check, and serves', async () => {
    const name = `user${++users}`
    // As the page writes it (the rules after the password).
    await admin.call('ACL', 'SETUSER', name, 'on', '>secret', 'resetkeys', '~idempotency:*', 'resetchannels', '&idempotency:*', '-@all', '+@connection', '+set', '+get', '+getrange', '+setrange', '+del', '+pexpire', '+pttl', '+scan', '+eval', '+evalsha', '+publish', '+subscribe', '+unsubscribe', '+info')
    const client = new Redis({ port: server.port, username: name, password: 'secret', maxRetriesPerRequest: 1 })
    clients.push(client)
    const store = new RedisStorage({ client })
    const checks = await store.prove({ wait: true })
    expect(checks.filter((check) => check.outcome !== 'passed')).toEqual([])
    const app = await started(store, { wait: true })
    expect(app.error).toBeNull()
    expect((await app.post(newKey())).status).toBe(201)
  })

  it('a user that may not PEXPIRE (a renewal on a full Redis) fails the start, naming it', async () => {
    const app = await started(storage(await userClient('-pexpire')))
    expect(app.error).toMatch(/RedisStorage: PEXPIRE was refused: NOPERM .*: allow PEXPIRE in the ACL of the client's Redis user \(\+pexpire\): a lease is renewed this way when Redis is full/)
  })

  it('a user that may not run a command a script runs fails the start, naming the script', async () => {
    const app = await started(storage(await userClient('-setrange')), { wait: true })
    expect(app.error).toMatch(/RedisStorage: EVAL of the wait-mark script failed: .*can't run this command.*: the script runs GETRANGE and SETRANGE/)
  })

  it('a user that may not PUBLISH, in wait mode: the app starts, says once that waits poll, and a waiting duplicate gets the response at once', async () => {
    const client = await userClient('-publish')
    let begins = 0
    let duplicateAsked!: () => void
    const asked = new Promise<void>((resolve) => { duplicateAsked = resolve })
    const counted = withMethods(storage(client), {
      begin: async (...args: Parameters<RedisStorage['begin']>) => {
        const result = await storage(client).begin(...args)
        if (++begins === 2) duplicateAsked()
        return result
      }
    })
    const gate = new Gate()
    const app = await started(counted, { wait: true, waitTimeout: '60s' }, gate)
    expect(app.error).toBeNull()
    const said = app.logs.filter((line) => line.msg.includes('PUBLISH'))
    expect(said).toHaveLength(1)
    expect(said[0]!.level).toBe(40)
    expect(said[0]!.msg).toMatch(/RedisStorage: PUBLISH was refused to the scripts .*: waiting duplicates poll the store instead .*: to have them woken at once, allow PUBLISH and SUBSCRIBE/)
    const key = newKey()
    const first = app.post(key)
    await gate.entered
    const duplicate = app.post(key)
    await asked
    const opened = Date.now()
    gate.open()
    expect((await first).status).toBe(201)
    const answer = await duplicate
    expect(answer).toMatchObject({ status: 201, replayed: true })
    // Polling: well within one storeTimeout (20 s), which is what a duplicate waiting to be woken took.
    expect(Date.now() - opened).toBeLessThan(scaled(3000))
    expect(app.logs.filter((line) => line.level >= 50)).toEqual([])
  })

  it('PUBLISH refused once the app runs: the response is kept without a word of loss, and the waiting duplicate gets it at once', async () => {
    const name = `user${++users}`
    await admin.call('ACL', 'SETUSER', name, 'on', '>secret', '~*', '&*', '+@all')
    const client = new Redis({ port: server.port, username: name, password: 'secret', maxRetriesPerRequest: 1 })
    clients.push(client)
    const store = storage(client)
    const gate = new Gate()
    const app = await started(store, { wait: true, waitTimeout: '60s' }, gate)
    expect(app.error).toBeNull()
    const warnings: string[] = []
    const onWarning = (warning: Error & { code?: string }): void => { warnings.push(`${warning.code}: ${warning.message}`) }
    process.on('warning', onWarning)
    try {
      await admin.call('ACL', 'SETUSER', name, '-publish')
      const { first, duplicate } = await waitingDuplicate(app, store, gate)
      const opened = Date.now()
      gate.open()
      expect((await first).status).toBe(201)
      expect(await duplicate).toMatchObject({ status: 201, replayed: true })
      expect(Date.now() - opened).toBeLessThan(scaled(3000))
      // Nothing but the start's word on this server's persistence: no failure, no loss.
      expect(app.logs.map((line) => line.msg).filter((msg) => !msg.includes('persistence is off'))).toEqual([])
      expect(warnings).toEqual([expect.stringMatching(/^FASTIFY_IDEMPOTENCY_NO_PUBLISH: The client's Redis user may not PUBLISH/)])
    } finally {
      process.off('warning', onWarning)
    }
  })

  it('a user that may not SUBSCRIBE, in wait mode: the app starts and says that waits poll', async () => {
    const app = await started(storage(await userClient('-subscribe')), { wait: true })
    expect(app.error).toBeNull()
    expect(app.logs.filter((line) => line.msg.includes('SUBSCRIBE to'))).toEqual([
      expect.objectContaining({ level: 40, msg: expect.stringMatching(/RedisStorage: SUBSCRIBE to test:proof:.* failed: NOPERM .*: waiting duplicates poll the store instead/) })
    ])
  })

  for (const policy of ['volatile-ttl', 'allkeys-lru', 'volatile-lru']) {
    it(`an evicting Redis (maxmemory with ${policy}) fails the start, naming the policy and the cure`, async () => {
      await admin.call('CONFIG', 'SET', 'maxmemory', '100mb', 'maxmemory-policy', policy)
      const app = await started(storage(await userClient()))
      expect(app.error).toMatch(new RegExp(`RedisStorage: maxmemory-policy ${policy} with maxmemory 104857600 bytes: under memory pressure Redis evicts keys of the store .*: set maxmemory-policy noeviction .*; allowEviction: true starts anyway`))
    })
  }

  it('with allowEviction, an evicting Redis starts with a warning in the log and on the diagnostics channel', async () => {
    await admin.call('CONFIG', 'SET', 'maxmemory', '100mb', 'maxmemory-policy', 'volatile-ttl')
    const events: IdempotencyStoreCheckEvent[] = []
    const onEvent = (event: unknown): void => { events.push(event as IdempotencyStoreCheckEvent) }
    diagnostics.subscribe('fastify-idempotency:store-check', onEvent)
    try {
      const app = await started(storage(await userClient(), { allowEviction: true }))
      expect(app.error).toBeNull()
      expect(app.logs.filter((line) => line.msg.includes('maxmemory-policy'))).toEqual([
        expect.objectContaining({ level: 40, msg: expect.stringMatching(/^fastify-idempotency: RedisStorage: maxmemory-policy volatile-ttl .*leases first .*: allowEviction: true accepts this risk/) })
      ])
      expect(events.find((event) => event.check === 'eviction policy')).toMatchObject({ store: 'RedisStorage', outcome: 'warning', via: 'app' })
      expect(events.find((event) => event.check === 'SET … PX … NX GET')).toMatchObject({ outcome: 'passed' })
    } finally {
      diagnostics.unsubscribe('fastify-idempotency:store-check', onEvent)
    }
  })

  it('a user that may read neither INFO nor CONFIG: the eviction policy is said to be unproven', async () => {
    const app = await started(storage(await userClient('-info', '-config')))
    expect(app.error).toBeNull()
    expect(app.logs.filter((line) => line.msg.includes('eviction'))).toEqual([
      expect.objectContaining({ level: 40, msg: expect.stringMatching(/the eviction policy could not be read, so it is not proven that Redis never evicts a lease: INFO was refused \(NOPERM .*\), and CONFIG GET too \(NOPERM .*\): allow INFO/) })
    ])
  })

  it('a Redis without persistence is named at start', async () => {
    const app = await started(storage(await userClient()))
    expect(app.error).toBeNull()
    expect(app.logs.map((line) => line.msg)).toContainEqual(expect.stringMatching(/RedisStorage: persistence is off .*: appendonly yes/))
  })

  it('a replica fails the start: it refuses writes', async () => {
    const replica = await startRedisServer(['--save', '', '--appendonly', 'no', '--replicaof', '127.0.0.1', String(server.port)])
    try {
      const client = new Redis({ port: replica.port, maxRetriesPerRequest: 1 })
      const app = await started(storage(client))
      expect(app.error).toMatch(/RedisStorage: the server is a read-only replica: READONLY .*: point the client at the primary/)
      await client.quit()
    } finally {
      await replica.stop()
    }
  })

  it('a Redis that stops answering (paused: a hung host, a long script) fails the start with one line saying it did not answer, once connected or not', async () => {
    const paused = await startRedisServer(['--save', '', '--appendonly', 'no'])
    const probe = new Redis({ port: paused.port })
    const pid = Number(/process_id:(\d+)/.exec(await probe.info('server'))![1])
    await probe.quit()
    const connectedFirst = new Redis({ port: paused.port, maxRetriesPerRequest: 1 })
    await connectedFirst.ping()
    process.kill(pid, 'SIGSTOP')
    try {
      const app = await started(storage(connectedFirst), { storeTimeout: 500 })
      expect(app.error).toBe('fastify-idempotency: the store cannot work: RedisStorage: Redis did not answer through the ioredis client: SET … PX … NX GET: no answer before the proof\'s time was up: ' +
        'check that Redis answers (a server paused or overloaded, a long script or command that blocks it, a network that drops packets), and the client\'s host, port, TLS and credentials (checkStore: false starts the app anyway)')
      // Connected by the kernel's backlog, never answered: not the same as a refused connection.
      const neverAnswered = new Redis({ port: paused.port })
      neverAnswered.on('error', () => {})
      const later = await started(storage(neverAnswered), { storeTimeout: 500 })
      expect(later.error).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: Redis did not answer through the ioredis client: the ioredis client connected, but Redis did not answer before the time was up: check that Redis answers/)
      neverAnswered.disconnect()
    } finally {
      process.kill(pid, 'SIGCONT')
      connectedFirst.disconnect()
      await paused.stop()
    }
  })

  it('a Redis that refuses writes for a reason of its own (NOREPLICAS, MISCONF) fails the start with the cure for that reason, not an upgrade', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'idem-misconf-'))
    const refusing = await startRedisServer(['--min-replicas-to-write', '1', '--enable-protected-configs', 'yes'])
    const client = new Redis({ port: refusing.port, maxRetriesPerRequest: 1 })
    try {
      const noReplicas = await started(storage(client))
      expect(noReplicas.error).toBe('fastify-idempotency: the store cannot work: RedisStorage: Redis refuses writes while it has fewer replicas than min-replicas-to-write: NOREPLICAS Not enough good replicas to write.: ' +
        'bring its replicas back, or lower min-replicas-to-write: every request writes its key (checkStore: false starts the app anyway)')
      // A snapshot that cannot be written (its directory gone): Redis stops taking writes.
      await client.call('CONFIG', 'SET', 'min-replicas-to-write', '0', 'dir', dir, 'save', '3600 1')
      await rm(dir, { recursive: true })
      await client.call('BGSAVE')
      while (!/rdb_last_bgsave_status:err/.test(await client.info('persistence'))) await new Promise((resolve) => setTimeout(resolve, 20))
      const misconf = await started(storage(client))
      expect(misconf.error).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: Redis refuses writes since it failed to save a snapshot: MISCONF .*: fix what keeps it from saving \(its log says\), or set stop-writes-on-bgsave-error no: every request writes its key/)
      // A script that runs on: past busy-reply-threshold, Redis answers BUSY to everything else.
      await client.call('CONFIG', 'SET', 'save', '', 'busy-reply-threshold', '50')
      const blocker = new Redis({ port: refusing.port })
      blocker.eval('while true do end', 0).catch(() => {})
      await new Promise((resolve) => setTimeout(resolve, 200))
      const busy = await started(storage(client))
      expect(busy.error).toMatch(/^fastify-idempotency: the store cannot work: RedisStorage: Redis is busy running a script: BUSY .*: end the script \(SCRIPT KILL, or FUNCTION KILL\) or wait for it/)
      await client.call('SCRIPT', 'KILL')
      blocker.disconnect()
    } finally {
      client.disconnect()
      await refusing.stop()
      await rm(dir, { recursive: true, force: true })
    }
  })

  it('a writable replica (replica-read-only no) fails the start: its writes reach neither the primary nor the other instances', async () => {
    const replica = await startRedisServer(['--replicaof', '127.0.0.1', String(server.port), '--replica-read-only', 'no'])
    const client = new Redis({ port: replica.port, maxRetriesPerRequest: 1 })
    try {
      const app = await started(storage(client))
      expect(app.error).toBe('fastify-idempotency: the store cannot work: RedisStorage: the server is a replica (role:slave) that takes writes (replica-read-only no): what the store writes there never reaches the primary nor the app\'s other instances, and the next resync drops it: ' +
        'point the client at the primary (checkStore: false starts the app anyway)')
    } finally {
      client.disconnect()
      await replica.stop()
    }
  })

  it('ioredis without an offline queue, still connecting when the app starts, is waited for', async () => {
    const client = new Redis({ port: server.port, enableOfflineQueue: false })
    clients.push(client)
    expect(client.status).toBe('connecting')
    const app = await started(storage(client))
    expect(app.error).toBeNull()
    expect((await app.post(newKey())).status).toBe(201)
  })

  it('ioredis with lazyConnect and no offline queue, in wait mode: the app starts, and a waiting duplicate is woken', async () => {
    const client = new Redis({ port: server.port, lazyConnect: true, enableOfflineQueue: false })
    clients.push(client)
    const store = storage(client)
    const gate = new Gate()
    const app = await started(store, { wait: true, waitTimeout: '60s', storeTimeout: '5s' }, gate)
    expect(app.error).toBeNull()
    expect(app.logs.filter((line) => line.msg.includes('PUBLISH'))).toEqual([])
    const { first, duplicate } = await waitingDuplicate(app, store, gate)
    gate.open()
    expect((await first).status).toBe(201)
    expect(await duplicate).toMatchObject({ status: 201, replayed: true })
  })

  it('node-redis whose connect() has not resolved when the app starts is waited for; one never connected is said to be', async () => {
    const client = createClient({ socket: { port: server.port } })
    const connecting = client.connect()
    clients.push({ quit: async () => { await connecting; client.destroy() } })
    const app = await started(storage(client))
    expect(app.error).toBeNull()
    const idle = createClient({ socket: { port: server.port } })
    const never = await started(storage(idle), { storeTimeout: 300 })
    expect(never.error).toMatch(/RedisStorage: Redis cannot be reached through the node-redis client: the node-redis client was never connected: call its connect\(\) before the app starts/)
  })
})
