import { once } from 'node:events'
import { createRequire } from 'node:module'
import { connect } from 'node:net'
import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest'
import Fastify from 'fastify'
import fastifyRedis from '@fastify/redis'
import { Redis, ReplyError } from 'ioredis'
import type { RedisOptions } from 'ioredis'
import { storageConformance, HOSTILE_KEYS } from '../lib/storage/conformance.js'
import { RedisStorage } from '../lib/redis.js'
import type { BeginResult, StoredResponse } from '../lib/storage/types.js'
import { REDIS, service } from './helpers/services.js'
import { WAITERS_OFFSET, WAITING } from '../lib/storage/redis/codec.js'

const redis = await service(REDIS)
// The server is shared with other test files running at the same time: everything this file
// writes lives under its own prefix, and only that prefix is cleaned up.
const PREFIX = `test:redis-storage:${process.pid}:${Date.now()}:`
const LEASE = 30_000
const EXPIRY = 60_000

const response: StoredResponse = {
  statusCode: 201,
  contentType: 'application/json; charset=utf-8',
  headers: { location: '/orders/1' },
  body: Buffer.from('{"id":1}')
}

let unique = 0
/** Expects `result` to be the lease, and gives its token. */
function tokenOf (result: BeginResult): string {
  expect(result.state).toBe('acquired')
  return result.state === 'acquired' ? result.token : ''
}

function freshKey (label: string): string {
  return `${label}:${++unique}`
}

/** The hash tag Redis Cluster hashes for `key`, by the rule in the cluster specification. */
function hashTag (key: string): string {
  const open = key.indexOf('{')
  if (open === -1) return key
  const close = key.indexOf('}', open + 1)
  if (close === -1 || close === open + 1) return key
  return key.slice(open + 1, close)
}

function unescapeTag (tag: string): string {
  return tag.replace(/%(25|7B|7D|u[0-9A-F]{4})/g, (_, code: string) =>
    code[0] === 'u' ? String.fromCharCode(parseInt(code.slice(1), 16)) : String.fromCharCode(parseInt(code, 16)))
}

/** ioredis loaded a second time, as an application with two copies of it has. */
function secondIoredis (): { Redis: typeof Redis } {
  const require = createRequire(import.meta.url)
  const own = (name: string): boolean => name.includes('/node_modules/ioredis/')
  const saved = Object.entries(require.cache).filter(([name]) => own(name))
  for (const [name] of saved) Reflect.deleteProperty(require.cache, name)
  try {
    return require('ioredis') as { Redis: typeof Redis }
  } finally {
    for (const name of Object.keys(require.cache).filter(own)) Reflect.deleteProperty(require.cache, name)
    for (const [name, module] of saved) require.cache[name] = module
  }
}

interface MonitorLine {
  command: string
  first: string | undefined
}

/**
 * The commands the server receives from the connection at `source` (`ip:port`), through MONITOR
 * on a raw socket: ioredis's own `monitor()` can fail with "Command queue state error" when a busy
 * server (this one is shared) sends monitor lines right behind the MONITOR reply. Commands run
 * inside scripts have the source `lua`, so they are left out.
 */
async function openMonitor (source: string): Promise<{ seen: MonitorLine[], close: () => void }> {
  const socket = connect({ host: REDIS.host, port: REDIS.port })
  socket.setEncoding('latin1')
  const seen: MonitorLine[] = []
  let pending = ''
  let started: () => void
  const ready = new Promise<void>((resolve) => { started = resolve })
  socket.on('data', (chunk: string) => {
    pending += chunk
    let end: number
    while ((end = pending.indexOf('\r\n')) !== -1) {
      const line = pending.slice(0, end)
      pending = pending.slice(end + 2)
      if (line === '+OK') {
        started()
        continue
      }
      const match = /^\+[\d.]+ \[\d+ ([^\]]+)\] "((?:[^"\\]|\\.)*)"(?: "((?:[^"\\]|\\.)*)")?/.exec(line)
      if (match !== null && match[1] === source) seen.push({ command: match[2]!, first: match[3] })
    }
  })
  await once(socket, 'connect')
  socket.write('MONITOR\r\n')
  await ready
  return { seen, close: () => socket.destroy() }
}

