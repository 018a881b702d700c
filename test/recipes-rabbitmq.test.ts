/**
 * The RabbitMQ recipe (docs/jobs.md#rabbitmq, examples/recipes/rabbitmq-consumer.ts) against the
 * real broker: consumer processes on a fresh queue, their keys in PostgreSQL, the work a ledger
 * row in PostgreSQL, counted there. A consumer is killed with SIGKILL after its work and before
 * its ack, or after its row was written and before run kept its result; the broker redelivers the
 * message to another consumer, and the ledger holds exactly one row for it.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import amqp, { type Channel, type ChannelModel } from 'amqplib'
import knexFactory, { type Knex } from 'knex'
import { createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { POSTGRES, RABBITMQ, amqpUrl, pgConnection, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'

const rabbitmq = await service(RABBITMQ)
const postgres = await service(POSTGRES)
const reason = rabbitmq.reason || postgres.reason
const run = `${process.pid}_${Date.now()}`
const STORE_TABLE = `recipes_rmq_keys_${run}`
const LEDGER_TABLE = `recipes_rmq_ledger_${run}`
/** The consumers' lease: a killed consumer's key is free again after this. */
const LOCK_TIMEOUT = 1000

describe.skipIf(!rabbitmq.available || !postgres.available)(`RabbitMQ recipe: one ledger row per message, whatever the broker redelivers${reason}`, () => {
  let knex: Knex
  let connection: ChannelModel
  let channel: Channel
  let replyQueue = ''
  /** The replies the consumers sent, by correlation id. */
  const replies = new Map<string, unknown[]>()
  const replyWaiters: Array<() => void> = []
  const queues: string[] = []
  let orders = 0

  beforeAll(async () => {
    knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
    await createIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.createTable(LEDGER_TABLE, (t) => { t.increments('id'); t.integer('order_id').notNullable(); t.integer('cents').notNullable(); t.integer('pid').notNullable() })
    connection = await amqp.connect(amqpUrl)
    channel = await connection.createChannel()
    replyQueue = (await channel.assertQueue('', { exclusive: true })).queue
    await channel.consume(replyQueue, (message) => {
      if (message === null) return
      const id = String(message.properties.correlationId)
      replies.set(id, [...replies.get(id) ?? [], JSON.parse(message.content.toString())])
      for (const wake of replyWaiters.splice(0)) wake()
    }, { noAck: true })
  })

  afterEach(killWorkers)

  afterAll(async () => {
    await killWorkers()
    for (const queue of queues) await channel.deleteQueue(queue)
    await connection.close()
    await dropIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.dropTable(LEDGER_TABLE)
    await knex.destroy()
  })

  /** A fresh queue, and a message on it: an order, with its id as messageId and a reply wanted. */
  async function publishOrder (): Promise<{ queue: string, messageId: string, orderId: number }> {
    const queue = `recipes-rmq-${run}-${queues.length}`
    queues.push(queue)
    await channel.assertQueue(queue, { durable: false })
    const orderId = ++orders
    const messageId = `order-${orderId}`
    channel.sendToQueue(queue, Buffer.from(JSON.stringify({ orderId, cents: 4200 })), { messageId, replyTo: replyQueue, correlationId: messageId })
    return { queue, messageId, orderId }
  }

  const consumer = (queue: string, env: Record<string, string>): Promise<Worker> =>
    startWorker('rabbitmq-worker.ts', { QUEUE: queue, STORE_TABLE, LEDGER_TABLE, LOCK_TIMEOUT: String(LOCK_TIMEOUT), ...env })

  async function repliesTo (messageId: string, count: number): Promise<unknown[]> {
    while ((replies.get(messageId)?.length ?? 0) < count) await new Promise<void>((resolve) => replyWaiters.push(resolve))
    return replies.get(messageId)!
  }

  async function ledger (orderId: number): Promise<Array<{ id: number, pid: number }>> {
    return await knex(LEDGER_TABLE).where({ order_id: orderId }).select('id', 'pid')
  }

  /** Stop `worker` and wait until the broker has seen it go: a message it had not acked would be back on the queue. */
  async function queueLeftEmpty (queue: string, worker: Worker): Promise<void> {
    await worker.kill()
    for (;;) {
      const { consumerCount, messageCount } = await channel.checkQueue(queue)
      if (consumerCount === 0) {
        expect(messageCount).toBe(0)
        return
      }
      await new Promise((resolve) => setTimeout(resolve, 50))
    }
  }

  it('a consumer killed after its work and before its ack: the redelivered message is acked with the kept result, and the work ran once', async () => {
    const { queue, messageId, orderId } = await publishOrder()
    const first = await consumer(queue, { HANG: 'before-ack', TRANSACTION: '1' })
    await first.line(`HANGING ${messageId}`)
    const [kept] = await repliesTo(messageId, 1)
    const second = consumer(queue, {})
    await first.kill('SIGKILL')
    const survivor = await second
    await survivor.line(`ACK ${messageId} true`)
    expect(await repliesTo(messageId, 2)).toEqual([kept, kept])
    const rows = await ledger(orderId)
    expect(rows).toEqual([{ id: (kept as { ledgerId: number }).ledgerId, pid: first.pid }])
    await queueLeftEmpty(queue, survivor)
  })

  it('in transaction mode, a consumer killed after writing its row and before run kept its result: the row rolls back, and the redelivery writes it once', async () => {
    const { queue, messageId, orderId } = await publishOrder()
    const first = await consumer(queue, { HANG: 'after-effect', TRANSACTION: '1' })
    await first.line(`HANGING ${messageId}`)
    const second = consumer(queue, { TRANSACTION: '1' })
    await first.kill('SIGKILL')
    const survivor = await second
    await survivor.line(`ACK ${messageId} true`)
    const rows = await ledger(orderId)
    expect(rows).toEqual([{ id: expect.any(Number), pid: survivor.pid }])
    expect(await repliesTo(messageId, 1)).toEqual([{ orderId, ledgerId: rows[0]!.id }])
    await queueLeftEmpty(queue, survivor)
  })

  it('without transaction mode, the same crash leaves the first row and the redelivery writes a second: the gap transaction mode closes', async () => {
    const { queue, messageId, orderId } = await publishOrder()
    const first = await consumer(queue, { HANG: 'after-effect' })
    await first.line(`HANGING ${messageId}`)
    const second = consumer(queue, {})
    await first.kill('SIGKILL')
    const survivor = await second
    await survivor.line(`ACK ${messageId} true`)
    expect((await ledger(orderId)).map((row) => row.pid)).toEqual([first.pid, survivor.pid])
  })

  it('docs/jobs.md shows the consumer these tests run', () => {
    expectDocumented('rabbitmq-consumer.ts')
  })
})
