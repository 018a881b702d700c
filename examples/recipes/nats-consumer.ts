/**
 * A NATS JetStream consumer that does each message's work once, whatever JetStream redelivers
 * (after its AckWait, a nak, a consumer's crash): docs/jobs.md#nats-jetstream.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { Consumer, ConsumerMessages, JsMsg } from '@nats-io/jetstream'
import { retryDecision, type IdempotencyApi, type RunContext } from '../../lib/standalone.js'

/** The work a message asks for: its body, and run's context (recovery points, the transaction). */
export type Work<T> = (body: unknown, context: RunContext) => Promise<T>

/** How long JetStream waits before it redelivers a message whose work failed. */
const FAILED_PAUSE_MS = 1000

/**
 * Consume from `consumer`, running `work` once per message: the publisher's message id
 * (`msgID`, the `Nats-Msg-Id` header), or else the message's stream sequence. A message is acked
 * once its work's result is kept; while it is in hand (its work runs, or it waits for another
 * delivery's), JetStream is told so before each AckWait ends, and does not deliver it again.
 * A message that no delivery can succeed with is terminated. `close()` the returned messages to stop.
 */
export async function consumeOnce<T> (consumer: Consumer, idempotency: IdempotencyApi, work: Work<T>): Promise<ConsumerMessages> {
  // The consumer's AckWait (nanoseconds; 30 s unless set): a delivery in hand says so twice within it.
  const ackWaitMs = ((await consumer.info(true)).config.ack_wait ?? 30e9) / 1e6
  const messages = await consumer.consume()
  void (async () => {
    for await (const message of messages) void handle(message)
  })()
  return messages

  async function handle (message: JsMsg): Promise<void> {
    const inHand = setInterval(() => { message.working() }, ackWaitMs / 2)
    try {
      await decide(message)
    } finally {
      clearInterval(inHand)
    }
  }

  async function decide (message: JsMsg): Promise<void> {
    const { stream, consumer: name } = message.info
    const key = message.headers?.get('Nats-Msg-Id') || String(message.seq)
    let body: unknown
    try {
      body = message.json()
    } catch {
      // Poison, before anything runs: not JSON. A plain term(): servers before 2.10 ignore a
      // term with a reason, and would deliver it again at every AckWait.
      message.term()
      return
    }
    for (;;) {
      try {
        // A delivery while another's work runs waits for it (wait: true) and gets its result.
        await idempotency.run(key, body, async (context) => await work(body, context), { scope: `nats:${stream}:${name}`, wait: true })
        message.ack()
        return
      } catch (error) {
        const decision = retryDecision(error)
        switch (decision.kind) {
          case 'retry':
            // Another delivery's work still holds the key after waitTimeout (done by then, or its
            // holder died and its lease lapsed), or the store is down: wait here, in hand, which
            // spends none of max_deliver.
            await sleep(decision.delayMs)
            continue
          case 'done':
            message.ack()
            return
          case 'give-up':
            // Another body under its id: terminated, never delivered again.
            message.term()
            return
          case 'release':
            // This process is closing: back at once, for another consumer.
            message.nak()
            return
          case 'failed':
            // The work threw: redelivered after a pause, as long as max_deliver allows.
            message.nak(FAILED_PAUSE_MS)
            return
        }
      }
    }
  }
}
