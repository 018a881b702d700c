/**
 * `instanceof` on the errors that cross the package's entry points holds for instances of another
 * copy of their class (another bundle, the other module format, another version), and tells the
 * kinds apart as a native check does.
 */
import { describe, expect, it, vi } from 'vitest'
import * as errors from '../lib/errors.js'
import * as causes from '../lib/error-causes.js'
import { UnreadableEntryError } from '../lib/storage/unreadable-entry.js'
import { IdempotencyOperationNotSupportedError } from '../lib/operations/index.js'
import { shareIdentity } from '../lib/storage/error-identity.js'

/** The same modules evaluated again: what a second bundle of the package holds. */
async function secondCopy () {
  vi.resetModules()
  const copy = {
    errors: await import('../lib/errors.js'),
    causes: await import('../lib/error-causes.js'),
    unreadable: await import('../lib/storage/unreadable-entry.js'),
    operations: await import('../lib/operations/index.js')
  }
  vi.resetModules()
  return copy
}

describe('error identity across copies of the package', () => {
  it('recognizes an instance of another copy of each class, and only of that class and its bases', async () => {
    const copy = await secondCopy()
    expect(copy.unreadable.UnreadableEntryError).not.toBe(UnreadableEntryError)
    const theirs = new copy.unreadable.UnreadableEntryError('damaged')
    expect(theirs instanceof UnreadableEntryError).toBe(true)
    expect(causes.isUnreadableEntryError(theirs)).toBe(true)
    expect(causes.isStoreContentionError(theirs)).toBe(false)
    expect(new copy.causes.StoreContentionError('busy') instanceof causes.StoreContentionError).toBe(true)
    expect(new copy.causes.StoreTimeoutError('begin', 5) instanceof causes.StoreTimeoutError).toBe(true)
    expect(new copy.causes.BodyTooLargeError(5) instanceof causes.BodyTooLargeError).toBe(true)
    expect(new copy.causes.BodyNestedTooDeeplyError() instanceof causes.BodyNestedTooDeeplyError).toBe(true)
    expect(new copy.operations.IdempotencyOperationNotSupportedError('purge', 'S', 'purgeExpired') instanceof IdempotencyOperationNotSupportedError).toBe(true)

    const mismatch = new copy.errors.IdempotencyFingerprintMismatchError('k')
    expect(mismatch instanceof errors.IdempotencyFingerprintMismatchError).toBe(true)
    expect(mismatch instanceof errors.IdempotencyError).toBe(true)
    expect(errors.isIdempotencyError(mismatch)).toBe(true)
    expect(mismatch instanceof errors.IdempotencyKeyMissingError).toBe(false)
    expect(mismatch instanceof UnreadableEntryError).toBe(false)
    expect(new Error('plain') instanceof errors.IdempotencyError).toBe(false)
    expect((null as unknown as object) instanceof errors.IdempotencyError).toBe(false)
  })

  it('gives every error class of the public API an identity of its own', () => {
    type ErrorClass = (abstract new (...args: never[]) => Error) & { name: string }
    const exported: unknown[] = [...Object.values(errors), ...Object.values(causes), UnreadableEntryError, IdempotencyOperationNotSupportedError]
    const classes = exported.filter((value): value is ErrorClass => typeof value === 'function' && value.prototype instanceof Error)
    expect(classes.length).toBeGreaterThan(15)
    const brands = classes.map((errorClass) => Object.getOwnPropertySymbols(errorClass.prototype).map(String))
    for (const [index, errorClass] of classes.entries()) {
      expect(Object.hasOwn(errorClass, Symbol.hasInstance) || Object.hasOwn(Object.getPrototypeOf(errorClass), Symbol.hasInstance), errorClass.name).toBe(true)
      expect(brands[index], errorClass.name).toEqual([`Symbol(fastify-idempotency.${errorClass.name})`])
    }
  })

  it('checks a subclass without an identity of its own natively', () => {
    class Base extends Error {}
    shareIdentity(Base, 'test.Base')
    class Unbranded extends Base {}
    expect(new Unbranded() instanceof Base).toBe(true)
    expect(new Base() instanceof Unbranded).toBe(false)
    expect(new Unbranded() instanceof Unbranded).toBe(true)
  })
})
