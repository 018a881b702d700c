/**
 * A BullMQ processor that does each job's work once, whatever BullMQ retries (a stalled job whose
 * worker died, a failed attempt): docs/jobs.md#bullmq.
 */
import { DelayedError, UnrecoverableError, type Job, type Processor } from 'bullmq'
import { retryDecision, type IdempotencyApi, type RunContext } from '../../lib/standalone.js'

/** A job's work: the job, and run's context (recovery points, the transaction). */
export type Work<T> = (job: Job, context: RunContext) => Promise<T>

/**
 * A processor for `new Worker(queue, processOnce(idempotency, work), options)` that runs `work`
 * once per job id, and completes the job with its kept result: a job BullMQ hands out again
 * after its worker died gets the kept result, or resumes after its last recovery point.
 */
export function processOnce<T> (idempotency: IdempotencyApi, work: Work<T>): Processor<unknown, T | undefined> {
  return async (job, token) => {
    try {
      return await idempotency.run(String(job.id), job.data, async (context) => await work(job, context), { scope: `bullmq:${job.queueName}` })
    } catch (error) {
      const decision = retryDecision(error)
      switch (decision.kind) {
        case 'retry':
        case 'release':
          // The job's work holds its key elsewhere (its worker stalled, or died and its lease has
          // not lapsed yet), the store is down, or this worker is closing: delayed, which spends
          // none of its attempts, until the key's holder is done or its lease lapsed.
          await job.moveToDelayed(Date.now() + (decision.kind === 'retry' ? decision.delayMs : 0), token)
          throw new DelayedError()
        case 'done':
          // The work ran, but its result is not to be had: the job is done, with no return value.
          return undefined
        case 'give-up':
          // No attempt can succeed: another job's data under this id, an unusable id.
          throw new UnrecoverableError(decision.why)
        case 'failed':
          // The work threw: BullMQ's attempts and backoff decide.
          throw decision.error
      }
    }
  }
}
