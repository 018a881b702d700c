/**
 * The NATS JetStream recipe (docs/jobs.md#nats-jetstream), read out of the page, against real
 * servers: the machine's nats-server (2.9, which ignores a `term` with a reason) and a newer one
 * (2.10, Debian 13's package: scripts/nats-server-runtime.sh, NATS_SERVER_NEWER) started on a free
 * port of its own. Consumer processes on one durable consumer of a fresh stream with a short
 * AckWait and the max_deliver the page advises (or a tight one), their keys in Redis, their work a
 * recovery point that pushes an entry on a Redis list, counted there. A consumer is killed with
 * SIGKILL mid-job; poison is published; the work throws; the work outlives AckWait. Each test
 * asserts the work was done exactly once, or the message terminated when no delivery could succeed.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { AckPolicy, StorageType, jetstream, jetstreamManager, type JetStreamManager } from '@nats-io/jetstream'
import { connect, nanos, type NatsConnection } from '@nats-io/transport-node'
import { Redis } from 'ioredis'
import { NATS, REDIS, deleteRedisPrefix, natsServer, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'
import { scaled } from './helpers/pace.js'

const nats = await service(NATS)
const redisUp = await service(REDIS)
const run = `${process.pid}_${Date.now()}`
const PREFIX = `recipes_nats_${run}:`
/** JetStream redelivers a message not acked (nor said to be in hand) within this. */
const ACK_WAIT_MS = 1000
/** The consumers' lease: longer than AckWait, so a dead consumer's message comes back while its lease is held. */
const LOCK_TIMEOUT = scaled(3000)
/** The max_deliver docs/jobs.md advises. */
const ADVISED_MAX_DELIVER = 5
/** The newer nats-server, when scripts/nats-server-runtime.sh installed one. */
const NEWER = process.env.NATS_SERVER_NEWER
if (NEWER === undefined && process.env.CI === 'true') throw new Error('NATS_SERVER_NEWER is not set (scripts/nats-server-runtime.sh): under CI=true the newer nats-server is required')

/** A nats-server of our own, with JetStream, on a free port of loopback. */
async function startNatsServer (binary: string): Promise<{ url: string, stop: () => Promise<void> }> {
  const port = await new Promise<number>((resolve) => {
    const probe = createServer().listen(0, '127.0.0.1', () => {
      const { port } = probe.address() as { port: number }
      probe.close(() => resolve(port))
    })
  })
  const dir = mkdtempSync(join(tmpdir(), 'recipes-nats-'))
  const child: ChildProcess = spawn(binary, ['-a', '127.0.0.1', '-p', String(port), '-js', '-sd', dir], { stdio: 'ignore' })
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()))
  const url = `127.0.0.1:${port}`
  for (let tries = 0; ; tries++) {
    try {
      await (await connect({ servers: url })).close()
      break
    } catch (error) {
      if (tries > 100) throw error
      await sleep(50)
    }
  }
  return { url, stop: async () => { child.kill(); await exited; rmSync(dir, { recursive: true, force: true }) } }
}

/** The first line starting with `prefix` that any of `workers` writes, and the worker that wrote it. */
async function firstLine (workers: Worker[], prefix: string): Promise<{ worker: Worker, line: string }> {
  return await Promise.any(workers.map(async (worker) => ({ worker, line: await worker.line(prefix) })))
}

const servers: Array<{ name: string, available: boolean, reason: string, start: () => Promise<{ url: string, stop: () => Promise<void> }> }> = [
  { name: 'the machine\'s nats-server (2.9)', available: nats.available, reason: nats.reason, start: async () => ({ url: natsServer, stop: async () => {} }) },
  { name: 'nats-server 2.10', available: NEWER !== undefined, reason: NEWER === undefined ? ' (skipped: NATS_SERVER_NEWER is not set; scripts/nats-server-runtime.sh installs one)' : '', start: async () => await startNatsServer(NEWER!) }
]

