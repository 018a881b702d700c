/**
 * The storage conformance suite: the one definition of "behaves like an IdempotencyStorage".
 *
 * Every provider of this package runs it, and so can anyone's custom provider:
 *
 *   import { describe, it, beforeEach, afterAll } from 'vitest'
 *   import { storageConformance } from 'fastify-idempotency/conformance'
 *   storageConformance('my store', () => new MyStorage(), { describe, it, beforeEach, afterAll })
 *
 * It takes the test runner's functions instead of importing one, so it runs under vitest, jest,
 * mocha or node:test alike, and asserts with node:assert. The optional methods are tested when the
 * options say the store offers them (`waitFor`, and the operations methods `inspect`, `forget`,
 * `listInFlight` in `operations`); the tests of the others are reported as skipped, with the reason.
 *
 * @module fastify-idempotency/conformance
 */
import assert from 'node:assert/strict'
import { setTimeout as sleep } from 'node:timers/promises'
import { operationsConformance, type ConformanceOperation } from './conformance-operations.js'
import type { BeginResult, IdempotencyStorage, StoredResponse, StoredState } from './types.js'

export type { ConformanceOperation }

/** A test's or a hook's body, as test runners take it. */
export type TestFn = () => Promise<void> | void
/** A test runner's `it` (or `test`): a named test, with an optional timeout in ms. */
export type Register = (name: string, fn: TestFn, timeout?: number) => void

/**
 * The test runner's functions the suite registers its tests with (vitest, jest, mocha, node:test).
 */
export interface ConformanceHarness {
  /** Groups tests under a name. */
  describe: (name: string, fn: () => void) => void
  /** With `it.skip` (vitest, jest, mocha and node:test have it), tests of optional methods a store does not offer are reported as skipped. */
  it: Register & {
    /** Registers a test reported as skipped. */
    skip?: Register
  }
  /** Runs before each test. */
  beforeEach: (fn: TestFn) => void
  /** Runs once after the suite's tests. */
  afterAll: (fn: TestFn) => void
}

/** What the suite is told about the store under test. */
export interface ConformanceOptions {
  /**
   * Milliseconds used as a short lease or expiration in the lapse tests. The suite sleeps a
   * little longer than this, so keep it above the store's clock resolution. Default 60.
   */
  shortTtl?: number
  /**
   * The optional operations methods the store offers, to be tested: any of `'inspect'`,
   * `'forget'`, `'listInFlight'`. Those not listed are reported as skipped. Default: none.
   */
  operations?: readonly ConformanceOperation[]
  /**
   * Whether the store offers `waitFor`, to be tested (then a store without it fails). Without
   * `true` its tests are reported as skipped, with the reason. Default: false.
   */
  waitFor?: boolean
}

/** Keys that must be stored literally: quoting, separators, globs, SQL, Lua and Redis hash tags. */
export const HOSTILE_KEYS: readonly string[] = [
  'a',
  'key with spaces',
  '"quoted"',
  "it's",
  'colon:separated:key',
  '{braces}and{more}',
  '}{',
  '*?[glob]',
  '%_like_wildcards%',
  "'; DROP TABLE idempotency_keys; --",
  'lua ]]..redis.call("FLUSHALL")..[[',
  'back\\slash',
  '\u00e9t\u00e9 \u{1F4B8}',
  'x'.repeat(255),
  'tenant-\u0000-scope:key',
  // The longest keys the plugin passes on unhashed (512 UTF-8 bytes; see MAX_STORAGE_KEY_BYTES):
  // ASCII, two-byte and four-byte characters, a scope before a line feed, and a hashed key.
  'k'.repeat(512 - 60),
  '\u00e9'.repeat(256 - 30),
  '\u{1F4B8}'.repeat(128 - 15),
  'tenant \u00e9\u00e9\nkey-1',
  '\u0000sha256:47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU'
]

let unique = 0
/** A key no earlier test (nor an earlier run against a persistent store) has used. */
function freshKey (label: string): string {
  return `conformance:${process.pid}:${Date.now()}:${++unique}:${label}`
}

function sampleResponse (overrides: Partial<StoredResponse> = {}): StoredResponse {
  return {
    statusCode: 201,
    contentType: 'application/json; charset=utf-8',
    headers: { location: '/orders/1', 'x-multi': ['a', 'b'] },
    body: Buffer.from('{"id":1}'),
    ...overrides
  }
}

function expectAcquired (result: BeginResult): string {
  assert.equal(result.state, 'acquired', `expected the lease, got ${JSON.stringify(result)}`)
  assert.ok(result.state === 'acquired')
  assert.equal(typeof result.token, 'string')
  assert.ok(result.token.length > 0)
  return result.token
}

