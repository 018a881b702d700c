/**
 * A scheduled job that every instance of an app fires on the same schedule, done once for each
 * time it is due: docs/jobs.md#scheduled-jobs.
 */
import { retryDecision, type IdempotencyApi, type RunContext } from '../../lib/standalone.js'

/** What one instance's tick came to. */
export type Tick<T> =
  /** This instance ran the job. */
  | { ran: 'here', result: T }
  /** An instance ran it already: its kept result. */
  | { ran: 'before', result: T }
  /** Another instance is running it now: this one skips. */
  | { ran: 'elsewhere' }

/**
 * The time a tick is for: `now` rounded to the nearest multiple of `periodMs`, so that instances
 * whose clocks and timers disagree by less than half a period name the same run.
 */
export function dueAt (periodMs: number, now = Date.now()): Date {
  return new Date(Math.round(now / periodMs) * periodMs)
}

/**
 * Run `job` for the run of `name` due at `due`, unless an instance did or does: call it from every
 * instance's timer. Pass `fastify.idempotency` (or `createIdempotency`'s) on the store they share.
 */
export async function runScheduled<T> (idempotency: IdempotencyApi, name: string, due: Date, job: (context: RunContext) => Promise<T>): Promise<Tick<T>> {
  let ranHere = false
  try {
    const result = await idempotency.run(`${name}@${due.toISOString()}`, null, async (context) => {
      ranHere = true
      return await job(context)
    }, { scope: 'schedule' })
    return ranHere ? { ran: 'here', result } : { ran: 'before', result }
  } catch (error) {
    const decision = retryDecision(error)
    if (decision.kind === 'retry' && decision.reason === 'in-progress') return { ran: 'elsewhere' }
    throw error
  }
}
