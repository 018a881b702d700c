/**
 * The suite's guard (vitest.config.ts `setupFiles`): a test fails when it leaves a rejection nobody
 * handled or an uncaught exception, in the test process or in a process it started (those report
 * to this process's directory, test/helpers/guard-child.cjs). Nothing the plugin starts may end
 * an app: this is where the suite says so of every test.
 */
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, afterEach } from 'vitest'

const dir = mkdtempSync(join(tmpdir(), 'idempotency-guard-'))
process.env.IDEMPOTENCY_GUARD_DIR = dir

const seen: string[] = []
const describe = (what: string, error: unknown): string => `${what} in the test process:\n${error instanceof Error ? (error.stack ?? error.message) : String(error)}`
process.on('unhandledRejection', (reason) => { seen.push(describe('an unhandled rejection', reason)) })
process.on('uncaughtException', (error) => { seen.push(describe('an uncaught exception', error)) })

/** What was reported since the last look, the test process's and its children's. */
function reported (): string[] {
  const found = seen.splice(0)
  for (const file of readdirSync(dir)) {
    found.push(readFileSync(join(dir, file), 'utf8'))
    rmSync(join(dir, file), { force: true })
  }
  return found
}

function check (): void {
  const found = reported()
  if (found.length > 0) throw new Error(`the suite's guard: this test left ${found.length} unhandled failure${found.length === 1 ? '' : 's'}:\n${found.join('\n')}`)
}

afterEach(check)
afterAll(() => {
  try {
    check()
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
})
