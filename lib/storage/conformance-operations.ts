/**
 * The conformance tests of the optional operations methods (`inspect`, `forget`, `listInFlight`).
 * A store's suite runs those its `operations` option lists; the others are reported as skipped,
 * with the reason, rather than passing without testing anything.
 */
import assert from 'node:assert/strict'
import type { BeginResult, IdempotencyStorage, StoredResponse, StoredState } from './types.js'

/** The optional methods the conformance suite can test. */
export type ConformanceOperation = 'inspect' | 'forget' | 'listInFlight'

type TestFn = () => Promise<void> | void
type Register = (name: string, fn: TestFn, timeout?: number) => void

/** What the operations tests share with the rest of the suite. */
export interface OperationsContext {
  it: Register & { skip?: Register }
  store: () => IdempotencyStorage
  offered: readonly ConformanceOperation[]
  freshKey: (label: string) => string
  sampleResponse: (overrides?: Partial<StoredResponse>) => StoredResponse
  expectAcquired: (result: BeginResult) => string
  expectCompleted: (result: BeginResult | StoredState, fingerprint: string, response: StoredResponse) => void
  lapse: () => Promise<void>
  shortTtl: number
  hostileKeys: readonly string[]
  lease: number
  expiry: number
}

/** Within a second of `expected`: clocks of the store's server and of this process may differ a little. */
function near (actual: number | null, expected: number, what: string): void {
  assert.ok(actual !== null && Math.abs(actual - expected) < 1000, `${what}: ${String(actual)}, expected about ${expected}`)
}

/** `null` (the store does not know), or within a second of the span the event happened in. */
function unknownOrWithin (actual: number | null, from: number, to: number, what: string): void {
  if (actual === null) return
  assert.ok(actual >= from - 1000 && actual <= to + 1000, `${what}: ${actual}, expected between ${from} and ${to}`)
}

