/**
 * A NATS JetStream consumer that does each message's work once, whatever JetStream redelivers
 * (after its AckWait, a nak, a consumer's crash): docs/jobs.md#nats-jetstream.
 */
import type { Consumer, ConsumerMessages, JsMsg } from '@nats-io/jetstream'
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

/** How long JetStream waits before it redelivers a message whose work threw or whose store is down. */
const RETRY_PAUSE_MS = 1000

/**
 * Consume from `consumer`, running `work` once per message: the publisher's message id
 * (`msgID`, the `Nats-Msg-Id` header), or else the message's stream sequence. A message is acked
 * once its work's result is kept; a delivery that comes while another one's work is still running
 * is nak'ed, to come back when that work is likely done. `close()` the returned messages to stop.
 */
export async function consumeOnce<T> (consumer: Consumer, idempotency: IdempotencyApi, work: Work<T>): Promise<ConsumerMessages> {
  const messages = await consumer.consume()
  void (async () => {
    for await (const message of messages) void handle(message)
  })()
  return messages

  async function handle (message: JsMsg): Promise<void> {
    const { stream, consumer: name } = message.info
    const key = message.headers?.get('Nats-Msg-Id') || String(message.seq)
    try {
      const body: unknown = message.json()
      await idempotency.run(key, body, async (context) => await work(body, context), { scope: `nats:${stream}:${name}` })
      message.ack()
    } catch (error) {
      if (error instanceof IdempotencyRequestInProgressError) {
        // Another delivery's work is still running (it outlived AckWait): come back when it is likely done.
        message.nak(error.retryAfter * 1000)
      } else if (error instanceof IdempotencyResultNotRecordedError) {
        // The work ran, but its result could not be kept: done.
        message.ack()
      } else if (error instanceof SyntaxError || error instanceof IdempotencyKeyInvalidError || error instanceof IdempotencyFingerprintMismatchError) {
        // No delivery of this message can succeed (not JSON, an unusable id, another body under its id).
        message.term(String(error))
      } else {
        // The store is down, or the work threw: JetStream redelivers after a pause.
        message.nak(RETRY_PAUSE_MS)
      }
    }
  }
}
