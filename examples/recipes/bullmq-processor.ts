/**
 * A BullMQ processor that does each job's work once, whatever BullMQ retries (a stalled job whose
 * worker died, a failed attempt): docs/jobs.md#bullmq.
 */
import { DelayedError, UnrecoverableError, type Job, type Processor } from 'bullmq'
import {
  IdempotencyFingerprintMismatchError,
  IdempotencyKeyInvalidError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  type IdempotencyApi,
  type RunContext
} from '../../lib/standalone.js'

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
      if (error instanceof IdempotencyRequestInProgressError) {
        // The job's work is still running elsewhere (its worker stalled and BullMQ handed the job
        // on): come back when it is likely done, without spending an attempt.
        await job.moveToDelayed(Date.now() + error.retryAfter * 1000, token)
        throw new DelayedError()
      }
      // The work ran, but its result could not be kept: the job is done, with no return value.
      if (error instanceof IdempotencyResultNotRecordedError) return undefined
      // No attempt can succeed: another job's data under this id, or an unusable id.
      if (error instanceof IdempotencyFingerprintMismatchError || error instanceof IdempotencyKeyInvalidError) throw new UnrecoverableError(error.message)
      // The store is down, or the work threw: BullMQ's attempts and backoff decide.
      throw error
    }
  }
}