export function operationsConformance (context: OperationsContext): void {
  const { store, freshKey, sampleResponse, expectAcquired, expectCompleted, lease: LEASE, expiry: EXPIRY } = context
  /** Register `fn` when the store offers `operation`, or report it skipped with the reason. */
  const test = (operation: ConformanceOperation, name: string, fn: TestFn): void => {
    const title = `${operation}: ${name}`
    if (context.offered.includes(operation)) context.it(title, fn)
    else context.it.skip?.(`${title} [skipped: the store does not offer ${operation}, or its conformance options do not list it in operations]`, fn)
  }
  const inspect = async (key: string) => await store().inspect!(key)
  const forget = async (key: string, force = false, relatedPrefix = `${key}\u0000related:`) => await store().forget!(key, { force, relatedPrefix })
  const listed = async (limit = 10_000) => await store().listInFlight!({ limit })

  test('inspect', 'reports a key never used as absent, and takes no lease', async () => {
    const key = freshKey('inspect-absent')
    assert.deepEqual(await inspect(key), { state: 'absent' })
    expectAcquired(await store().begin(key, 'fp', LEASE))
  })

  test('inspect', 'reports a held key in flight, with the holder\'s fingerprint, lease end and start, and leaves it held', async () => {
    const key = freshKey('inspect-held')
    const before = Date.now()
    const token = expectAcquired(await store().begin(key, 'fp-holder', LEASE))
    const after = Date.now()
    const found = await inspect(key)
    assert.ok(found.state === 'in-flight', `expected in-flight, got ${found.state}`)
    assert.equal(found.fingerprint, 'fp-holder')
    near(found.lockExpiresAt, before + LEASE, 'lease end')
    unknownOrWithin(found.since, before, after, 'lease start')
    assert.equal(await store().complete(key, token, sampleResponse(), EXPIRY), true, 'inspect must leave the lease with its holder')
  })

  test('inspect', 'reports a stored response byte for byte, with when it was stored and when it expires', async () => {
    for (const response of [sampleResponse(), sampleResponse({ statusCode: 200, body: Buffer.alloc(0), bodyOmitted: true })]) {
      const key = freshKey('inspect-stored')
      const token = expectAcquired(await store().begin(key, 'fp-stored', LEASE))
      const before = Date.now()
      assert.equal(await store().complete(key, token, response, EXPIRY), true)
      const after = Date.now()
      const found = await inspect(key)
      expectCompleted(found, 'fp-stored', response)
      assert.ok(found.state === 'completed')
      near(found.expiresAt, before + EXPIRY, 'expiry')
      unknownOrWithin(found.storedAt, before, after, 'stored at')
    }
  })

  test('inspect', 'reports released keys, lapsed leases and expired responses as absent', async () => {
    const released = freshKey('inspect-released')
    assert.equal(await store().release(released, expectAcquired(await store().begin(released, 'fp', LEASE))), true)
    const lapsed = freshKey('inspect-lapsed')
    expectAcquired(await store().begin(lapsed, 'fp', context.shortTtl))
    const expired = freshKey('inspect-expired')
    assert.equal(await store().complete(expired, expectAcquired(await store().begin(expired, 'fp', LEASE)), sampleResponse(), context.shortTtl), true)
    await context.lapse()
    for (const key of [released, lapsed, expired]) assert.equal((await inspect(key)).state, 'absent', key)
  })

  test('forget', 'removes a stored response, so that the next begin takes the lease', async () => {
    const key = freshKey('forget-stored')
    assert.equal(await store().complete(key, expectAcquired(await store().begin(key, 'fp', LEASE)), sampleResponse(), EXPIRY), true)
    assert.deepEqual(await forget(key), { outcome: 'forgotten', previous: 'completed', related: 0 })
    expectAcquired(await store().begin(key, 'fp-new', LEASE))
  })

  test('forget', 'reports a key that holds nothing as absent', async () => {
    assert.deepEqual(await forget(freshKey('forget-absent')), { outcome: 'forgotten', previous: 'absent', related: 0 })
  })

  test('forget', 'refuses a key in flight, changing nothing, unless forced: then its holder is fenced off', async () => {
    const key = freshKey('forget-held')
    const related = `${key}\u0000related:kept`
    assert.equal(await store().complete(related, expectAcquired(await store().begin(related, 'fp', LEASE)), sampleResponse(), EXPIRY), true)
    const before = Date.now()
    const token = expectAcquired(await store().begin(key, 'fp', LEASE))
    const refused = await forget(key)
    assert.ok(refused.outcome === 'refused', `expected refused, got ${JSON.stringify(refused)}`)
    near(refused.lockExpiresAt, before + LEASE, 'lease end')
    assert.equal(await store().renew(key, token, LEASE), true, 'a refused forget must leave the lease held')
    expectCompleted(await store().begin(related, 'fp', LEASE), 'fp', sampleResponse())
    assert.deepEqual(await forget(key, true), { outcome: 'forgotten', previous: 'in-flight', related: 1 })
    assert.equal(await store().complete(key, token, sampleResponse(), EXPIRY), false, 'a forgotten lease must fence its holder off')
    expectAcquired(await store().begin(key, 'fp', LEASE))
  })

  test('forget', 'removes every key under the related prefix, held or stored, and no other', async () => {
    for (const hostile of ['plain', ...context.hostileKeys.filter((key) => key.length <= 64)]) {
      const key = freshKey('forget-related')
      const prefix = `${freshKey('related')}${hostile}\u0000`
      const related = [`${prefix}held`, `${prefix}stored`, `${prefix}|${hostile}`]
      // Just before the prefix, and just past it, byte for byte; containing it; a glob of it.
      const others = [prefix.slice(0, -1), `${prefix.slice(0, -1)}\u0001a`, `x${prefix}a`, `${prefix.slice(0, -1)}*`]
      for (const name of [...related.slice(1), ...others]) {
        assert.equal(await store().complete(name, expectAcquired(await store().begin(name, 'fp', LEASE)), sampleResponse(), EXPIRY), true)
      }
      expectAcquired(await store().begin(related[0]!, 'fp', LEASE))
      assert.deepEqual(await forget(key, false, prefix), { outcome: 'forgotten', previous: 'absent', related: related.length }, JSON.stringify(prefix))
      for (const name of related) expectAcquired(await store().begin(name, 'fp', LEASE))
      for (const name of others) expectCompleted(await store().begin(name, 'fp', LEASE), 'fp', sampleResponse())
    }
  })

  test('listInFlight', 'lists every held key exactly as it was given, and drops it once completed, released or lapsed', async () => {
    const prefix = freshKey('list')
    const held = ['plain', ...context.hostileKeys].map((hostile) => `${prefix}|${hostile}`)
    const before = Date.now()
    const tokens = new Map<string, string>()
    for (const [i, key] of held.entries()) tokens.set(key, expectAcquired(await store().begin(key, `fp-${i}`, LEASE)))
    const lapsing = `${prefix}|lapsing`
    expectAcquired(await store().begin(lapsing, 'fp', context.shortTtl))
    const stored = `${prefix}|stored`
    assert.equal(await store().complete(stored, expectAcquired(await store().begin(stored, 'fp', LEASE)), sampleResponse(), EXPIRY), true)
    const after = Date.now()
    await context.lapse()
    const first = await listed()
    assert.equal(first.complete, true)
    const ours = new Map(first.leases.filter((lease) => lease.key.startsWith(`${prefix}|`)).map((lease) => [lease.key, lease]))
    assert.deepEqual([...ours.keys()].sort(), [...held].sort())
    for (const [i, key] of held.entries()) {
      const lease = ours.get(key)!
      assert.equal(lease.fingerprint, `fp-${i}`)
      near(lease.lockExpiresAt, before + LEASE, 'lease end')
      unknownOrWithin(lease.since, before, after, 'lease start')
    }
    for (const [i, key] of held.entries()) {
      if (i % 2 === 0) assert.equal(await store().complete(key, tokens.get(key)!, sampleResponse(), EXPIRY), true)
      else assert.equal(await store().release(key, tokens.get(key)!), true)
    }
    assert.equal((await listed()).leases.filter((lease) => lease.key.startsWith(`${prefix}|`)).length, 0)
  })

  test('listInFlight', 'returns at most limit leases, and says when there are more', async () => {
    const prefix = freshKey('list-limit')
    for (let i = 0; i < 3; i++) expectAcquired(await store().begin(`${prefix}:${i}`, 'fp', LEASE))
    const listing = await listed(2)
    assert.equal(listing.leases.length, 2)
    assert.equal(listing.complete, false)
  })
}
