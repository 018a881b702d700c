/**
 * The NATS JetStream recipe (docs/jobs.md#nats-jetstream, examples/recipes/nats-consumer.ts)
 * against the real server: two consumer processes on one durable consumer of a fresh stream, with
 * a short AckWait, their keys in Redis, their work an entry on a Redis list, counted there. The
 * first delivery's work outlives AckWait; JetStream redelivers the message while it runs; the
 * redelivery is nak'ed with a delay until the work is done, and the work ran once.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { AckPolicy, StorageType, jetstream, jetstreamManager, type JetStreamManager } from '@nats-io/jetstream'
import { connect, nanos, type NatsConnection } from '@nats-io/transport-node'
import { Redis } from 'ioredis'
import { NATS, REDIS, deleteRedisPrefix, natsServer, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'

const nats = await service(NATS)
const redisUp = await service(REDIS)
const reason = nats.reason || redisUp.reason
const run = `${process.pid}_${Date.now()}`
const PREFIX = `recipes_nats_${run}:`
/** JetStream redelivers a message not acked within this. */
const ACK_WAIT_MS = 1000

/** The first line starting with `prefix` that any of `workers` writes, and the worker that wrote it. */
async function firstLine (workers: Worker[], prefix: string): Promise<{ worker: Worker, line: string }> {
  return await Promise.any(workers.map(async (worker) => ({ worker, line: await worker.line(prefix) })))
}

describe.skipIf(!nats.available || !redisUp.available)(`NATS JetStream recipe: the work runs once when a message is redelivered while it runs${reason}`, () => {
  let nc: NatsConnection
  let jsm: JetStreamManager
  let redis: Redis
  const streams: string[] = []

  beforeAll(async () => {
    nc = await connect({ servers: natsServer })
    jsm = await jetstreamManager(nc)
    redis = new Redis({ host: REDIS.host, port: REDIS.port })
  })

  afterEach(killWorkers)

  afterAll(async () => {
    await killWorkers()
    for (const stream of streams) await jsm.streams.delete(stream)
    await nc.close()
    await deleteRedisPrefix(redis, PREFIX)
    await redis.quit()
  })

  /** A fresh stream on a subject of its own, with a durable consumer `workers`. */
  async function freshStream (): Promise<{ stream: string, subject: string }> {
    const stream = `recipes_${run}_${streams.length}`
    const subject = `recipes.${run}.${streams.length}.orders`
    streams.push(stream)
    await jsm.streams.add({ name: stream, subjects: [subject], storage: StorageType.Memory })
    await jsm.consumers.add(stream, { durable_name: 'workers', ack_policy: AckPolicy.Explicit, ack_wait: nanos(ACK_WAIT_MS), max_deliver: 20 })
    return { stream, subject }
  }

  it('a message redelivered after AckWait while its first consumer still works is nak\'ed until the work is done: it ran once, and the message is acked', async () => {
    const { stream, subject } = await freshStream()
    const workers = await Promise.all([1, 2].map(async () => await startWorker('nats-worker.ts', { STREAM: stream, CONSUMER: 'workers', PREFIX, HOLD: '1' })))
    const key = 'order-1'
    await jetstream(nc).publish(subject, JSON.stringify({ orderId: 1 }), { msgID: key })

    const { worker: holder } = await firstLine(workers, `WORKING ${key}`)
    // AckWait passes with the work still running: JetStream delivers the message again, and the
    // delivery is refused as in progress (to either process: the lease is in Redis).
    const { line: refused } = await firstLine(workers, `NAK ${key} 2 `)
    expect(Number(refused.split(' ')[3])).toBeGreaterThanOrEqual(1000)
    holder.send(`RELEASE ${key}`)
    await firstLine(workers, `ACK ${key}`)

    expect(await redis.lrange(`${PREFIX}effects:${key}`, 0, -1)).toEqual([String(holder.pid)])
    // Nothing left to deliver: the message is acked for good (a later delivery would have replayed
    // the kept result and acked again, without running the work).
    for (;;) {
      const info = await jsm.consumers.info(stream, 'workers')
      if (info.num_ack_pending === 0 && info.num_pending === 0) break
      await new Promise((resolve) => setTimeout(resolve, 50))
    }
    expect(await redis.lrange(`${PREFIX}effects:${key}`, 0, -1)).toEqual([String(holder.pid)])
    expect(workers.flatMap((worker) => worker.lines.filter((line) => line.startsWith('WORKING')))).toEqual([`WORKING ${key}`])
  })

  it('docs/jobs.md shows the consumer this test runs', () => {
    expectDocumented('nats-consumer.ts')
  })
})
