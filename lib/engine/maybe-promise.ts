/**
 * A value now, or later. The engine answers at once what it can answer at once: a request on a
 * store that answers synchronously (MemoryStorage) makes no promise of its own from its first
 * store call to its end, and each promise it does not make is one allocation, one microtask and
 * one resumption fewer on every request. Where something must wait (a store over the network, a
 * callback that returns a promise, a transaction), the same code goes on in the promise.
 */
export type MaybePromise<T> = T | Promise<T>

export function isPromise<T> (value: MaybePromise<T>): value is Promise<T> {
  return value instanceof Promise
}
