/**
 * `--version`: the version in the package's own package.json, found from this file upwards
 * (dist/cli.cjs in the package, lib/cli/ in the repository).
 */
import { existsSync, readFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

export function packageVersion (): string {
  let directory = dirname(fileURLToPath(import.meta.url))
  for (;;) {
    const manifest = join(directory, 'package.json')
    if (existsSync(manifest)) {
      const { name, version } = JSON.parse(readFileSync(manifest, 'utf8')) as { name?: string, version?: string }
      if (name === 'fastify-idempotency' && version !== undefined) return version
    }
    const parent = dirname(directory)
    if (parent === directory) return 'unknown'
    directory = parent
  }
}
