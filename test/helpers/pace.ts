/**
 * How slow this machine is now, for time limits. A test's limit only bounds a test that hangs:
 * what it checks never depends on it. But a fixed limit fails tests on a loaded machine (a child
 * `node --import tsx` starts in about 0.7 s on a quiet 2-core machine, and in 10 to 15 s when the
 * load average is 25), so the limits are scaled by how long one such start takes: measured once
 * for the run by vitest.config.ts (`IDEMPOTENCY_TEST_START_MS`), or here when a file runs without
 * it.
 */
import { spawnSync } from 'node:child_process'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'

const root = fileURLToPath(new URL('../..', import.meta.url))

/** One start of a child `node --import tsx` on a quiet 2-core machine: the unit of `slowness`. */
export const QUIET_START_MS = 700

/** Milliseconds one child `node --import tsx` takes to start, load the command's entry and exit, now. */
export function measureChildStart (): number {
  const started = performance.now()
  spawnSync(process.execPath, ['--import', 'tsx', join(root, 'lib/cli/main.ts'), '--version'], { cwd: root, stdio: 'ignore' })
  return performance.now() - started
}

let measured: number | undefined

/** One child start, as measured for this run. */
export function childStartMs (): number {
  measured ??= Number(process.env.IDEMPOTENCY_TEST_START_MS) || measureChildStart()
  return measured
}

/**
 * How many times slower than a quiet machine this one is (at least 1). The limits scaled by it
 * keep the room they have on a quiet machine (a test that takes 3 s there has 30 s).
 */
export function slowness (): number {
  return Math.max(1, childStartMs() / QUIET_START_MS)
}

/** A time limit of `ms` on a quiet machine, on this one. */
export function scaled (ms: number): number {
  return Math.ceil(ms * slowness())
}
