/**
 * Recovery points over real processes: a handler charges a local fake payment provider (which
 * counts its calls by their idempotency key) in a step, then writes the order in a second step.
 * Killed with SIGKILL between the two, or failing there, the retry from another process runs the
 * second step only: the provider saw one charge, the order was written once.
 */
import { createServer, type Server } from 'node:http'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { MARIADB, POSTGRES, REDIS, service, type Availability } from './helpers/services.js'
import { effectCount, sharedServers, type ServerProcess } from './helpers/processes.js'
import { newKey } from './helpers/app.js'
import { postWithKey } from './helpers/http-client.js'

const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-steps-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

/** The fake payment provider: every call counted, by the idempotency key it carried. */
const calls = new Map<string, number>()
let provider: Server
let providerUrl = ''
beforeAll(async () => {
  provider = createServer((request, response) => {
    const key = String(request.headers['idempotency-key'])
    calls.set(key, (calls.get(key) ?? 0) + 1)
    response.setHeader('content-type', 'application/json')
    response.end(JSON.stringify({ id: `ch_${calls.size}` }))
  })
  await new Promise<void>((resolve) => provider.listen(0, '127.0.0.1', resolve))
  providerUrl = `http://127.0.0.1:${(provider.address() as { port: number }).port}`
})
afterAll(async () => { await new Promise((resolve) => provider.close(resolve)) })

const totalCalls = (): number => [...calls.values()].reduce((sum, n) => sum + n, 0)

const stores: Array<{ store: string, availability: Availability, env: Record<string, string> }> = [
  { store: 'redis', availability: await service(REDIS), env: {} },
  { store: 'postgres', availability: await service(POSTGRES), env: {} },
  { store: 'mysql', availability: await service(MARIADB), env: {} },
  { store: 'sqlite', availability: { available: true, reason: '' }, env: { SQLITE_FILE: join(sqliteDir, 'steps.db') } }
]

const LOCK_TIMEOUT = 1500

function post (server: ServerProcess, key: string, headers: Record<string, string> = {}): Promise<{ status: number, body: string }> {
  return postWithKey(`${server.url}/steps`, key, '{"amount":4200}', headers)
}

/** The same work as a job: `app.idempotency.run(key, body, fn)`, keyed by `x-job-key`. */
async function runJob (server: ServerProcess, key: string, headers: Record<string, string> = {}, body = '{"amount":4200}'): Promise<{ status: number, body: string }> {
  const res = await fetch(`${server.url}/run`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-job-key': key, ...headers }, body })
  return { status: res.status, body: await res.text() }
}

for (const { store, availability, env } of stores) {
  describe.skipIf(!availability.available)(`recovery points across processes on ${store}${availability.reason}`, () => {
    const namespace = `steps_${store}_${process.pid}_${Date.now()}`
    // The first of `servers` is killed by the SIGKILL test; the other two serve the rest.
    const { servers, waiting } = sharedServers(store, namespace, async () => ({ STORE: store, NAMESPACE: namespace, LOCK_TIMEOUT: String(LOCK_TIMEOUT), PROVIDER_URL: providerUrl, ...env }))

    it('after a SIGKILL between the two steps, the retry from another process runs the second step only', async () => {
      const key = newKey('kill')
      const before = totalCalls()
      const [victim, survivor] = servers as [ServerProcess, ServerProcess, ServerProcess]
      const lost = post(victim, key, { 'x-hang': 'after-charge' }).catch(() => null)
      await victim.hanging(key)
      const killedAt = Date.now()
      await victim.kill('SIGKILL')
      expect(await lost).toBeNull()
      expect(totalCalls()).toBe(before + 1)
      await sleep(Math.max(0, LOCK_TIMEOUT - (Date.now() - killedAt)) + 300)
      const retry = await post(survivor, key)
      expect(retry.status).toBe(201)
      expect(totalCalls()).toBe(before + 1)
      expect(await effectCount(survivor, key)).toBe(1)
      expect(JSON.parse(retry.body).order).toEqual({ id: `ord_${key}` })
    })

    it('after the handler throws between the two steps, the retry does not charge again', async () => {
      const key = newKey('throw')
      const before = totalCalls()
      const failed = await post(servers[2]!, key, { 'x-hang': 'throw-after-charge' })
      expect(failed.status).toBe(500)
      const retry = await post(servers[1]!, key)
      expect(retry.status).toBe(201)
      expect(totalCalls()).toBe(before + 1)
      expect(await effectCount(servers[1]!, key)).toBe(1)
    })

    it('runs each step once for 50 simultaneous duplicates over two processes', async () => {
      const key = newKey('storm')
      const before = totalCalls()
      const answers = await Promise.all(Array.from({ length: 50 }, (_, i) => post(waiting[i % 2]!, key, { 'x-delay': '200' })))
      expect(answers.every((a) => a.status === 201 && a.body === answers[0]!.body)).toBe(true)
      expect(totalCalls()).toBe(before + 1)
      expect(await effectCount(waiting[0]!, key)).toBe(1)
    })

    it('run(): after a SIGKILL between the two steps of a job, the job run again by another process runs the second step only', async () => {
      const key = newKey('job-kill')
      const before = totalCalls()
      const [, victim, survivor] = servers as [ServerProcess, ServerProcess, ServerProcess]
      const lost = runJob(victim, key, { 'x-hang': 'after-charge' }).catch(() => null)
      await victim.hanging(key)
      const killedAt = Date.now()
      await victim.kill('SIGKILL')
      expect(await lost).toBeNull()
      await sleep(Math.max(0, LOCK_TIMEOUT - (Date.now() - killedAt)) + 300)
      const retry = await runJob(survivor, key)
      expect(retry.status).toBe(201)
      expect(totalCalls()).toBe(before + 1)
      expect(await effectCount(survivor, key)).toBe(1)
      expect((await runJob(waiting[0]!, key)).body).toBe(retry.body)
      expect((await runJob(waiting[0]!, key, {}, '{"amount":1}')).status).toBe(409)
    })

    it('run(): 40 simultaneous duplicates of a job over two processes in wait mode run it once and all get its result', async () => {
      const key = newKey('job-storm')
      const before = totalCalls()
      const answers = await Promise.all(Array.from({ length: 40 }, (_, i) => runJob(waiting[i % 2]!, key, { 'x-delay': '200' })))
      expect(answers.every((a) => a.status === 201 && a.body === answers[0]!.body)).toBe(true)
      expect(totalCalls()).toBe(before + 1)
      expect(await effectCount(waiting[0]!, key)).toBe(1)
    })
  })
}

describe('the fake provider', () => {
  it('counts every call, so a second charge would show', async () => {
    const before = totalCalls()
    await fetch(`${providerUrl}/charges`, { method: 'POST', headers: { 'idempotency-key': 'x' } })
    await fetch(`${providerUrl}/charges`, { method: 'POST', headers: { 'idempotency-key': 'x' } })
    expect(totalCalls()).toBe(before + 2)
  })
})
