/**
 * A Standard Webhooks receiver whose every event is handled once, however often the provider sends
 * it: docs/jobs.md#webhooks.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { Webhook, WebhookVerificationError } from 'standardwebhooks'
import type { IdempotencyRouteOptions } from '../../lib/index.js'

/** Handles one verified event; what it returns is the answer, kept for the provider's retries. */
export type EventHandler = (event: unknown, request: FastifyRequest, reply: FastifyReply) => Promise<unknown>

export interface ReceiverOptions {
  /** The endpoint's signing secret, as the provider gives it (`whsec_...`). */
  secret: string
  /** More of the route's idempotency options: `transaction: true`, `expiration`... */
  idempotency?: Omit<IdempotencyRouteOptions, 'key' | 'required' | 'scope'>
}

/** The bytes each delivery came with, as text: what its signature is over. */
const rawBodies = new WeakMap<FastifyRequest, string>()

/**
 * `POST url` on `app`. A delivery is verified first: its signature over the raw body, and its
 * timestamp within five minutes; a forged, altered or stale one is refused with 401 before its key
 * is read, so nothing is stored for it. A genuine one is handled by `handle` once per event id
 * (`webhook-id`), and the provider's retries get the kept answer. Event ids are scoped to the
 * route, so no client's `Idempotency-Key` on another route can take one.
 */
export async function webhookReceiver (app: FastifyInstance, url: string, options: ReceiverOptions, handle: EventHandler): Promise<void> {
  const webhook = new Webhook(options.secret)
  await app.register(async (receiver) => {
    receiver.addContentTypeParser('application/json', { parseAs: 'string' }, (request, body, done) => {
      rawBodies.set(request, body as string)
      try {
        done(null, JSON.parse(body as string))
      } catch {
        done(Object.assign(new Error('the body is not JSON'), { statusCode: 400 }))
      }
    })
    receiver.post(url, {
      preHandler: async (request) => {
        try {
          webhook.verify(rawBodies.get(request) ?? '', request.headers as Record<string, string>)
        } catch (error) {
          if (error instanceof WebhookVerificationError) throw Object.assign(new Error(`webhook refused: ${error.message}`), { statusCode: 401 })
          throw error
        }
      },
      config: {
        idempotency: {
          ...options.idempotency,
          required: true,
          key: (request) => request.headers['webhook-id'] as string | undefined,
          scope: () => `webhook:${url}`
        }
      }
    }, async (request, reply) => await handle(request.body, request, reply))
  })
}