for (const server of servers) {
  describe.skipIf(!server.available || !redisUp.available)(`NATS JetStream recipe on ${server.name}: the work runs once, whatever JetStream redelivers${server.reason || redisUp.reason}`, () => {
    let url: string
    let stop: () => Promise<void>
    let nc: NatsConnection
    let jsm: JetStreamManager
    let redis: Redis
    const streams: string[] = []

    beforeAll(async () => {
      ({ url, stop } = await server.start())
      nc = await connect({ servers: url })
      jsm = await jetstreamManager(nc)
      redis = new Redis({ host: REDIS.host, port: REDIS.port })
    })

    afterEach(killWorkers)

    afterAll(async () => {
      await killWorkers()
      for (const stream of streams) await jsm.streams.delete(stream)
      await nc.close()
      await stop()
      await deleteRedisPrefix(redis, PREFIX)
      await redis.quit()
    })

    /** A fresh stream on a subject of its own, with a durable consumer `workers`. */
    async function freshStream (maxDeliver = ADVISED_MAX_DELIVER, duplicateWindowMs?: number): Promise<{ stream: string, subject: string }> {
      const stream = `recipes_${run}_${streams.length}`
      const subject = `recipes.${run}.${streams.length}.orders`
      streams.push(stream)
      await jsm.streams.add({ name: stream, subjects: [subject], storage: StorageType.Memory, ...duplicateWindowMs === undefined ? {} : { duplicate_window: nanos(duplicateWindowMs) } })
      await jsm.consumers.add(stream, { durable_name: 'workers', ack_policy: AckPolicy.Explicit, ack_wait: nanos(ACK_WAIT_MS), max_deliver: maxDeliver })
      return { stream, subject }
    }

    const consumers = async (stream: string, count: number, env: Record<string, string> = {}): Promise<Worker[]> =>
      await Promise.all(Array.from({ length: count }, async () => await startWorker('nats-worker.ts', { STREAM: stream, CONSUMER: 'workers', PREFIX, NATS_URL: url, LOCK_TIMEOUT: String(LOCK_TIMEOUT), ...env })))

    /** Until JetStream has nothing more to deliver: every message acked, terminated, or out of deliveries. */
    async function settled (stream: string): Promise<void> {
      for (;;) {
        const info = await jsm.consumers.info(stream, 'workers')
        if (info.num_ack_pending === 0 && info.num_pending === 0) return
        await sleep(50)
      }
    }

    const effects = async (key: string): Promise<string[]> => await redis.lrange(`${PREFIX}effects:${key}`, 0, -1)
    const linesOf = (workers: Worker[], prefix: string): string[] => workers.flatMap((worker) => worker.lines.filter((line) => line.startsWith(prefix)))

    it('a work that outlives AckWait keeps its delivery in hand: JetStream does not deliver it again, and it is acked once done', async () => {
      const { stream, subject } = await freshStream()
      const workers = await consumers(stream, 2, { HOLD: '1' })
      const key = 'order-long'
      await jetstream(nc).publish(subject, JSON.stringify({ orderId: 1 }), { msgID: key })
      const { worker: holder } = await firstLine(workers, `HOLDING ${key}`)
      // Three AckWaits pass with the work still running, and nothing is delivered again.
      await sleep(3 * ACK_WAIT_MS)
      holder.send(`RELEASE ${key}`)
      await holder.line(`ACK ${key} 1`)
      await settled(stream)
      expect(await effects(key)).toEqual([String(holder.pid)])
      expect(linesOf(workers, 'WORKING')).toEqual([`WORKING ${key}`])
      expect(linesOf(workers, 'NAK')).toEqual([])
    })

    for (const maxDeliver of [2, ADVISED_MAX_DELIVER]) {
      it(`a consumer killed mid-job, with max_deliver ${maxDeliver}: the redelivery waits out its lease in hand, spending no delivery, and finishes the work once`, async () => {
        const { stream, subject } = await freshStream(maxDeliver)
        const [first] = await consumers(stream, 1, { HANG: '1' })
        const key = `order-killed-${maxDeliver}`
        await jetstream(nc).publish(subject, JSON.stringify({ orderId: 2 }), { msgID: key })
        await first!.line(`HANGING ${key}`)
        const [survivor] = await consumers(stream, 1)
        await first!.kill('SIGKILL')
        // The second delivery, after AckWait: it finds the dead consumer's lease, waits in hand
        // until it lapses, then the work resumes after its recovery point.
        await survivor!.line(`ACK ${key} 2`, scaled(30_000))
        await settled(stream)
        expect(await effects(key)).toEqual([String(first!.pid)])
        expect(survivor!.lines.filter((line) => line.startsWith(`DECISION ${key} retry in-progress`)).length).toBeLessThanOrEqual(2)
        expect(linesOf([survivor!], 'NAK')).toEqual([])
      })
    }

    it('poison (not JSON, another body under a message id that was done) is terminated with a plain term(), and never delivered again', async () => {
      const window = 200
      const { stream, subject } = await freshStream(ADVISED_MAX_DELIVER, window)
      const [worker] = await consumers(stream, 1)
      const js = jetstream(nc)
      await js.publish(subject, '<html>not json</html>', { msgID: 'order-html' })
      await js.publish(subject, JSON.stringify({ orderId: 3 }), { msgID: 'order-3' })
      await worker!.line('ACK order-3 1')
      // Past the stream's duplicate window, another body under the same id reaches the consumer.
      await sleep(2 * window)
      await js.publish(subject, JSON.stringify({ orderId: 4 }), { msgID: 'order-3' })
      await worker!.line('TERM order-3 1')
      await worker!.line('TERM order-html 1')
      await settled(stream)
      expect(worker!.lines).toContain('DECISION order-3 give-up fingerprint-mismatch')
      expect(linesOf([worker!], 'TERM')).toEqual(['TERM order-html 1 undefined', 'TERM order-3 1 undefined'])
      expect(linesOf([worker!], 'WORKING')).toEqual(['WORKING order-3'])
      expect(await effects('order-3')).toEqual([String(worker!.pid)])
    })

    it('the work\'s own SyntaxError (a downstream HTML page) is a failed attempt: nak\'ed, redelivered, and done once', async () => {
      const { stream, subject } = await freshStream()
      const [worker] = await consumers(stream, 1, { FAIL: 'html-once' })
      await jetstream(nc).publish(subject, JSON.stringify({ orderId: 5 }), { msgID: 'order-5' })
      await worker!.line('ACK order-5 2')
      expect(worker!.lines).toContain('DECISION order-5 failed SyntaxError')
      expect(worker!.lines).toContain('NAK order-5 1 1000')
      expect(await effects('order-5')).toEqual([String(worker!.pid)])
    })

    it('work that always throws is tried max_deliver times, then JetStream delivers it no more', async () => {
      const { stream, subject } = await freshStream(3)
      const [worker] = await consumers(stream, 1, { FAIL: 'always' })
      await jetstream(nc).publish(subject, JSON.stringify({ orderId: 6 }), { msgID: 'order-6' })
      await worker!.line('NAK order-6 3 ')
      await settled(stream)
      expect(linesOf([worker!], 'WORKING')).toEqual(['WORKING order-6', 'WORKING order-6', 'WORKING order-6'])
      expect(await effects('order-6')).toEqual([])
    })

    it('docs/jobs.md shows the consumer these tests run', () => {
      expectDocumented('nats-consumer.ts')
    })
  })
}
