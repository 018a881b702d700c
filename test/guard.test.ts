/**
 * The suite's guard (test/setup/guard.ts, test/helpers/guard-child.cjs) fails a test that leaves
 * an unhandled rejection, in the test process or in a process the test started: shown on two
 * tests that do (test/fixtures/guard/), run by a vitest of their own.
 */
import { fileURLToPath } from 'node:url'
import { expect, it } from 'vitest'
import { runChild } from './helpers/child-run.js'
import { scaled } from './helpers/pace.js'

const root = fileURLToPath(new URL('..', import.meta.url))

it('fails each test that leaves an unhandled rejection, in its process or in a child', async () => {
  const { IDEMPOTENCY_GUARD_DIR: _ours, ...env } = process.env
  const run = await runChild(process.execPath, ['node_modules/vitest/vitest.mjs', 'run', '--config', 'test/fixtures/guard/vitest.config.ts', '--reporter', 'verbose'],
    { cwd: root, env: { ...env, CI: '', NO_COLOR: '1', FORCE_COLOR: '0' }, limitMs: scaled(60_000) })
  expect(run.timedOut).toBe(false)
  expect(run.code).not.toBe(0)
  expect(run.output).toMatch(/× .*leaves a rejection unhandled in the test process/)
  expect(run.output).toMatch(/× .*starts a process that dies of a rejection nobody handled/)
  expect(run.output).toMatch(/the suite's guard: this test left 1 unhandled failure:\nan unhandled rejection in the test process:\nError: left behind in the test process/)
  expect(run.output).toMatch(/the suite's guard: this test left 1 unhandled failure:\nan unhandled rejection in process \d+ .*:\nError: left behind in a child/)
}, scaled(90_000))
