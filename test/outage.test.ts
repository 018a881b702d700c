/**
 * Real outages of each real store, staged by cutting a proxy between the plugin and the shared
 * server: before a request (503, handler not run, or run with failOpen), while the handler runs
 * (the client still gets its response, nothing corrupted), and recovery without a restart.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Writable } from 'node:stream'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, type IdempotencyOptions, type IdempotencyStorage } from '../lib/index.js'
import { MARIADB, POSTGRES, REDIS, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { startProxy, type Proxy } from './helpers/proxy.js'
import { proxiedKnex, proxiedRedis } from './helpers/proxied-stores.js'
import { newKey } from './helpers/app.js'
import { resendWhile } from './helpers/resend.js'

interface Target {
  name: string
  availability: Availability
  server: { host: string, port: number }
  /** A storage whose connections go through the proxy on `port`, and how to dispose of it. */
  connect: (port: number) => Promise<{ storage: IdempotencyStorage, dispose: () => Promise<void> }>
}

const stamp = `${process.pid}_${Date.now()}`

function sql (name: string, client: 'pg' | 'mysql2', base: Record<string, unknown>): Target['connect'] {
  return async (port) => proxiedKnex(port, client, base, `outage_${name}_${stamp}`, { pool: { min: 0, max: 4 }, acquireConnectionTimeout: 2000 })
}

const targets: Target[] = [
  {
    name: 'redis',
    availability: await service(REDIS),
    server: REDIS,
    // The client options docs/stores/redis.md recommends to fail fast.
    connect: async (port) => proxiedRedis(port, `outage:${stamp}:`, { enableAutoPipelining: true, maxRetriesPerRequest: 1, commandTimeout: 2000 })
  },
  { name: 'postgres', availability: await service(POSTGRES), server: POSTGRES, connect: sql('postgres', 'pg', pgConnection) },
  { name: 'mariadb', availability: await service(MARIADB), server: MARIADB, connect: sql('mariadb', 'mysql2', mysqlConnection) }
]

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`outage of ${target.name}${target.availability.reason}`, () => {
    let proxy: Proxy
    let storage: IdempotencyStorage
    let dispose: () => Promise<void>
    const apps: FastifyInstance[] = []

    beforeAll(async () => {
      proxy = await startProxy(target.server.host, target.server.port)
      ;({ storage, dispose } = await target.connect(proxy.port))
    })
    afterAll(async () => {
      for (const app of apps) await app.close()
      proxy.restore()
      await dispose()
      await proxy.close()
    })

    async function build (options: IdempotencyOptions = {}) {
      const logs: Array<{ level: number, msg: string }> = []
      const stream = new Writable({ write (chunk, _enc, cb) { logs.push(JSON.parse(String(chunk))); cb() } })
      const app = Fastify({ logger: { level: 'warn', stream } })
      apps.push(app)
      await app.register(idempotency, { storage, lockTimeout: 1500, ...options })
      app.setErrorHandler(idempotencyErrorHandler())
      let runs = 0
      let gate: Promise<void> | null = null
      let entered: (() => void) | null = null
      app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => {
        runs++
        entered?.()
        if (gate !== null) await gate
        reply.code(201)
        return { run: runs }
      })
      await app.ready()
      return {
        logs,
        runs: () => runs,
        post: (key: string) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } }),
        /** The next handler run waits at a gate; returns when it has entered, and the opener. */
        holdNext: () => {
          let open!: () => void
          gate = new Promise<void>((resolve) => { open = resolve })
          const inside = new Promise<void>((resolve) => { entered = resolve })
          return { inside, open: () => { gate = null; entered = null; open() } }
        }
      }
    }

    it('answers 503 problem+json while the store is cut, without running the handler, and recovers without a restart', async () => {
      const t = await build()
      const key = newKey('outage')
      expect((await t.post(newKey('warm'))).statusCode).toBe(201)
      proxy.cut()
      const started = Date.now()
      const res = await t.post(key)
      expect(res.statusCode).toBe(503)
      expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
      expect(res.json().type).toMatch(/#store-unavailable$/)
      expect(Date.now() - started).toBeLessThan(10_000)
      expect(t.runs()).toBe(1)
      proxy.restore()
      // A pool may hand out one connection that died with the cut before it notices.
      const recovered = await resendWhile([503], () => t.post(key), { attempts: 5, pause: 0 })
      expect(recovered.statusCode).toBe(201)
      expect((await t.post(key)).headers['idempotent-replayed']).toBe('true')
      expect(t.runs()).toBe(2)
    })

    it('runs the handler unprotected with failOpen while the store is cut', async () => {
      const t = await build({ failOpen: true })
      proxy.cut()
      try {
        expect((await t.post(newKey('open'))).statusCode).toBe(201)
        expect(t.runs()).toBe(1)
      } finally {
        proxy.restore()
      }
    })

    it('still answers the client when the store goes away while the handler runs, then stores the response once the store is back: the retry replays it', async () => {
      const t = await build()
      const key = newKey('during')
      const hold = t.holdNext()
      const pending = t.post(key)
      await hold.inside
      proxy.cut()
      hold.open()
      const res = await pending
      expect(res.statusCode).toBe(201)
      expect(res.json()).toEqual({ run: 1 })
      expect(t.logs.some((line) => line.level === 50 && /after the handler ran/.test(line.msg))).toBe(true)
      // While the store is away the lease is held (renewal and storing are retried): a retry now
      // must never run the handler a second time.
      proxy.restore()
      const retry = await resendWhile([503, 409], () => t.post(key))
      expect(retry.statusCode).toBe(201)
      expect(retry.headers['idempotent-replayed']).toBe('true')
      expect(retry.json()).toEqual({ run: 1 })
      expect(t.runs()).toBe(1)
    })
  })
}
