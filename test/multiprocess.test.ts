/**
 * Exactly once across processes: several server processes share one store, and simultaneous
 * requests with one key, spread over them, run the handler once. The handler's side effect is
 * counted in the store's own server. Also: a process killed mid-request (SIGKILL) does not leave
 * the key stuck, and wait mode works across processes.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { MARIADB, POSTGRES, REDIS, service, type Availability } from './helpers/services.js'
import { effectCount, postOrder, sharedServers, type Answer, type ServerProcess } from './helpers/processes.js'
import { newKey } from './helpers/app.js'
import { redisClusterAvailability, startRedisCluster, type RedisClusterHandle } from './helpers/redis-cluster.js'

const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-mp-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

let cluster: RedisClusterHandle | undefined
afterAll(async () => { await cluster?.stop() })

const stores: Array<{ store: string, availability: Availability, env: Record<string, string>, setup?: () => Promise<Record<string, string>> }> = [
  { store: 'redis', availability: await service(REDIS), env: {} },
  { store: 'postgres', availability: await service(POSTGRES), env: {} },
  { store: 'mysql', availability: await service(MARIADB), env: {} },
  { store: 'sqlite', availability: { available: true, reason: '' }, env: { SQLITE_FILE: join(sqliteDir, 'shared.db') } },
  {
    store: 'redis-cluster',
    availability: redisClusterAvailability(),
    env: {},
    setup: async () => {
      cluster = await startRedisCluster()
      return { REDIS_CLUSTER_PORTS: cluster.nodes.map((node) => node.port).join(',') }
    }
  }
]

const LOCK_TIMEOUT = 2500

function spread (servers: ServerProcess[], count: number, key: string, headers: Record<string, string> = {}): Promise<Answer[]> {
  return Promise.all(Array.from({ length: count }, (_, i) => postOrder(servers[i % servers.length]!, key, { amount: 42 }, headers)))
}

for (const { store, availability, env, setup } of stores) {
  describe.skipIf(!availability.available)(`several processes on ${store}${availability.reason}`, () => {
    const namespace = `mp_${store}_${process.pid}_${Date.now()}`
    const { servers, waiting } = sharedServers(store, namespace, async () => ({ STORE: store, NAMESPACE: namespace, LOCK_TIMEOUT: String(LOCK_TIMEOUT), ...env, ...await setup?.() }))

    it('runs the handler once for 50 simultaneous requests with one key over 3 processes', async () => {
      const key = newKey('mp')
      const answers = await spread(servers, 50, key, { 'x-delay': '300' })
      const executed = answers.filter((a) => a.status === 201 && !a.replayed)
      expect(executed).toHaveLength(1)
      for (const answer of answers) {
        expect([201, 409]).toContain(answer.status)
        if (answer.status === 201) expect(answer.body).toBe(executed[0]!.body)
        else expect(answer.body).toContain('#request-in-progress')
      }
      expect(await effectCount(servers[0]!, key)).toBe(1)
      for (const server of servers) {
        const replay = await postOrder(server, key, { amount: 42 })
        expect(replay.replayed).toBe(true)
        expect(replay.body).toBe(executed[0]!.body)
      }
    })

    it('runs the handler once per key for 5 keys × 20 simultaneous requests', async () => {
      const keys = Array.from({ length: 5 }, () => newKey('mpk'))
      await Promise.all(keys.map((key) => spread(servers, 20, key, { 'x-delay': '200' })))
      for (const key of keys) expect(await effectCount(servers[1]!, key)).toBe(1)
    })

    it('with wait mode, gives every simultaneous duplicate the one response', async () => {
      const key = newKey('mpw')
      const answers = await spread(waiting, 20, key, { 'x-delay': '300' })
      expect(answers.every((a) => a.status === 201 && a.body === answers[0]!.body)).toBe(true)
      expect(answers.filter((a) => !a.replayed)).toHaveLength(1)
      expect(await effectCount(waiting[0]!, key)).toBe(1)
    })

    it('survives a SIGKILL mid-request: 409 until the lease lapses, then the retry runs exactly once', async () => {
      const key = newKey('crash')
      const [victim, survivor] = servers as [ServerProcess, ServerProcess, ServerProcess]
      const lost = postOrder(victim, key, { amount: 42 }, { 'x-hang': '1' }).catch(() => null)
      await victim.hanging(key)
      const killedAt = Date.now()
      await victim.kill('SIGKILL')
      expect(await lost).toBeNull()
      const early = await postOrder(survivor, key, { amount: 42 })
      expect(early.status).toBe(409)
      expect(early.body).toContain('#request-in-progress')
      // The lease is time-based: wait for it to lapse (LOCK_TIMEOUT after the victim took it).
      await sleep(Math.max(0, LOCK_TIMEOUT - (Date.now() - killedAt)) + 300)
      const retry = await postOrder(survivor, key, { amount: 42 })
      expect(retry.status).toBe(201)
      expect(retry.replayed).toBe(false)
      expect((await postOrder(survivor, key, { amount: 42 })).replayed).toBe(true)
      expect(await effectCount(survivor, key)).toBe(1)
    })
  })
}
