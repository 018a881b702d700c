/** The checks of options that JSON Schema cannot make: durations that parse, functions, stores. */
import { parse as parseDuration } from '@lukeed/ms'
import { storeNameOf, type IdempotencyStorage, type TransactionalStorage } from '../storage/types.js'
import { invalid } from './schema.js'

/** A duration option in milliseconds; `zero` when 0 has a meaning of its own (`olderThan: 0`: all). */
export function toMilliseconds (value: number | string, name: string, context: string, zero = false): number {
  // @lukeed/ms reads no zero ('0', '0s'): where zero means something, it is read here.
  const ms = typeof value === 'number' ? value : zero && /^0+(?:\.0*)?\s*[a-z]*$/i.test(value.trim()) ? 0 : parseDuration(value)
  if (ms === undefined || !Number.isFinite(ms) || ms < (zero ? 0 : 1)) {
    throw invalid(context, `${name} must be a ${zero ? 'non-negative' : 'positive'} number of milliseconds or a duration such as '24h' (got ${JSON.stringify(value)})`)
  }
  return Math.round(ms)
}

export function checkFunction (value: unknown, name: string, context: string): void {
  if (value !== undefined && typeof value !== 'function') throw invalid(context, `${name} must be a function of the request`)
}

export function checkStorage (storage: unknown): void {
  const methods = ['begin', 'complete', 'release', 'renew'] as const
  const missing = storage === null || typeof storage !== 'object'
    ? methods
    : methods.filter((name) => typeof (storage as Record<string, unknown>)[name] !== 'function')
  if (missing.length > 0) {
    throw invalid('options', `storage must implement IdempotencyStorage (missing ${missing.join(', ')})`)
  }
}

export function checkTransaction (transaction: boolean, storage: IdempotencyStorage, context: string): boolean {
  if (transaction && typeof (storage as Partial<TransactionalStorage>).transaction !== 'function') {
    throw invalid(context, `transaction mode needs a storage that supports transactions (KnexStorage), not ${storeNameOf(storage)}`)
  }
  return transaction
}
