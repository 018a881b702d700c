/**
 * Waiting and renewal never depend on agreeing clocks, nor on a responsive event loop, over real
 * HTTP across server processes on each shared store. A process whose clock runs 30 s ahead of the
 * store's sees every lease end as past already; one 30 s behind sees it far ahead. Neither may run
 * a key twice or leave a duplicate hanging. A handler that stalls the event loop for most of the
 * lease keeps its key: its lease is renewed often enough to outlive the stall.
 */
import { afterAll, describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import idempotency from '../lib/index.js'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { MARIADB, POSTGRES, REDIS, service, type Availability } from './helpers/services.js'
import { dropNamespace, effectCount, postOrder, startServer, type Answer, type ServerProcess } from './helpers/processes.js'
import { newKey } from './helpers/app.js'

const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-clocks-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

const stores: Array<{ store: string, availability: Availability, env: Record<string, string> }> = [
  { store: 'redis', availability: await service(REDIS), env: {} },
  { store: 'postgres', availability: await service(POSTGRES), env: {} },
  { store: 'mysql', availability: await service(MARIADB), env: {} },
  { store: 'sqlite', availability: { available: true, reason: '' }, env: { SQLITE_FILE: join(sqliteDir, 'clocks.db') } }
]

/** Shorter than the skew, so that a process ahead sees every lease as lapsed. */
const LOCK_TIMEOUT = 3000
const SKEW = 30_000

/** Poll `read` until it holds, or fail after `timeout` ms (a process that stopped answering). */
async function until (what: string, read: () => Promise<boolean>, timeout = 15_000): Promise<void> {
  const deadline = performance.now() + timeout
  while (!await read()) {
    if (performance.now() > deadline) throw new Error(`${what}: not within ${timeout} ms`)
    await sleep(20)
  }
}

/** How many requests with `key` a server received, and how many `begin` calls it has sent in all. */
async function arrivals (server: ServerProcess, key: string): Promise<{ count: number, begins: number }> {
  const res = await fetch(`${server.url}/arrivals?key=${encodeURIComponent(key)}`, { signal: AbortSignal.timeout(5000) })
  return (await res.json()) as { count: number, begins: number }
}

for (const { store, availability, env } of stores) {
  describe.skipIf(!availability.available)(`clocks and stalls on ${store}${availability.reason}`, () => {
    const namespace = `clk_${store}_${process.pid}_${Date.now()}`
    const base = { STORE: store, NAMESPACE: namespace, LOCK_TIMEOUT: String(LOCK_TIMEOUT), ...env }
    let ahead: ServerProcess, behind: ServerProcess, plain: ServerProcess
    const started = Promise.all([
      startServer({ ...base, WAIT: '1', CLOCK_SKEW: String(SKEW) }),
      startServer({ ...base, WAIT: '1', CLOCK_SKEW: String(-SKEW) }),
      startServer(base)
    ]).then((servers) => { [ahead, behind, plain] = servers })
    afterAll(async () => {
      await started.catch(() => {})
      await Promise.all([ahead, behind, plain].map((server) => server?.kill()))
      await dropNamespace(store, namespace)
    })

    it('in wait mode, duplicates on processes 30 s ahead of and behind the store wait for the first and replay it: one run, no hang, polling bounded', async () => {
      await started
      const key = newKey('skew')
      const first = postOrder(plain, key, { amount: 1 }, { 'x-hang': 'gate' })
      await plain.hanging(key)
      const beginsBefore = (await arrivals(ahead, key)).begins
      const waitStarted = performance.now()
      const duplicates = [ahead, ahead, ahead, behind, behind, behind].map((server) => postOrder(server, key, { amount: 1 }))
      // Every duplicate has reached its process, which still answers.
      await until('the duplicates arrive', async () => (await arrivals(ahead, key)).count === 3 && (await arrivals(behind, key)).count === 3)
      const waited = performance.now() - waitStarted
      await fetch(`${plain.url}/release?key=${encodeURIComponent(key)}`, { method: 'POST' })
      // A duplicate asks again after 25 ms, then 50, 100, 200, and every 400 ms: not in a tight loop.
      const begins = (await arrivals(ahead, key)).begins - beginsBefore
      expect(begins).toBeLessThanOrEqual(3 * (6 + waited / 400))
      const answers = await Promise.all([first, ...duplicates])
      expect(answers.map((answer) => answer.status)).toEqual(Array(7).fill(201))
      expect(new Set(answers.map((answer) => answer.body)).size).toBe(1)
      expect(answers.filter((answer) => !answer.replayed)).toHaveLength(1)
      expect(await effectCount(plain, key)).toBe(1)
    })

    it('keeps the key of a handler that stalls the event loop for 80% of lockTimeout, on a process 30 s ahead', async () => {
      await started
      const key = newKey('stall')
      // The stall begins just before the renewal timer's next tick would have renewed the lease.
      const stalled = postOrder(ahead, key, { amount: 2 }, { 'x-block': `${LOCK_TIMEOUT / 4 - 30},${LOCK_TIMEOUT * 0.8}` })
      await ahead.hanging(key)
      // Another process asks for the key until it gets a response: it must never find the key free.
      const seen: Answer[] = []
      for (let answer = await postOrder(plain, key, { amount: 2 }); ; answer = await postOrder(plain, key, { amount: 2 })) {
        seen.push(answer)
        if (answer.status === 201) break
        await sleep(100)
      }
      const answer = await stalled
      expect(answer.status).toBe(201)
      expect(seen.filter((a) => a.status === 201 && !a.replayed)).toEqual([])
      expect(seen.filter((a) => a.status !== 201).every((a) => a.status === 409 && a.body.includes('#request-in-progress'))).toBe(true)
      expect(await effectCount(plain, key)).toBe(1)
    })
  })
}

it('logs a warning, with how long the event loop stalled, when a lease is renewed late by half of lockTimeout or more', async () => {
  const lines: string[] = []
  const app = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { lines.push(line) } } } })
  await app.register(idempotency, { lockTimeout: 800 })
  app.post('/stall', { config: { idempotency: true } }, async () => {
    await sleep(50)
    const until = performance.now() + 600
    while (performance.now() < until);
    await sleep(150)
    return { done: true }
  })
  const answer = await app.inject({ method: 'POST', url: '/stall', headers: { 'idempotency-key': newKey('stall-log') }, payload: {} })
  expect(answer.statusCode).toBe(200)
  const warnings = lines.map((line) => JSON.parse(line) as { msg: string, stalledMs?: number, lockTimeout?: number })
    .filter((line) => line.msg.startsWith('idempotency lease renewed late'))
  expect(warnings).toHaveLength(1)
  expect(warnings[0]!.stalledMs).toBeGreaterThanOrEqual(400)
  expect(warnings[0]!.lockTimeout).toBe(800)
  await app.close()
})
