/**
 * A promise raced against a time limit: past `ms`, it rejects with `expired()`'s error, and the
 * timer is cleared either way. The promise raced is not cancelled: its own settling later is
 * ignored (its rejection is handled by the race, so it never goes unhandled).
 */
export async function withinTime<T> (promise: PromiseLike<T>, ms: number, expired: () => Error): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const late = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => { reject(expired()) }, ms)
  })
  try {
    return await Promise.race([Promise.resolve(promise), late])
  } finally {
    clearTimeout(timer)
  }
}
