/**
 * Trailers (`reply.trailer(name, fn)`): kept with the response and replayed.
 *
 * Fastify computes a trailer's value after the body is written (a checksum of what was sent, say),
 * and ends the response once every trailer function has answered. So a response with trailers is
 * settled when they have: each function is wrapped, its value taken as Fastify gets it, and the
 * values are handed to Fastify only once the response is stored with them; the client sees the
 * end of the response after the store is up to date, as for a stream. A response that closes before
 * its trailers were asked for (its client left mid-stream) is settled with those it has.
 *
 * The values are kept among the stored headers under `:trailer:<name>`: a name no header can have
 * (a colon starts only HTTP/2's pseudo-headers, never stored as headers), which every store keeps
 * as it keeps the headers, with no change to its layout.
 * Fastify has no public way to list a reply's trailers: they are its `fastify.reply.trailers` field.
 */
import type { FastifyReply } from 'fastify'
import type { StoredResponse } from '../storage/types.js'

/** The prefix of a trailer's entry among the stored headers. */
export const TRAILER_PREFIX = ':trailer:'

/** A trailer function as Fastify calls it: a value through `done`, or a promise of one. */
type TrailerFunction = (reply: FastifyReply, payload: unknown, done: (error: Error | null, value?: unknown) => void) => unknown

type Trailers = Record<string, TrailerFunction | undefined>

/** Fastify's symbol for a reply's trailers, found once (per copy of Fastify loaded). */
let kTrailers: symbol | undefined

function trailersField (reply: FastifyReply): symbol | undefined {
  if (kTrailers !== undefined && Object.hasOwn(reply, kTrailers)) return kTrailers
  kTrailers = Object.getOwnPropertySymbols(reply).find((symbol) => symbol.description === 'fastify.reply.trailers')
  return kTrailers
}

/** The reply's trailers, when it has at least one trailer function; otherwise `null`. */
export function replyTrailers (reply: FastifyReply): Trailers | null {
  const field = trailersField(reply)
  const trailers = field === undefined ? null : (reply as unknown as Record<symbol, Trailers | null>)[field]
  if (trailers === null || trailers === undefined) return null
  for (const name in trailers) if (typeof trailers[name] === 'function') return trailers
  return null
}

/** What `collectTrailers` gives: the values once known, and the gate that holds them back from Fastify. */
export interface CollectedTrailers {
  /** Resolves with the trailers' values (names lower-case) once every function answered, or once the response closed. */
  readonly values: Promise<Record<string, string>>
  /** Hand the values on to Fastify (which then ends the response) only once `settled` has settled. */
  holdUntil: (settled: Promise<unknown>) => void
  /** Settle with the values known now: the response will not ask for the others (its client left, and an onSend hook failed). */
  abandon: () => void
}

/** Wrap the reply's trailer functions so that their values are taken, and held until the response is settled. */
export function collectTrailers (reply: FastifyReply, trailers: Trailers): CollectedTrailers {
  const values: Record<string, string> = {}
  const releases: Array<() => void> = []
  let gate: Promise<unknown> = Promise.resolve()
  let resolveValues!: (values: Record<string, string>) => void
  const collected = new Promise<Record<string, string>>((resolve) => { resolveValues = resolve })
  let waiting = 0
  const release = (): void => { for (const next of releases.splice(0)) next() }
  const answered = (): void => {
    if (--waiting > 0) return
    resolveValues(values)
    gate.then(release, release)
  }
  // Fastify calls every trailer function in one loop. One of ours it did not call by the end of
  // that loop was replaced or taken away after this plugin's onSend (by a later hook): none of its
  // answer is waited for.
  const wrapped = new Set<string>()
  const asked = new Set<string>()
  const loopEnded = (): void => {
    for (const name of wrapped) if (!asked.has(name)) answered()
  }
  for (const name of Object.keys(trailers)) {
    const original = trailers[name]
    if (typeof original !== 'function') continue
    waiting++
    wrapped.add(name)
    trailers[name] = (current, payload, done) => {
      if (asked.size === 0) process.nextTick(loopEnded)
      asked.add(name)
      let called = false
      const answer = (error: Error | null, value?: unknown): void => {
        if (called) return
        called = true
        // As Fastify sends it: a value whose function did not fail, as text ('undefined' included).
        if (error === null || error === undefined) values[name] = String(value)
        releases.push(() => { done(error, value) })
        answered()
      }
      let result: unknown
      try {
        result = original(current, payload, answer)
      } catch (error) {
        // Without the plugin, the throw leaves the response unended and Fastify cuts it: so here,
        // where it would not reach Fastify (the plugin hands its payload on). The handler answered:
        // the response is kept with the trailers that were answered.
        current.log.error({ err: error }, `fastify-idempotency: the function of trailer ${name} threw: the response is cut`)
        if (!called) {
          called = true
          answered()
        }
        current.raw.destroy(error as Error)
        return
      }
      if (typeof result === 'object' && result !== null && typeof (result as Promise<unknown>).then === 'function') {
        (result as Promise<unknown>).then((value) => { answer(null, value) }, (error: Error) => { answer(error) })
      }
    }
  }
  // Fastify asks for no trailer of a response that closed first (its client left mid-stream).
  reply.raw.once('close', () => { resolveValues(values) })
  return { values: collected, holdUntil: (settled) => { gate = settled }, abandon: () => { resolveValues(values) } }
}

/** `response` with `values` among its headers (see above). */
export function withTrailers (response: StoredResponse, values: Record<string, string>): StoredResponse {
  const names = Object.keys(values)
  if (names.length === 0) return response
  const headers = { ...response.headers }
  for (const name of names) headers[TRAILER_PREFIX + name] = values[name]!
  return { ...response, headers }
}
