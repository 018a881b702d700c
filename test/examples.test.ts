/**
 * The examples run: each orders-and-payments variant (examples/orders-*.ts) drives itself over
 * real HTTP with `--self-test`, in a child process, and must exit 0 having printed every check.
 * The Redis variant runs when Redis answers, and is skipped with the reason otherwise (a failure
 * under CI=true, as for every test that needs a service). `npm run demo` (examples/demo.ts) prints
 * the exchanges docs/getting-started.md shows, and the page shows what it prints.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { readFileSync } from 'node:fs'
import { resolve } from 'node:path'
import { killChildren, runChild, type Finished } from './helpers/child-run.js'
import { REDIS, service } from './helpers/services.js'
import { scaled } from './helpers/pace.js'

const root = resolve(import.meta.dirname, '..')
/** A self-test takes about a second; this is for a machine under load. */
const LIMIT_MS = scaled(45_000)

const redis = await service(REDIS)

afterAll(killChildren)

function selfTest (example: string, env: NodeJS.ProcessEnv = {}): Promise<Finished> {
  return runChild(process.execPath, ['--import', 'tsx', `examples/${example}`, '--self-test'], { cwd: root, env: { ...process.env, ...env }, limitMs: LIMIT_MS })
}

/** The checks every variant prints, in this order. */
const CHECKS = [
  /^ {2}ok {2}first request {3}POST \/orders {3}-> 201, order 1 created \(\/orders\/1\)$/,
  /^ {2}ok {2}replay {10}POST \/orders {3}-> 201, idempotent-replayed: true, same body, still 1 order$/,
  /^ {2}ok {2}mismatch {8}POST \/orders {3}-> 409 fingerprint-mismatch \(same key, other body\)$/,
  /^ {2}ok {2}no key {10}POST \/orders {3}-> 400 key-missing$/,
  /^ {2}ok {2}first request {3}POST \/payments -> 201, payment 1 captured, 2500 cents$/,
  /^ {2}ok {2}replay {10}POST \/payments -> 201, idempotent-replayed: true, still 1 payment$/,
  /^ {2}ok {2}mismatch {8}POST \/payments -> 409 fingerprint-mismatch \(the order's key on another route\)$/,
  /^ {2}ok {2}read {12}GET {2}\/orders\/1 -> 200, status paid$/,
  /^self-test passed: 8 requests, 1 order and 1 payment written$/
]

function expectPassed (result: Finished, title: RegExp): void {
  const report = `exit ${result.code ?? result.signal}${result.timedOut ? ` (killed after ${LIMIT_MS} ms)` : ''}\n${result.output}`
  expect(result.timedOut, report).toBe(false)
  expect(result.code, report).toBe(0)
  const lines = result.output.split('\n')
  expect(lines[0], report).toMatch(title)
  expect(lines.filter((line) => line.startsWith('  ok  ') || line.startsWith('self-test passed'))).toEqual(
    CHECKS.map((check) => expect.stringMatching(check))
  )
}

describe.concurrent('examples', () => {
  it('orders-sqlite.ts --self-test: orders, payments and keys in SQLite', async () => {
    expectPassed(await selfTest('orders-sqlite.ts'), /^Orders and payments, with the idempotency keys in SQLite \(.+orders\.sqlite\)$/)
  }, LIMIT_MS + 5000)

  it.skipIf(!redis.available)(`orders-redis.ts --self-test: keys in Redis${redis.reason}`, async () => {
    expectPassed(
      await selfTest('orders-redis.ts', { REDIS_HOST: REDIS.host, REDIS_PORT: String(REDIS.port) }),
      /^Orders and payments in SQLite \(.+orders\.sqlite\), with the idempotency keys in Redis at /
    )
  }, LIMIT_MS + 5000)

  it('orders-transaction.ts --self-test: orders and ledger rows committed exactly once', async () => {
    const result = await selfTest('orders-transaction.ts')
    const report = `exit ${result.code ?? result.signal}\n${result.output}`
    expect(result.code, report).toBe(0)
    expect(result.output.split('\n').filter((line) => line.startsWith('  ok  '))).toHaveLength(4)
    expect(result.output).toContain('self-test passed: 4 requests, every write committed exactly once')
  }, LIMIT_MS + 5000)

  it('demo.ts prints the answers docs/getting-started.md shows under "What a client sees", header for header', async () => {
    const result = await runChild(process.execPath, ['--import', 'tsx', 'examples/demo.ts'], { cwd: root, env: process.env, limitMs: LIMIT_MS })
    expect(result.code, result.output).toBe(0)
    const printed = result.output.split('\n=== ').slice(1).map((exchange) => exchange.split('\n')
      .filter((line) => line.startsWith('< '))
      .map((line) => line.slice(2))
      // The least Retry-After-Ms says, as the page shows it, unless the route's earlier requests
      // took longer (a loaded machine): then the page is not what this run shows.
      .map((line) => /^retry-after-ms: ([1-9]\d{2}|1000)$/.test(line) ? 'retry-after-ms: 100' : line))
    const page = readFileSync(resolve(root, 'docs/getting-started.md'), 'utf8').split('\n## What a client sees\n')[1]!.split('\n## ')[0]!
    const shown = [...page.matchAll(/^```http\n(HTTP\/1\.1 [^]*?)\n```$/gm)].map((block) => block[1]!.split('\n').filter((line) => line !== ''))
    expect(shown).toHaveLength(5)
    expect(shown).toEqual(printed)
  }, LIMIT_MS + 5000)

  it('orders-redis.ts says so and exits 1 when Redis does not answer', async () => {
    // Port 1 on the loopback: nothing listens there, so the connection is refused at once.
    const result = await selfTest('orders-redis.ts', { REDIS_HOST: '127.0.0.1', REDIS_PORT: '1' })
    expect(result.timedOut, result.output).toBe(false)
    expect(result.code, result.output).toBe(1)
    expect(result.output).toMatch(/^Redis is not reachable at 127\.0\.0\.1:1 \(.+\); start it, or set REDIS_HOST and REDIS_PORT\.$/m)
  }, LIMIT_MS + 5000)
})
