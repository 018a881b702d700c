// `npm run bench` installs the benchmark's own dependencies (bench/package.json) the first time,
// and again when its lock file changed, so that nobody installs them who does not benchmark.
import { execFileSync } from 'node:child_process'
import { existsSync, readFileSync, writeFileSync } from 'node:fs'
import { createHash } from 'node:crypto'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const bench = dirname(fileURLToPath(import.meta.url))
const lock = join(bench, 'package-lock.json')
const stamp = join(bench, 'node_modules', '.installed-lock')
const wanted = createHash('sha256').update(readFileSync(lock)).digest('hex')
if (!existsSync(stamp) || readFileSync(stamp, 'utf8') !== wanted) {
  console.log('bench: installing its dependencies (bench/package.json)')
  execFileSync('npm', ['ci', '--no-audit', '--no-fund'], { cwd: bench, stdio: 'inherit' })
  writeFileSync(stamp, wanted)
}