function expectCompleted (result: BeginResult | StoredState, fingerprint: string, response: StoredResponse): void {
  assert.equal(result.state, 'completed', `expected a stored response, got state ${result.state}`)
  assert.ok(result.state === 'completed')
  assert.equal(result.fingerprint, fingerprint)
  assert.equal(result.response.statusCode, response.statusCode)
  assert.equal(result.response.contentType, response.contentType)
  assert.deepEqual(result.response.headers, response.headers)
  assert.ok(Buffer.isBuffer(result.response.body), 'body must come back as a Buffer')
  assert.ok(result.response.body.equals(response.body), 'body must come back byte for byte')
  assert.equal(result.response.bodyOmitted === true, response.bodyOmitted === true, 'bodyOmitted must come back as stored')
}

/**
 * Registers the storage conformance suite for a store: `factory` makes a fresh store for each test.
 * Every store of this package passes it; a custom store should too (docs/stores/custom.md).
 */
export function storageConformance (
  name: string,
  factory: () => IdempotencyStorage | Promise<IdempotencyStorage>,
  harness: ConformanceHarness,
  options: ConformanceOptions = {}
): void {
  const { describe, it, beforeEach, afterAll } = harness
  const shortTtl = options.shortTtl ?? 60
  /** Wait until a lease or expiration of `ttl` ms has surely run out. */
  const lapse = (ttl = shortTtl) => sleep(ttl * 2 + 20)
  const LEASE = 30_000
  const EXPIRY = 60_000
  let storage: IdempotencyStorage | undefined

  describe(`IdempotencyStorage conformance: ${name}`, () => {
    beforeEach(async () => {
      storage ??= await factory()
    })
    afterAll(async () => {
      await storage?.close?.()
    })
    const store = (): IdempotencyStorage => storage!

    it('takes the lease on a new key and returns a fencing token', async () => {
      expectAcquired(await store().begin(freshKey('new'), 'fp-1', LEASE))
    })

    it('reports a held key as in flight, with the holder\'s fingerprint and lease end', async () => {
      const key = freshKey('inflight')
      const before = Date.now()
      expectAcquired(await store().begin(key, 'fp-holder', LEASE))
      const second = await store().begin(key, 'fp-other', LEASE)
      assert.equal(second.state, 'in-flight')
      assert.ok(second.state === 'in-flight')
      assert.equal(second.fingerprint, 'fp-holder')
      assert.ok(second.lockExpiresAt >= before + LEASE - 1000, `lease end ${second.lockExpiresAt} too early`)
      assert.ok(second.lockExpiresAt <= Date.now() + LEASE + 1000, `lease end ${second.lockExpiresAt} too late`)
    })

    it('stores a response on complete and returns it, byte for byte, with the stored fingerprint', async () => {
      const key = freshKey('complete')
      const token = expectAcquired(await store().begin(key, 'fp-a', LEASE))
      const response = sampleResponse()
      assert.equal(await store().complete(key, token, response, EXPIRY), true)
      expectCompleted(await store().begin(key, 'fp-a', LEASE), 'fp-a', response)
      expectCompleted(await store().begin(key, 'fp-different', LEASE), 'fp-a', response)
    })

    it('keeps binary bodies, empty bodies, a null content type and no headers exactly', async () => {
      const every = Buffer.alloc(256 * 4)
      for (let i = 0; i < every.length; i++) every[i] = i % 256
      const cases: StoredResponse[] = [
        sampleResponse({ body: every, contentType: 'application/octet-stream' }),
        sampleResponse({ statusCode: 204, body: Buffer.alloc(0), contentType: null, headers: {} }),
        sampleResponse({ body: Buffer.from('caf\u00e9 \u{1F4B8}', 'utf8'), headers: { 'x-unicode-safe': 'ascii only' } })
      ]
      for (const response of cases) {
        const key = freshKey('binary')
        const token = expectAcquired(await store().begin(key, 'fp', LEASE))
        assert.equal(await store().complete(key, token, response, EXPIRY), true)
        expectCompleted(await store().begin(key, 'fp', LEASE), 'fp', response)
      }
    })

    it('keeps an outcome whose body was omitted apart from an empty body', async () => {
      const omitted = sampleResponse({ statusCode: 200, body: Buffer.alloc(0), bodyOmitted: true })
      const empty = sampleResponse({ statusCode: 200, body: Buffer.alloc(0) })
      for (const response of [omitted, empty, omitted]) {
        const key = freshKey('omitted')
        const token = expectAcquired(await store().begin(key, 'fp', LEASE))
        assert.equal(await store().complete(key, token, response, EXPIRY), true)
        expectCompleted(await store().begin(key, 'fp', LEASE), 'fp', response)
      }
    })

    it('stores a 1 MiB body', async () => {
      const key = freshKey('large')
      const body = Buffer.alloc(1024 * 1024, 0x61)
      body[body.length - 1] = 0x7a
      const token = expectAcquired(await store().begin(key, 'fp', LEASE))
      assert.equal(await store().complete(key, token, sampleResponse({ body }), EXPIRY), true)
      expectCompleted(await store().begin(key, 'fp', LEASE), 'fp', sampleResponse({ body }))
    })

    it('refuses complete with a token that does not hold the lease, and keeps the key in flight', async () => {
      const key = freshKey('wrong-token')
      expectAcquired(await store().begin(key, 'fp', LEASE))
      assert.equal(await store().complete(key, 'not-the-token', sampleResponse(), EXPIRY), false)
      assert.equal(await store().release(key, 'not-the-token'), false)
      assert.equal(await store().renew(key, 'not-the-token', LEASE), false)
      assert.equal((await store().begin(key, 'fp', LEASE)).state, 'in-flight')
    })

    it('refuses complete, release and renew on a key nobody holds', async () => {
      const key = freshKey('unheld')
      assert.equal(await store().complete(key, 'nobody', sampleResponse(), EXPIRY), false)
      assert.equal(await store().release(key, 'nobody'), false)
      assert.equal(await store().renew(key, 'nobody', LEASE), false)
      expectAcquired(await store().begin(key, 'fp', LEASE))
    })

    it('frees the key on release, so the next begin takes a new lease', async () => {
      const key = freshKey('release')
      const first = expectAcquired(await store().begin(key, 'fp', LEASE))
      assert.equal(await store().release(key, first), true)
      const second = expectAcquired(await store().begin(key, 'fp-2', LEASE))
      assert.notEqual(second, first)
      assert.equal(await store().complete(key, first, sampleResponse(), EXPIRY), false, 'a released token must be fenced off')
      assert.equal(await store().release(key, first), false)
      const held = await store().begin(key, 'fp-3', LEASE)
      assert.ok(held.state === 'in-flight')
      assert.equal(held.fingerprint, 'fp-2')
    })

    it('lets a lapsed lease be taken over, and fences the old holder off', async () => {
      const key = freshKey('lapse')
      const old = expectAcquired(await store().begin(key, 'fp', shortTtl))
      await lapse()
      const fresh = expectAcquired(await store().begin(key, 'fp', LEASE))
      assert.notEqual(fresh, old)
      assert.equal(await store().complete(key, old, sampleResponse({ statusCode: 200 }), EXPIRY), false)
      assert.equal(await store().renew(key, old, LEASE), false)
      assert.equal(await store().complete(key, fresh, sampleResponse(), EXPIRY), true)
      expectCompleted(await store().begin(key, 'fp', LEASE), 'fp', sampleResponse())
    })

    it('refuses to complete a lease that lapsed even when nobody took it over', async () => {
      const key = freshKey('lapse-untaken')
      const token = expectAcquired(await store().begin(key, 'fp', shortTtl))
      await lapse()
      assert.equal(await store().complete(key, token, sampleResponse(), EXPIRY), false)
      expectAcquired(await store().begin(key, 'fp', LEASE))
    })

    it('extends a lease on renew, so it outlives its first timeout', async () => {
      // The renewal must reach the store before the first lease runs out: on a loaded machine it
      // may not, and then the lease has lapsed for a reason that is no fault of the store. Such an
      // attempt proves nothing either way, so it is made again with a lease twice as long, so that
      // a slow machine slows the test down instead of failing it.
      const attempts = 7 // leases of shortTtl up to 64 × shortTtl
      for (let attempt = 1; ; attempt++) {
        const ttl = shortTtl * 2 ** (attempt - 1)
        const key = freshKey('renew')
        const sent = performance.now()
        const token = expectAcquired(await store().begin(key, 'fp', ttl))
        const renewed = await store().renew(key, token, LEASE)
        if (performance.now() - sent >= ttl) {
          if (attempt < attempts) continue
          assert.fail(`begin and renew took ${ttl} ms or more: too slow to tell whether renew extends a lease`)
        }
        assert.equal(renewed, true)
        await lapse(ttl)
        assert.equal((await store().begin(key, 'fp', LEASE)).state, 'in-flight')
        assert.equal(await store().complete(key, token, sampleResponse(), EXPIRY), true)
        return
      }
    })

    it('never returns an expired response; the key starts anew after expiration', async () => {
      const key = freshKey('expire')
      const token = expectAcquired(await store().begin(key, 'fp-old', LEASE))
      assert.equal(await store().complete(key, token, sampleResponse(), shortTtl), true)
      await lapse()
      expectAcquired(await store().begin(key, 'fp-new', LEASE))
      const held = await store().begin(key, 'fp-x', LEASE)
      assert.ok(held.state === 'in-flight')
      assert.equal(held.fingerprint, 'fp-new')
    })

    it('grants exactly one lease to 25 simultaneous begins on one key', async () => {
      const key = freshKey('race')
      const results = await Promise.all(Array.from({ length: 25 }, (_, i) => store().begin(key, `fp-${i}`, LEASE)))
      const acquired = results.filter((r) => r.state === 'acquired')
      assert.equal(acquired.length, 1, `expected one lease, got ${acquired.length}`)
      assert.equal(results.filter((r) => r.state === 'in-flight').length, 24)
    })

    it('grants exactly one lease per key when a lapsed lease is raced for', async () => {
      const key = freshKey('race-lapsed')
      expectAcquired(await store().begin(key, 'fp', shortTtl))
      await lapse()
      const results = await Promise.all(Array.from({ length: 15 }, () => store().begin(key, 'fp', LEASE)))
      assert.equal(results.filter((r) => r.state === 'acquired').length, 1)
    })

    it('keeps keys independent', async () => {
      const a = freshKey('a')
      const b = freshKey('b')
      const tokenA = expectAcquired(await store().begin(a, 'fp-a', LEASE))
      const tokenB = expectAcquired(await store().begin(b, 'fp-b', LEASE))
      assert.equal(await store().complete(a, tokenB, sampleResponse(), EXPIRY), false)
      assert.equal(await store().complete(a, tokenA, sampleResponse({ statusCode: 200 }), EXPIRY), true)
      assert.equal((await store().begin(b, 'fp-b', LEASE)).state, 'in-flight')
    })

    // The store is made before the first test, after the tests are registered: whether it offers
    // `waitFor` is said by the options, so that its tests are reported skipped rather than passed.
    const waitForTest = (name: string, fn: TestFn): void => {
      if (options.waitFor === true) it(`waitFor: ${name}`, fn)
      else it.skip?.(`waitFor: ${name} [skipped: the store does not offer waitFor, or its conformance options do not say waitFor: true]`, fn)
    }
    const waitFor = (key: string, timeout: number): Promise<void> => {
      assert.equal(typeof store().waitFor, 'function', 'the conformance options say waitFor: true, but the store has no waitFor')
      return store().waitFor!(key, timeout)
    }

    waitForTest('wakes a waiter when the lease ends by complete or release', async () => {
      for (const end of ['complete', 'release'] as const) {
        const key = freshKey(`wait-${end}`)
        const token = expectAcquired(await store().begin(key, 'fp', LEASE))
        const started = Date.now()
        const waiting = waitFor(key, 20_000)
        await sleep(shortTtl)
        if (end === 'complete') assert.equal(await store().complete(key, token, sampleResponse(), EXPIRY), true)
        else assert.equal(await store().release(key, token), true)
        await waiting
        assert.ok(Date.now() - started < 10_000, `the waiter woke only after ${Date.now() - started} ms`)
        assert.notEqual((await store().begin(key, 'fp', LEASE)).state, 'in-flight')
      }
    })

    waitForTest('returns at once for a key nobody holds, and after the timeout otherwise', async () => {
      const free = Date.now()
      await waitFor(freshKey('wait-free'), 20_000)
      assert.ok(Date.now() - free < 5_000)
      const key = freshKey('wait-timeout')
      expectAcquired(await store().begin(key, 'fp', LEASE))
      const held = Date.now()
      await waitFor(key, shortTtl)
      assert.ok(Date.now() - held >= shortTtl - 5, 'waitFor returned before its timeout while the lease was held')
      assert.ok(Date.now() - held < 5_000)
    })

    it('stores hostile keys literally and keeps them apart', async () => {
      const prefix = freshKey('hostile')
      for (const [i, hostile] of HOSTILE_KEYS.entries()) {
        const key = `${prefix}|${hostile}`
        const token = expectAcquired(await store().begin(key, `fp-${i}`, LEASE))
        const response = sampleResponse({ headers: { 'x-index': String(i) } })
        assert.equal(await store().complete(key, token, response, EXPIRY), true)
      }
      for (const [i, hostile] of HOSTILE_KEYS.entries()) {
        expectCompleted(await store().begin(`${prefix}|${hostile}`, 'fp', LEASE), `fp-${i}`,
          sampleResponse({ headers: { 'x-index': String(i) } }))
      }
    })

    operationsConformance({
      it,
      store,
      offered: options.operations ?? [],
      freshKey,
      sampleResponse,
      expectAcquired,
      expectCompleted,
      lapse,
      shortTtl,
      hostileKeys: HOSTILE_KEYS,
      lease: LEASE,
      expiry: EXPIRY
    })
  })
}
