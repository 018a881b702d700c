/**
 * The RabbitMQ recipe (docs/jobs.md#rabbitmq), read out of the page, against the real broker:
 * consumer processes on fresh queues (classic, and quorum with RabbitMQ's default delivery limit,
 * the page's advised one and a tight one), their keys in PostgreSQL, the work a ledger row in
 * PostgreSQL, counted there, and a dead-letter queue beside each queue, read there. A consumer is
 * killed with SIGKILL mid-job; poison is published; the work throws; a message comes twice to a
 * consumer with prefetch > 1 while its work outlives lockTimeout. Each test asserts the work was
 * done exactly once, or the message dead-lettered when no delivery could succeed.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import amqp, { type Channel, type ChannelModel, type Options } from 'amqplib'
import knexFactory, { type Knex } from 'knex'
import { createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { POSTGRES, RABBITMQ, amqpUrl, pgConnection, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'
import { scaled } from './helpers/pace.js'

const rabbitmq = await service(RABBITMQ)
const postgres = await service(POSTGRES)
const reason = rabbitmq.reason || postgres.reason
const run = `${process.pid}_${Date.now()}`
const STORE_TABLE = `recipes_rmq_keys_${run}`
const LEDGER_TABLE = `recipes_rmq_ledger_${run}`
/** The consumers' lease: a killed consumer's key is free again after this. */
const LOCK_TIMEOUT = scaled(1500)
/** The x-delivery-limit docs/jobs.md advises for a quorum queue. */
const ADVISED_LIMIT = 5

