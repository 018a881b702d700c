/**
 * Closing the app. Fastify runs `preClose` hooks first, then stops the server (closing every
 * connection at once with `forceCloseConnections: true`, or none of a client that already left),
 * then the `onClose` hooks, where applications close their store's client (`redis.quit()`,
 * `knex.destroy()`), in an order the plugin cannot choose. So the plugin waits in `preClose`: its
 * requests in flight settle (their response stored, or their key given back) while the store is
 * still open and their clients still connected, for at most `closeTimeout`.
 */
import type { FastifyInstance } from 'fastify'
import { reportStillInFlight, type InFlight } from '../engine/in-flight.js'
import { toMilliseconds } from '../options.js'

export function waitForRequestsOnClose (fastify: FastifyInstance, inFlight: InFlight, closeTimeout: number): void {
  fastify.addHook('preClose', async function () {
    if (inFlight.size > 0) {
      this.log.info(`fastify-idempotency: closing: waiting up to ${closeTimeout} ms (closeTimeout) for ${inFlight.size} guarded request(s) in flight to store their response`)
    }
    for (const [state, reporter] of await inFlight.drain(closeTimeout)) reportStillInFlight(state, reporter)
  })
}

const DEFAULT_CLOSE_TIMEOUT = 5000
/** The longest delay a Node.js timer takes; a longer one fires at once. */
const MAX_TIMER_MS = 2_147_483_647

/**
 * The `closeTimeout` option in ms, checked at register time as every option is (its JSON Schema
 * is in options.ts). Fastify fails a preClose hook that runs past its `pluginTimeout` (`0`:
 * never), and the close with it, so the wait must end before that: at most 90 % of it. The
 * default is 5 s, or that limit when it is shorter.
 */
export function closeTimeoutOption (option: number | string | undefined, pluginTimeout: number): number {
  const context = 'options'
  const limit = pluginTimeout > 0 ? Math.floor(pluginTimeout * 0.9) : MAX_TIMER_MS
  if (option === undefined) return Math.max(1, Math.min(DEFAULT_CLOSE_TIMEOUT, limit))
  const ms = toMilliseconds(option, 'closeTimeout', context)
  if (ms > MAX_TIMER_MS) throw new TypeError(`fastify-idempotency: invalid ${context}: closeTimeout must be at most ${MAX_TIMER_MS} ms, about 24 days (got ${ms} ms)`)
  if (ms > limit) {
    throw new TypeError(`fastify-idempotency: invalid ${context}: closeTimeout (${ms} ms) must be at most 90 % of Fastify's pluginTimeout (${pluginTimeout} ms), which fails a close hook that runs longer: raise it with Fastify({ pluginTimeout })`)
  }
  return ms
}
