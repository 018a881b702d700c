import { fileURLToPath } from 'node:url'
import { configDefaults, defineConfig } from 'vitest/config'
import { childStartMs, scaled } from './test/helpers/pace.js'

// On Node 20, knex's better-sqlite3 client loads better-sqlite3 12 (scripts/sqlite-driver.cjs
// says why), in the test workers and in every process the tests start.
if (Number(process.versions.node.split('.')[0]) < 22) {
  const driver = fileURLToPath(new URL('./scripts/sqlite-driver.cjs', import.meta.url))
  process.env.NODE_OPTIONS = `${process.env.NODE_OPTIONS ?? ''} --require "${driver}"`.trim()
}

// The suite's guard in every process a test starts (test/helpers/guard-child.cjs, and
// test/setup/guard.ts in the test processes): an unhandled rejection or an uncaught exception
// there fails the test that started it.
const guard = fileURLToPath(new URL('./test/helpers/guard-child.cjs', import.meta.url))
process.env.NODE_OPTIONS = `${process.env.NODE_OPTIONS ?? ''} --require "${guard}"`.trim()

// How slow the machine is, measured once for the run and handed to the test files
// (test/helpers/pace.ts): every time limit is scaled by it.
process.env.IDEMPOTENCY_TEST_START_MS ??= String(Math.round(childStartMs()))

/**
 * `IDEMPOTENCY_TESTS=runtime`: the files whose outcome can depend on the Node or Fastify version
 * under them (hooks and replies, streams, crypto, module formats, the package, SQLite's driver,
 * the frameworks), for CI's runs on Node 22 and on Fastify 6 (.ci/run). Left out, because they
 * exercise the same plugin code on any runtime and are run in full on Node 20: each store's own
 * protocol and failures on its server, the processes that share a store, the brokers' recipes,
 * the command line and the docs' text.
 */
const RUNTIME_INDEPENDENT = [
  'cli', 'docs-samples', 'examples', 'diagrams', 'run', 'operations', 'outage', 'hung-store',
  'storage-knex', 'storage-knex-*', 'storage-redis', 'storage-redis-*', 'redis-full', 'redis-drivers',
  'locked-rows-*', 'statement-cancel', 'lease-clock', 'knex-wait-exit', 'transaction-pool*',
  'transaction-isolation-pg', 'transaction-migration', 'transaction-lock-waits',
  'multiprocess', 'steps-multiprocess', 'clocks', 'recipes-*'
].map((name) => `test/${name}.test.ts`)

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    setupFiles: ['test/setup/guard.ts'],
    exclude: [...configDefaults.exclude, ...(process.env.IDEMPOTENCY_TESTS === 'runtime' ? RUNTIME_INDEPENDENT : [])],
    // Two files at a time, whatever the machine (vitest's default on 2 cores is one): the suite
    // spends most of its time waiting on leases, timers, servers and child processes. On a quiet
    // 2-core machine, `npm test` took 729 s with one worker and 510 s with two, while the shared
    // PostgreSQL saw at most 63 of its 100 connections. `--maxWorkers` overrides it.
    maxWorkers: 2,
    testTimeout: scaled(30_000),
    hookTimeout: scaled(60_000),
    coverage: {
      provider: 'v8',
      include: ['lib/**/*.ts'],
      // The command's entry runs only as a process of its own (test/cli.test.ts, test/package.test.ts),
      // which this coverage does not see; everything it calls is lib/cli/run.ts, measured in process.
      exclude: ['lib/cli/main.ts'],
      reporter: ['text-summary'],
      // The level the suite reached when the gate was set, rounded down: a change that leaves
      // code untested fails `npm test`.
      thresholds: { statements: 98, lines: 98, functions: 98, branches: 93 }
    }
  }
})
