/**
 * A RabbitMQ consumer (amqplib) that does each message's work once, whatever the broker
 * redelivers: docs/jobs.md#rabbitmq.
 */
import type { Channel, ConsumeMessage } from 'amqplib'
import {
  IdempotencyFingerprintMismatchError,
  IdempotencyKeyInvalidError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  type IdempotencyApi,
  type RunContext
} from '../../lib/standalone.js'

/** The work a message asks for: its body, and run's context (recovery points, the transaction). */
export type Work<T> = (body: unknown, context: RunContext) => Promise<T>

/** How long a message waits before it goes back on the queue when its work threw or the store is down. */
const RETRY_PAUSE_MS = 1000

/**
 * Consume `queue`, running `work` once per message id (the publisher's `messageId`). A message is
 * acked only once its work's result is kept; a redelivered one whose work was done is acked with
 * the kept result, and `work` does not run again. With `replyTo`, the result is sent there first.
 */
export async function consumeOnce<T> (channel: Channel, queue: string, idempotency: IdempotencyApi, work: Work<T>): Promise<string> {
  const { consumerTag } = await channel.consume(queue, (message) => {
    if (message !== null) void handle(message)
  })
  return consumerTag

  async function handle (message: ConsumeMessage): Promise<void> {
    const { messageId, replyTo, correlationId } = message.properties as { messageId?: string, replyTo?: string, correlationId?: string }
    try {
      if (messageId === undefined) throw new IdempotencyKeyInvalidError('a message needs a messageId')
      const body: unknown = JSON.parse(message.content.toString())
      const result = await idempotency.run(messageId, body, async (context) => await work(body, context), { scope: `amqp:${queue}` })
      if (replyTo !== undefined) channel.sendToQueue(replyTo, Buffer.from(JSON.stringify(result ?? null)), { correlationId })
      channel.ack(message)
    } catch (error) {
      if (error instanceof IdempotencyResultNotRecordedError) {
        // The work ran, but its result could not be kept: done, with nothing to reply.
        channel.ack(message)
      } else if (error instanceof SyntaxError || error instanceof IdempotencyKeyInvalidError || error instanceof IdempotencyFingerprintMismatchError) {
        // No delivery of this message can succeed (not JSON, no messageId, another body under its
        // id): to the queue's dead-letter exchange, if it has one.
        channel.nack(message, false, false)
      } else {
        // Running elsewhere (a delivery before this one), the store down, or the work threw: back
        // on the queue after a pause. Until then the message is unacked, so if this process dies
        // the broker redelivers it.
        const pause = error instanceof IdempotencyRequestInProgressError ? error.retryAfter * 1000 : RETRY_PAUSE_MS
        setTimeout(() => {
          try {
            channel.nack(message, false, true)
          } catch {
            // The channel closed meanwhile: the broker has put the message back already.
          }
        }, pause)
      }
    }
  }
}