describe.skipIf(!redis.available)('RedisStorage on a real Redis' + redis.reason, () => {
  const options: RedisOptions = { host: REDIS.host, port: REDIS.port, maxRetriesPerRequest: 1 }
  const clients: Redis[] = []
  function newClient (extra: RedisOptions = {}): Redis {
    const client = new Redis({ ...options, ...extra })
    clients.push(client)
    return client
  }

  let client: Redis
  let pipelined: Redis
  beforeAll(() => {
    client = newClient()
    pipelined = newClient({ enableAutoPipelining: true })
  })

  afterAll(async () => {
    if (client !== undefined) {
      let cursor = '0'
      do {
        const [next, keys] = await client.scan(cursor, 'MATCH', PREFIX + '*', 'COUNT', 1000)
        if (keys.length > 0) await client.unlink(...keys)
        cursor = next
      } while (cursor !== '0')
    }
    await Promise.all(clients.map((c) => c.quit()))
  })

  const harness = { describe, it, beforeEach, afterAll }
  storageConformance('redis', () => new RedisStorage({ client, prefix: PREFIX + 'conformance:' }), harness, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })
  storageConformance('redis with enableAutoPipelining', () => new RedisStorage({ client: pipelined, prefix: PREFIX + 'pipelined:' }), harness, { operations: ['inspect', 'forget', 'listInFlight'], waitFor: true })

  describe('round trips', () => {
    /** Names of the commands ioredis hands to the connection while `fn` runs. */
    async function commandsSent (target: Redis, fn: () => Promise<unknown>): Promise<string[]> {
      const names: string[] = []
      const original = target.sendCommand
      const spy = vi.spyOn(target, 'sendCommand').mockImplementation(function (this: Redis, command, ...rest) {
        names.push(command.name)
        return original.call(this, command, ...rest)
      })
      try {
        await fn()
      } finally {
        spy.mockRestore()
      }
      return names
    }

    for (const autoPipelining of [false, true]) {
      it(`sends one command per begin, complete, release and renew${autoPipelining ? ' (auto-pipelining)' : ''}`, async () => {
        const target = newClient({ enableAutoPipelining: autoPipelining })
        const storage = new RedisStorage({ client: target, prefix: PREFIX + 'trips:' })
        // Let the connection handshake (HELLO, CLIENT SETINFO, ...) happen outside the count.
        await target.ping()
        const key = freshKey('trips')
        let token = ''
        const first = await commandsSent(target, async () => {
          const result = await storage.begin(key, 'fp', LEASE)
          if (result.state === 'acquired') token = result.token
        })
        expect(first).toHaveLength(1)
        expect(token).not.toBe('')
        expect(await commandsSent(target, () => storage.renew(key, token, LEASE))).toHaveLength(1)
        expect(await commandsSent(target, () => storage.complete(key, token, response, EXPIRY))).toHaveLength(1)
        const replay = await commandsSent(target, async () => {
          expect((await storage.begin(key, 'fp', LEASE)).state).toBe('completed')
        })
        expect(replay).toEqual(['set'])

        const other = freshKey('trips-release')
        const held = await storage.begin(other, 'fp', LEASE)
        expect(held.state).toBe('acquired')
        expect(await commandsSent(target, () => storage.release(other, held.state === 'acquired' ? held.token : ''))).toHaveLength(1)
      })
    }

    it('writes exactly one command to the server per call, as MONITOR sees it', async () => {
      const target = newClient()
      const storage = new RedisStorage({ client: target, prefix: PREFIX + 'monitor:' })
      const info = await target.client('INFO') as string
      const addr = /addr=(\S+)/.exec(info)?.[1]
      expect(addr).toBeDefined()

      const monitor = await openMonitor(addr!)
      try {
        let marker = 0
        /** Commands the server received from `target` while `fn` ran (scripts' inner calls excluded). */
        async function received (fn: () => Promise<unknown>): Promise<string[]> {
          const id = `${process.pid}-${++marker}`
          await target.echo(`start-${id}`)
          await fn()
          await target.echo(`end-${id}`)
          await vi.waitFor(() => {
            if (!monitor.seen.some((line) => line.first === `end-${id}`)) throw new Error('MONITOR has not caught up yet')
          }, { timeout: 10_000, interval: 10 })
          const lines = monitor.seen
          const start = lines.findIndex((line) => line.first === `start-${id}`)
          const end = lines.findIndex((line) => line.first === `end-${id}`)
          expect(start).toBeGreaterThanOrEqual(0)
          return lines.slice(start + 1, end).map((line) => line.command.toLowerCase())
        }

        /** Expects exactly the listed commands, showing everything MONITOR saw when it fails. */
        async function expectReceived (fn: () => Promise<unknown>, expected: string[] | number): Promise<void> {
          const commands = await received(fn)
          const message = `MONITOR saw ${JSON.stringify(commands)}`
          if (typeof expected === 'number') expect(commands, message).toHaveLength(expected)
          else expect(commands, message).toEqual(expected)
        }

        const key = freshKey('monitor')
        let token = ''
        await expectReceived(async () => {
          const result = await storage.begin(key, 'fp', LEASE)
          if (result.state === 'acquired') token = result.token
        }, 1)
        await expectReceived(() => storage.complete(key, token, response, EXPIRY), 1)
        await expectReceived(() => storage.begin(key, 'fp', LEASE), ['set'])
        const other = freshKey('monitor-release')
        const held = await storage.begin(other, 'fp', LEASE)
        const heldToken = held.state === 'acquired' ? held.token : ''
        await expectReceived(() => storage.renew(other, heldToken, LEASE), 1)
        await expectReceived(() => storage.release(other, heldToken), 1)
      } finally {
        monitor.close()
      }
    })
  })

  describe('client handling', () => {
    it('reloads a script the server has lost (NOSCRIPT) with EVAL, in the same call', async () => {
      const own = newClient()
      const storage = new RedisStorage({ client: own, prefix: PREFIX + 'noscript:' })
      const key = freshKey('noscript')
      const token = tokenOf(await storage.begin(key, 'fp', LEASE))
      // The first script call on a client is an EVAL; from then on EVALSHA.
      expect(await storage.renew(key, token, LEASE)).toBe(true)
      const sent: string[] = []
      let refuse: string | null = 'NOSCRIPT No matching script. Please use EVAL.'
      const original = own.sendCommand.bind(own)
      vi.spyOn(own, 'sendCommand').mockImplementation((command, ...rest) => {
        sent.push(command.name)
        if (command.name !== 'evalsha' || refuse === null) return original(command, ...rest)
        // The server's answer to an EVALSHA of a script it does not have.
        command.reject(new ReplyError(refuse))
        refuse = null
        return command.promise
      })
      expect(await storage.renew(key, token, LEASE)).toBe(true)
      expect(sent).toEqual(['evalsha', 'eval'])
      // Any other error is the caller's.
      refuse = 'ERR something else'
      await expect(storage.renew(key, token, LEASE)).rejects.toThrow('ERR something else')
      expect(sent).toEqual(['evalsha', 'eval', 'evalsha'])
    })

    it('writes the commands of one event-loop turn to the socket at once, with or without auto-pipelining', async () => {
      for (const enableAutoPipelining of [false, true]) {
        const own = newClient({ enableAutoPipelining })
        await own.ping()
        const storage = new RedisStorage({ client: own, prefix: PREFIX + 'batch:' })
        const socket = own.stream as unknown as { _write: unknown, _writev: unknown }
        const write = vi.spyOn(socket, '_write' as never)
        const writev = vi.spyOn(socket, '_writev' as never)
        const keys = Array.from({ length: 20 }, () => freshKey('batch'))
        const results = await Promise.all(keys.map((key) => storage.begin(key, 'fp', LEASE)))
        expect(results.every((result) => result.state === 'acquired')).toBe(true)
        expect(write).not.toHaveBeenCalled()
        expect(writev).toHaveBeenCalledTimes(1)
        expect((writev.mock.calls[0] as unknown as [unknown[]])[0]).toHaveLength(20)
        // Ending the twenty leases: one write again.
        const ended = await Promise.all(results.map((result, index) => storage.complete(keys[index]!, tokenOf(result), response, EXPIRY)))
        expect(ended.every((stored) => stored)).toBe(true)
        expect(writev).toHaveBeenCalledTimes(2)
        expect(write).not.toHaveBeenCalled()
      }
    })

    it('leaves the commands the application sends on the same client in the same turn in their order', async () => {
      const own = newClient()
      await own.ping()
      const storage = new RedisStorage({ client: own, prefix: PREFIX + 'shared-turn:' })
      const key = freshKey('shared-turn')
      const other = PREFIX + 'shared-turn-own-key'
      const [set, lease, read] = await Promise.all([
        own.set(other, 'mine'),
        storage.begin(key, 'fp', LEASE),
        own.get(other)
      ])
      expect(set).toBe('OK')
      expect(lease.state).toBe('acquired')
      expect(read).toBe('mine')
      // Nothing stays corked after the turn.
      await new Promise((resolve) => setImmediate(resolve))
      expect(own.stream.writableCorked).toBe(0)
    })

    it('works with a client of another copy of ioredis, through that copy\'s own Command objects, batched as well', async () => {
      const { Redis: OtherRedis } = secondIoredis()
      expect(OtherRedis).not.toBe(Redis)
      const other = new OtherRedis({ ...options, enableAutoPipelining: true }) as unknown as Redis
      try {
        await other.ping()
        const storage = new RedisStorage({ client: other, prefix: PREFIX + 'other-copy:' })
        const sent = vi.spyOn(other, 'sendCommand')
        const methods = vi.spyOn(other, 'setBuffer')
        const writev = vi.spyOn(other.stream as unknown as { _writev: unknown }, '_writev' as never)
        const keys = [freshKey('other-copy'), freshKey('other-copy')]
        const [first, second] = await Promise.all(keys.map((key) => storage.begin(key, 'fp', LEASE)))
        expect(sent).toHaveBeenCalledTimes(2)
        expect(methods).not.toHaveBeenCalled()
        expect(writev).toHaveBeenCalledTimes(1)
        expect(await storage.complete(keys[0]!, tokenOf(first!), response, EXPIRY)).toBe(true)
        expect(await storage.release(keys[1]!, tokenOf(second!))).toBe(true)
        const replay = await storage.begin(keys[0]!, 'fp', LEASE)
        expect(replay.state === 'completed' && replay.response.body.equals(response.body)).toBe(true)
      } finally {
        other.disconnect()
      }
    })

    it('gives a client with showFriendlyErrorStack its errors with the caller\'s stack', async () => {
      const friendly = newClient({ showFriendlyErrorStack: true })
      const storage = new RedisStorage({ client: friendly, prefix: PREFIX + 'friendly:' })
      const key = freshKey('friendly')
      // A list where the storage expects a string: Redis answers WRONGTYPE.
      await client.rpush(storage.redisKey(key), 'not an entry')
      const error = await storage.begin(key, 'fp', LEASE).catch((caught: unknown) => caught) as Error
      expect(error).toBeInstanceOf(ReplyError)
      expect(error.message).toMatch(/^WRONGTYPE/)
      expect(error.stack).toContain('storage-redis.test.ts')
    })

    it('sends what it is asked before the client has connected once it has', async () => {
      const lazy = newClient({ lazyConnect: true })
      const storage = new RedisStorage({ client: lazy, prefix: PREFIX + 'lazy:' })
      const key = freshKey('lazy')
      const token = tokenOf(await storage.begin(key, 'fp', LEASE))
      expect(await storage.complete(key, token, response, EXPIRY)).toBe(true)
      expect((await storage.begin(key, 'fp', LEASE)).state).toBe('completed')
    })

    it('defines nothing on the client, however many storages share it', async () => {
      const shared = newClient()
      const define = vi.spyOn(shared, 'defineCommand')
      const a = new RedisStorage({ client: shared, prefix: PREFIX + 'shared:' })
      const b = new RedisStorage({ client: shared, prefix: PREFIX + 'shared:' })
      expect(define).not.toHaveBeenCalled()
      const key = freshKey('shared')
      const lease = await a.begin(key, 'fp', LEASE)
      expect(lease.state).toBe('acquired')
      expect(await b.complete(key, lease.state === 'acquired' ? lease.token : '', response, EXPIRY)).toBe(true)
      expect((await a.begin(key, 'fp', LEASE)).state).toBe('completed')
    })

    it('leaves the client open on close()', async () => {
      const own = newClient()
      const storage = new RedisStorage({ client: own, prefix: PREFIX + 'close:' })
      expect((await storage.begin(freshKey('close'), 'fp', LEASE)).state).toBe('acquired')
      await storage.close()
      expect(own.status).toBe('ready')
      expect(await own.ping()).toBe('PONG')
      expect((await storage.begin(freshKey('close'), 'fp', LEASE)).state).toBe('acquired')
    })

    it('closes its subscriber with the client, refuses to wait on a closed client, and waits again once it reconnects', async () => {
      // The subscriber is a duplicate of the client: it carries the client's connection name.
      const name = `client-end-${process.pid}-${++unique}`
      const own = newClient({ connectionName: name })
      const storage = new RedisStorage({ client: own, prefix: PREFIX + 'client-end:' })
      const subscribed = async (): Promise<number> => (await client.client('LIST') as string).split('\n').filter((line) => line.includes(` name=${name} `) && line.includes(' sub=1 ')).length
      const marked = async (key: string): Promise<void> => {
        await vi.waitFor(async () => { expect((await client.get(storage.redisKey(key)))?.[WAITERS_OFFSET]).toBe(WAITING) })
      }
      const key = freshKey('client-end')
      const token = tokenOf(await storage.begin(key, 'fp', LEASE))
      const waiting = storage.waitFor(key, 60_000)
      await marked(key)
      expect(await subscribed()).toBe(1)
      await own.quit()
      // The client's end wakes the wait and closes the subscriber.
      await waiting
      await vi.waitFor(async () => { expect(await subscribed()).toBe(0) })
      await expect(storage.waitFor(key, 60_000)).rejects.toThrow(/client has been closed/)
      await own.connect()
      const again = storage.waitFor(key, 60_000)
      await marked(key)
      expect(await storage.release(key, token)).toBe(true)
      await again
      await storage.close()
      await vi.waitFor(async () => { expect(await subscribed()).toBe(0) })
    })

    it('lets no waiter mark a lease before the subscription to its channel is confirmed, so no end goes unheard', async () => {
      const own = newClient()
      const storage = new RedisStorage({ client: own, prefix: PREFIX + 'subscribe-order:' })
      // The subscriber's SUBSCRIBE is held back until the test lets it go.
      let confirm!: () => void
      const confirmed = new Promise<void>((resolve) => { confirm = resolve })
      const duplicate = own.duplicate.bind(own)
      vi.spyOn(own, 'duplicate').mockImplementation(((...args: Parameters<Redis['duplicate']>) => {
        const connection = duplicate(...args)
        const subscribe = connection.subscribe.bind(connection) as (...channels: string[]) => Promise<unknown>
        connection.subscribe = (async (...channels: string[]) => { await confirmed; return await subscribe(...channels) }) as typeof connection.subscribe
        return connection
      }) as Redis['duplicate'])
      const key = freshKey('subscribe-order')
      const token = tokenOf(await storage.begin(key, 'fp', LEASE))
      const first = storage.waitFor(key, 60_000)
      const second = storage.waitFor(key, 60_000)
      // Whatever either waiter sent on the client has been answered by now.
      await own.ping()
      // The lease ends while the subscription is still unconfirmed: nobody can hear its PUBLISH.
      expect(await storage.complete(key, token, response, EXPIRY)).toBe(true)
      confirm()
      const woken = Promise.all([first, second])
      let timer: NodeJS.Timeout | undefined
      await Promise.race([woken, new Promise((_resolve, reject) => { timer = setTimeout(() => reject(new Error('a waiter was not woken within 10 s')), 10_000) })])
      clearTimeout(timer)
      await storage.close()
    })

    it('works with the client @fastify/redis decorates as fastify.redis', async () => {
      const app = Fastify()
      await app.register(fastifyRedis, { host: REDIS.host, port: REDIS.port, enableAutoPipelining: true })
      await app.ready()
      try {
        const storage = new RedisStorage({ client: app.redis, prefix: PREFIX + 'fastify:' })
        const again = new RedisStorage({ client: app.redis, prefix: PREFIX + 'fastify:' })
        const key = freshKey('fastify')
        const lease = await storage.begin(key, 'fp', LEASE)
        expect(lease.state).toBe('acquired')
        expect(await storage.complete(key, lease.state === 'acquired' ? lease.token : '', response, EXPIRY)).toBe(true)
        const replay = await again.begin(key, 'fp', LEASE)
        expect(replay.state === 'completed' && replay.response.body.equals(response.body)).toBe(true)
        await storage.close()
        expect(app.redis.status).toBe('ready')
      } finally {
        await app.close()
      }
    })

    it('puts the client\'s own ioredis keyPrefix in front of its prefix', async () => {
      const prefixed = newClient({ keyPrefix: PREFIX + 'client-prefix:' })
      const storage = new RedisStorage({ client: prefixed, prefix: 'idem:' })
      const key = freshKey('key-prefix')
      const lease = await storage.begin(key, 'fp', LEASE)
      expect(lease.state).toBe('acquired')
      expect(await storage.complete(key, lease.state === 'acquired' ? lease.token : '', response, EXPIRY)).toBe(true)
      expect((await storage.begin(key, 'fp', LEASE)).state).toBe('completed')
      expect(await client.exists(PREFIX + 'client-prefix:' + storage.redisKey(key))).toBe(1)
    })

    it('refuses a missing client, a prefix with braces and bad durations', async () => {
      // @ts-expect-error: no client
      expect(() => new RedisStorage({})).toThrow(TypeError)
      expect(() => new RedisStorage({ client, prefix: 'app{1}:' })).toThrow(/prefix/)
      expect(() => new RedisStorage({ client, prefix: 'app}' })).toThrow(/prefix/)
      const storage = new RedisStorage({ client, prefix: PREFIX + 'durations:' })
      for (const bad of [0, -1, Number.NaN, Number.POSITIVE_INFINITY]) {
        await expect(storage.begin(freshKey('bad'), 'fp', bad)).rejects.toThrow(RangeError)
        await expect(storage.complete(freshKey('bad'), 'token', response, bad)).rejects.toThrow(RangeError)
      }
    })
  })

  describe('data layout', () => {
    it('keeps one string per key: the lease with its TTL while in flight, the entry with the expiration once completed', async () => {
      const storage = new RedisStorage({ client, prefix: PREFIX + 'layout:' })
      const key = freshKey('layout')
      const redisKey = storage.redisKey(key)
      const before = Date.now()
      const lease = await storage.begin(key, 'fp-layout', LEASE)
      expect(lease.state).toBe('acquired')
      const token = lease.state === 'acquired' ? lease.token : ''
      expect(await client.type(redisKey)).toBe('string')
      // The token is the lease's fence (36 characters) followed by the fingerprint.
      expect(token.slice(36)).toBe('fp-layout')
      const leaseValue = await client.get(redisKey)
      expect(leaseValue).toMatch(new RegExp(`^L${token.slice(0, 36)}-(\\d+)\\|fp-layout$`))
      const leaseEnd = Number(/^L.{36}-(\d+)\|/.exec(leaseValue!)![1])
      expect(leaseEnd).toBeGreaterThanOrEqual(before + LEASE)
      expect(leaseEnd).toBeLessThanOrEqual(Date.now() + LEASE)
      const leaseTtl = await client.pttl(redisKey)
      expect(leaseTtl).toBeGreaterThan(LEASE - 2000)
      expect(leaseTtl).toBeLessThanOrEqual(LEASE)

      const beforeComplete = Date.now()
      expect(await storage.complete(key, token, response, EXPIRY)).toBe(true)
      const stored = await client.getBuffer(redisKey)
      // The head ends with whether the body was omitted (0) and when the entry was stored.
      const storedAt = Number(/,0,(\d+)\]/.exec(stored!.toString())![1])
      expect(storedAt).toBeGreaterThanOrEqual(beforeComplete)
      expect(storedAt).toBeLessThanOrEqual(Date.now())
      const head = JSON.stringify([response.statusCode, response.contentType, response.headers, 0, storedAt])
      const expected = Buffer.concat([Buffer.from(`C9|fp-layout${Buffer.byteLength(head)}|${head}`), response.body])
      expect(stored!.equals(expected)).toBe(true)
      const entryTtl = await client.pttl(redisKey)
      expect(entryTtl).toBeGreaterThan(EXPIRY - 2000)
      expect(entryTtl).toBeLessThanOrEqual(EXPIRY)
      expect(await client.keys(PREFIX + 'layout:*')).toEqual([redisKey])
    })

    it('reports the lease end the holder wrote, and a renewal moves it', async () => {
      const storage = new RedisStorage({ client, prefix: PREFIX + 'lease-end:' })
      const key = freshKey('lease-end')
      const lease = await storage.begin(key, 'fp', 4000)
      expect(lease.state).toBe('acquired')
      const held = await storage.begin(key, 'fp', 10_000)
      expect(held.state).toBe('in-flight')
      const remaining = held.state === 'in-flight' ? held.lockExpiresAt - Date.now() : 0
      expect(remaining).toBeGreaterThan(3000)
      expect(remaining).toBeLessThanOrEqual(4000)
      expect(await storage.renew(key, lease.state === 'acquired' ? lease.token : '', 20_000)).toBe(true)
      const renewed = await storage.begin(key, 'other', 10_000)
      expect(renewed.state === 'in-flight' && renewed.fingerprint).toBe('fp')
      expect(renewed.state === 'in-flight' ? renewed.lockExpiresAt - Date.now() : 0).toBeGreaterThan(19_000)
      expect(await client.pttl(storage.redisKey(key))).toBeGreaterThan(19_000)
    })

    it('hands out fences no other storage instance uses, even on one client', async () => {
      const a = new RedisStorage({ client, prefix: PREFIX + 'fences:' })
      const b = new RedisStorage({ client, prefix: PREFIX + 'fences:' })
      const key = freshKey('fences')
      const token = tokenOf(await a.begin(key, 'fp', LEASE))
      expect(await a.release(key, token)).toBe(true)
      const second = await b.begin(key, 'fp', LEASE)
      const other = second.state === 'acquired' ? second.token : ''
      expect(other.slice(0, 36)).not.toBe(token.slice(0, 36))
      // The first holder's token no longer fences anything, whichever instance it came from.
      expect(await a.complete(key, token, response, EXPIRY)).toBe(false)
      expect(await b.complete(key, other, response, EXPIRY)).toBe(true)
    })

    it('publishes the end of a lease only when someone waits for it, and a waiter\'s mark survives renewal', async () => {
      const storage = new RedisStorage({ client, prefix: PREFIX + 'publish:' })
      const listener = client.duplicate()
      const heard: string[] = []
      listener.on('message', (channel: string) => { heard.push(channel) })
      try {
        // Nobody waits: complete and release publish nothing.
        const quiet = freshKey('publish')
        await listener.subscribe(`${storage.redisKey(quiet)}:ended`)
        let lease = await storage.begin(quiet, 'fp', LEASE)
        expect(await storage.release(quiet, lease.state === 'acquired' ? lease.token : '')).toBe(true)
        lease = await storage.begin(quiet, 'fp', LEASE)
        expect(await storage.complete(quiet, lease.state === 'acquired' ? lease.token : '', response, EXPIRY)).toBe(true)

        // A waiter marks the lease (keeping its expiry); renewal keeps the mark; complete publishes.
        const awaited = freshKey('publish')
        const channel = `${storage.redisKey(awaited)}:ended`
        await listener.subscribe(channel)
        const held = await storage.begin(awaited, 'fp', LEASE)
        const token = held.state === 'acquired' ? held.token : ''
        const waiting = storage.waitFor(awaited, 10_000)
        await vi.waitFor(async () => { expect((await client.get(storage.redisKey(awaited)))?.[37]).toBe('W') })
        expect(await client.pttl(storage.redisKey(awaited))).toBeGreaterThan(LEASE - 2000)
        expect(await storage.renew(awaited, token, LEASE)).toBe(true)
        expect((await client.get(storage.redisKey(awaited)))?.[37]).toBe('W')
        const inFlight = await storage.begin(awaited, 'other', LEASE)
        expect(inFlight.state === 'in-flight' && inFlight.fingerprint).toBe('fp')
        expect(await storage.complete(awaited, token, response, EXPIRY)).toBe(true)
        await waiting
        await vi.waitFor(() => { expect(heard).toEqual([channel]) })
      } finally {
        listener.disconnect()
        await storage.close()
      }
    })

    it('makes the whole key, escaped, the hash tag, so braces in a key cannot move it to another slot', async () => {
      const storage = new RedisStorage({ client, prefix: PREFIX + 'slots:' })
      const keys = [...HOSTILE_KEYS, '{x}a', '{x}b', 'a}b{c', '{}', '}', '%7D', '%257D', '%', '%u0041', 'A', '\uD800', '\uDC00', '\uFFFD', '\u{1F4B8}']
      const tags = new Set<string>()
      for (const key of keys) {
        const redisKey = storage.redisKey(key)
        expect(redisKey.startsWith(PREFIX + 'slots:{')).toBe(true)
        expect(redisKey.endsWith('}')).toBe(true)
        const tag = hashTag(redisKey)
        // The tag Redis hashes runs from our `{` to our closing `}`: all of the key, nothing else.
        expect(redisKey).toBe(PREFIX + 'slots:{' + tag + '}')
        expect(unescapeTag(tag)).toBe(key)
        tags.add(tag)
      }
      expect(tags.size).toBe(keys.length)
    })

    it('keeps look-alike keys apart: braces, escapes and lone surrogates', async () => {
      const storage = new RedisStorage({ client, prefix: PREFIX + 'lookalike:' })
      const base = freshKey('lookalike')
      const keys = ['}', '%7D', '%257D', '{', '%7B', '\uD800', '\uDC00', '\uFFFD'].map((k) => `${base}|${k}`)
      for (const [i, key] of keys.entries()) {
        const lease = await storage.begin(key, `fp-${i}`, LEASE)
        expect(lease.state, `key ${JSON.stringify(key)}`).toBe('acquired')
        expect(await storage.complete(key, lease.state === 'acquired' ? lease.token : '', { ...response, statusCode: 200 + i }, EXPIRY)).toBe(true)
      }
      for (const [i, key] of keys.entries()) {
        const replay = await storage.begin(key, 'fp', LEASE)
        expect(replay.state === 'completed' && replay.fingerprint).toBe(`fp-${i}`)
        expect(replay.state === 'completed' && replay.response.statusCode).toBe(200 + i)
      }
    })

    it('keeps the same key under two prefixes apart', async () => {
      const a = new RedisStorage({ client, prefix: PREFIX + 'tenant-a:' })
      const b = new RedisStorage({ client, prefix: PREFIX + 'tenant-b:' })
      const key = freshKey('same-text')
      const tokenA = tokenOf(await a.begin(key, 'fp-a', LEASE))
      tokenOf(await b.begin(key, 'fp-b', LEASE))
      expect(await a.complete(key, tokenA, response, EXPIRY)).toBe(true)
      const stillHeld = await b.begin(key, 'fp-x', LEASE)
      expect(stillHeld.state === 'in-flight' && stillHeld.fingerprint).toBe('fp-b')
      expect(await b.complete(key, tokenA, response, EXPIRY)).toBe(false)
      expect(a.redisKey(key)).not.toBe(b.redisKey(key))
    })

    it('serves many simultaneous begins on distinct keys through one auto-pipelined client', async () => {
      const storage = new RedisStorage({ client: pipelined, prefix: PREFIX + 'burst:' })
      const keys = Array.from({ length: 200 }, (_, i) => freshKey(`burst-${i}`))
      const leases = await Promise.all(keys.map((key) => storage.begin(key, 'fp', LEASE)))
      expect(leases.every((lease) => lease.state === 'acquired')).toBe(true)
      const done = await Promise.all(keys.map((key, i) => {
        const lease = leases[i]!
        return storage.complete(key, lease.state === 'acquired' ? lease.token : '', { ...response, body: Buffer.from(key) }, EXPIRY)
      }))
      expect(done.every(Boolean)).toBe(true)
      const replays = await Promise.all(keys.map((key) => storage.begin(key, 'fp', LEASE)))
      for (const [i, replay] of replays.entries()) {
        expect(replay.state === 'completed' && replay.response.body.toString()).toBe(keys[i])
      }
    })
  })
})
