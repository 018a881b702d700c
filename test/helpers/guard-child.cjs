/**
 * The suite's guard in every process the tests start (vitest.config.ts puts it in NODE_OPTIONS):
 * an uncaught exception, or a rejection nobody handled, is written to the directory the test
 * process named (`IDEMPOTENCY_GUARD_DIR`, test/setup/guard.ts), which fails the test that started
 * the process, whatever became of the process. It only watches (`uncaughtExceptionMonitor`): the
 * process still ends as Node ends it.
 */
'use strict'
const { appendFileSync } = require('node:fs')
const { join } = require('node:path')

const dir = process.env.IDEMPOTENCY_GUARD_DIR
if (dir !== undefined && dir !== '') {
  process.on('uncaughtExceptionMonitor', (error, origin) => {
    const what = origin === 'unhandledRejection' ? 'an unhandled rejection' : 'an uncaught exception'
    const text = error instanceof Error ? (error.stack ?? error.message) : String(error)
    try {
      appendFileSync(join(dir, `child-${process.pid}.txt`), `${what} in process ${process.pid} (${process.argv.slice(1).join(' ')}):\n${text}\n`)
    } catch {
      // The test process's directory is gone: it has finished.
    }
  })
}
