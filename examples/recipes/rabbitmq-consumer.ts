/**
 * A RabbitMQ consumer (amqplib) that does each message's work once, whatever the broker
 * redelivers: docs/jobs.md#rabbitmq.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { Channel, ConsumeMessage } from 'amqplib'
import { retryDecision, type IdempotencyApi, type RunContext } from '../../lib/standalone.js'

/** The work a message asks for: its body, and run's context (recovery points, the transaction). */
export type Work<T> = (body: unknown, context: RunContext) => Promise<T>

/** How long a message whose work failed waits before it goes back on the queue. */
const FAILED_PAUSE_MS = 1000

/**
 * Consume `queue`, running `work` once per message id (the publisher's `messageId`). A message is
 * acked only once its work's result is kept; a redelivered one whose work was done is acked with
 * the kept result, and `work` does not run again. With `replyTo`, the result is sent there first.
 * A message that no delivery can succeed with is rejected to the queue's dead-letter exchange.
 */
export async function consumeOnce<T> (channel: Channel, queue: string, idempotency: IdempotencyApi, work: Work<T>): Promise<string> {
  const { consumerTag } = await channel.consume(queue, (message) => {
    if (message !== null) void handle(message)
  })
  return consumerTag

  /** Ack, reject or nack: a channel closed meanwhile has put the message back already. */
  function settle (act: () => void): void {
    try {
      act()
    } catch {}
  }

  async function handle (message: ConsumeMessage): Promise<void> {
    const { messageId, replyTo, correlationId } = message.properties as { messageId?: string, replyTo?: string, correlationId?: string }
    let body: unknown
    try {
      body = JSON.parse(message.content.toString())
    } catch {
      // Poison, before anything runs: not JSON. To the dead-letter exchange.
      settle(() => { channel.reject(message, false) })
      return
    }
    for (;;) {
      try {
        // A message without a messageId is refused as a key that cannot be used (give-up). A
        // duplicate waits for the delivery whose work runs (wait: true) and gets its result.
        const result = await idempotency.run(messageId as string, body, async (context) => await work(body, context), { scope: `amqp:${queue}`, wait: true })
        if (replyTo !== undefined) channel.sendToQueue(replyTo, Buffer.from(JSON.stringify(result ?? null)), { correlationId })
        settle(() => { channel.ack(message) })
        return
      } catch (error) {
        const decision = retryDecision(error)
        switch (decision.kind) {
          case 'retry':
            // Another delivery's work still holds the key after waitTimeout (done by then, or its
            // holder died and its lease lapsed), or the store is down. The message waits here,
            // unacked: that spends none of its deliveries, and if this process dies the broker
            // hands it on.
            await sleep(decision.delayMs)
            continue
          case 'done':
            // The work ran, but its result is not to be had: acked, with nothing to reply.
            settle(() => { channel.ack(message) })
            return
          case 'give-up':
            // Another body under its messageId, no usable messageId: to the dead-letter exchange.
            settle(() => { channel.reject(message, false) })
            return
          case 'release':
            // This process is closing: back on the queue at once, for another consumer.
            settle(() => { channel.nack(message, false, true) })
            return
          case 'failed':
            // The work threw: back on the queue after a pause. `reject` counts the delivery against
            // a quorum queue's x-delivery-limit (RabbitMQ 4.3 counts no nack).
            await sleep(FAILED_PAUSE_MS)
            settle(() => { channel.reject(message, true) })
            return
        }
      }
    }
  }
}
