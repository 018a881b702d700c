import { setTimeout as sleep } from 'node:timers/promises'

/** An answer from `app.inject` (`statusCode`) or from `fetch` and the test clients (`status`). */
type Answer = { statusCode: number } | { status: number }

export interface ResendOptions<A> {
  /** How many times at most it is sent again. Default 100. */
  attempts?: number
  /** Milliseconds between one answer and the next send. Default 50. */
  pause?: number
  /** Called with each answer that is resent for, before the pause (to assert what it says). */
  onRefused?: (answer: A) => void
}

const statusOf = (answer: Answer): number => 'statusCode' in answer ? answer.statusCode : answer.status

/**
 * Sends, and sends again while the answer's status is one of `statuses`, as a client retries a
 * 409 in progress or a 503 until the first request's outcome is stored or the store is back.
 * Returns the first answer with another status, or the last one when the attempts run out (the
 * test's assertions then say what was wrong).
 */
export async function resendWhile<A extends Answer> (statuses: readonly number[], send: () => Promise<A>, options: ResendOptions<A> = {}): Promise<A> {
  const { attempts = 100, pause = 50, onRefused } = options
  let answer = await send()
  for (let attempt = 0; attempt < attempts && statuses.includes(statusOf(answer)); attempt++) {
    onRefused?.(answer)
    if (pause > 0) await sleep(pause)
    answer = await send()
  }
  return answer
}