/** The queues a message can be on: RabbitMQ 3's quorum queues have no limit unless given one (4.0's default is 20). */
const QUEUE_KINDS: Array<{ name: string, arguments: Record<string, unknown> }> = [
  { name: 'a classic queue', arguments: {} },
  { name: 'a quorum queue with the default delivery limit', arguments: { 'x-queue-type': 'quorum' } },
  { name: `a quorum queue with the advised x-delivery-limit (${ADVISED_LIMIT})`, arguments: { 'x-queue-type': 'quorum', 'x-delivery-limit': ADVISED_LIMIT } },
  { name: 'a quorum queue with x-delivery-limit 1', arguments: { 'x-queue-type': 'quorum', 'x-delivery-limit': 1 } }
]
const QUORUM_ADVISED = QUEUE_KINDS[2]!.arguments

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

  /** A fresh queue of `kind`, dead-lettering to a fresh queue of its own. */
  async function freshQueue (args: Record<string, unknown> = {}): Promise<{ queue: string, deadLetters: string }> {
    const queue = `recipes-rmq-${run}-${queues.length}`
    const deadLetters = `${queue}-dead`
    queues.push(queue, deadLetters)
    await channel.assertQueue(deadLetters, { durable: false })
    const quorum = args['x-queue-type'] === 'quorum'
    await channel.assertQueue(queue, { durable: quorum, arguments: { ...args, 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': deadLetters } })
    return { queue, deadLetters }
  }

  /** An order on `queue`, with its id as messageId and a reply wanted. */
  function publish (queue: string, orderId = ++orders, properties: Options.Publish = {}, content: Buffer = Buffer.from(JSON.stringify({ orderId, cents: 4200 }))): { messageId: string, orderId: number } {
    const messageId = `order-${orderId}`
    channel.sendToQueue(queue, content, { messageId, replyTo: replyQueue, correlationId: messageId, ...properties })
    return { messageId, orderId }
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

  /** The message ids dead-lettered to `deadLetters` once `count` are there. */
  async function deadLettered (deadLetters: string, count: number): Promise<string[]> {
    for (;;) {
      const { messageCount } = await channel.checkQueue(deadLetters)
      if (messageCount >= count) break
      await new Promise((resolve) => setTimeout(resolve, 50))
    }
    const ids: string[] = []
    for (let message = await channel.get(deadLetters, { noAck: true }); message !== false; message = await channel.get(deadLetters, { noAck: true })) ids.push(String(message.properties.messageId))
    return ids
  }

  it('a consumer killed after its work and before its ack: the redelivered message is acked with the kept result, and the work ran once', async () => {
    const { queue } = await freshQueue()
    const { messageId, orderId } = publish(queue)
    const first = await consumer(queue, { HANG: 'before-ack', TRANSACTION: '1' })
    await first.line(`HANGING ${messageId}`)
    const [kept] = await repliesTo(messageId, 1)
    const second = consumer(queue, {})
    await first.kill('SIGKILL')
    const survivor = await second
    await survivor.line(`ACK ${messageId} `)
    expect(await repliesTo(messageId, 2)).toEqual([kept, kept])
    const rows = await ledger(orderId)
    expect(rows).toEqual([{ id: (kept as { ledgerId: number }).ledgerId, pid: first.pid }])
    await queueLeftEmpty(queue, survivor)
  })

  for (const kind of QUEUE_KINDS) {
    it(`in transaction mode, on ${kind.name}, a consumer killed mid-job: its row rolls back, the redelivery waits out its lease without spending a delivery, and writes the row once`, async () => {
      const { queue, deadLetters } = await freshQueue(kind.arguments)
      const { messageId, orderId } = publish(queue)
      const first = await consumer(queue, { HANG: 'after-effect', TRANSACTION: '1' })
      await first.line(`HANGING ${messageId}`)
      // Ready before the first dies, so that the lease is still held when the message comes back.
      const survivor = await consumer(queue, { TRANSACTION: '1' })
      await first.kill('SIGKILL')
      // Delivered once before: the crash is the one delivery spent (a quorum queue counts it in
      // x-delivery-count), whatever the waiting took.
      await survivor.line(`ACK ${messageId} ${kind.arguments['x-queue-type'] === 'quorum' ? 1 : 0}`)
      const rows = await ledger(orderId)
      expect(rows).toEqual([{ id: expect.any(Number), pid: survivor.pid }])
      expect(await repliesTo(messageId, 1)).toEqual([{ orderId, ledgerId: rows[0]!.id }])
      // It waited here for the dead consumer's lease (once, or twice when the store's clock lags).
      const waits = survivor.lines.filter((line) => line.startsWith(`DECISION ${messageId} retry in-progress`))
      expect(waits.length).toBeLessThanOrEqual(2)
      expect(survivor.lines.filter((line) => /^(REJECT|NACK) /.test(line))).toEqual([])
      await queueLeftEmpty(queue, survivor)
      expect((await channel.checkQueue(deadLetters)).messageCount).toBe(0)
    })
  }

  it('without transaction mode, the same crash leaves the first row and the redelivery writes a second: the gap transaction mode closes', async () => {
    const { queue } = await freshQueue()
    const { messageId, orderId } = publish(queue)
    const first = await consumer(queue, { HANG: 'after-effect' })
    await first.line(`HANGING ${messageId}`)
    const second = consumer(queue, {})
    await first.kill('SIGKILL')
    const survivor = await second
    await survivor.line(`ACK ${messageId} `)
    expect((await ledger(orderId)).map((row) => row.pid)).toEqual([first.pid, survivor.pid])
  })

  it('poison (not JSON, no messageId, another body under a messageId that was done) is dead-lettered, and the work runs only for the one good message', async () => {
    const { queue, deadLetters } = await freshQueue(QUORUM_ADVISED)
    const good = publish(queue)
    const notJson = publish(queue, ++orders, {}, Buffer.from('<html>not json</html>'))
    channel.sendToQueue(queue, Buffer.from(JSON.stringify({ orderId: ++orders, cents: 1 })), {})
    const worker = await consumer(queue, {})
    await worker.line(`ACK ${good.messageId} `)
    const other = publish(queue, good.orderId, {}, Buffer.from(JSON.stringify({ orderId: good.orderId, cents: 1 })))
    expect((await deadLettered(deadLetters, 3)).sort()).toEqual([notJson.messageId, 'undefined', other.messageId].sort())
    expect((await ledger(good.orderId)).length).toBe(1)
    expect(worker.lines.filter((line) => line.startsWith('WORKING'))).toEqual([`WORKING ${good.messageId}`])
    expect(worker.lines).toContain(`DECISION ${other.messageId} give-up fingerprint-mismatch`)
    await queueLeftEmpty(queue, worker)
  })

  it('the work\'s own SyntaxError (a downstream HTML page) is a failed attempt, not poison: the message goes back, and its next delivery does the work once', async () => {
    const { queue, deadLetters } = await freshQueue(QUORUM_ADVISED)
    const { messageId, orderId } = publish(queue)
    const worker = await consumer(queue, { FAIL: 'html-once' })
    await worker.line(`ACK ${messageId} 1`)
    expect(worker.lines).toContain(`DECISION ${messageId} failed SyntaxError`)
    expect(worker.lines).toContain(`REJECT ${messageId} true`)
    expect((await ledger(orderId)).length).toBe(1)
    await queueLeftEmpty(queue, worker)
    expect((await channel.checkQueue(deadLetters)).messageCount).toBe(0)
  })

  it('work that always throws is tried as often as the quorum queue\'s x-delivery-limit allows, then dead-lettered', async () => {
    const { queue, deadLetters } = await freshQueue({ 'x-queue-type': 'quorum', 'x-delivery-limit': 2 })
    const { messageId, orderId } = publish(queue)
    const worker = await consumer(queue, { FAIL: 'always' })
    expect(await deadLettered(deadLetters, 1)).toEqual([messageId])
    expect(worker.lines.filter((line) => line === `WORKING ${messageId}`)).toHaveLength(3)
    expect(await ledger(orderId)).toEqual([])
  })

  it('a message published twice, to a consumer with prefetch 10, whose work outlives lockTimeout: the duplicate waits for it and is acked with the kept result; one row', async () => {
    const { queue } = await freshQueue(QUORUM_ADVISED)
    const worker = await consumer(queue, { PREFETCH: '10', WORK_MS: String(3 * LOCK_TIMEOUT) })
    const { messageId, orderId } = publish(queue)
    await worker.line(`WORKING ${messageId}`)
    publish(queue, orderId)
    const answers = await repliesTo(messageId, 2)
    expect(answers[1]).toEqual(answers[0])
    expect(worker.lines.filter((line) => line.startsWith(`ACK ${messageId} `))).toHaveLength(2)
    expect(worker.lines.filter((line) => line.startsWith('WORKING'))).toEqual([`WORKING ${messageId}`])
    expect((await ledger(orderId)).length).toBe(1)
    await queueLeftEmpty(queue, worker)
  })

  it('docs/jobs.md shows the consumer these tests run', () => {
    expectDocumented('rabbitmq-consumer.ts')
  })
})
