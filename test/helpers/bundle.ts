/**
 * A TypeScript program as one ES module, for the tests that start it as a child process: esbuild
 * bundles the program with the sources of this repository it imports (packages stay imports, and
 * resolve from where the bundle is written, inside the repository), so that the child starts as
 * plain `node`. That costs about half the CPU of starting it through tsx (0.42 against 0.76 s for
 * test/fixtures/server.ts), which counts when several suites share two cores.
 */
import { createHash } from 'node:crypto'
import { existsSync, mkdirSync, renameSync, writeFileSync } from 'node:fs'
import { basename, join } from 'node:path'
import { build, type Plugin } from 'esbuild'

/**
 * `entry` bundled into `dir` (inside the repository), named by its content: the same program is
 * written once and shared by every test process that asks for it, and each file appears whole.
 * `plugins` may take modules from elsewhere (the recipes' tests take them from docs/jobs.md).
 */
export async function bundle (entry: string, dir: string, plugins: Plugin[] = []): Promise<string> {
  const { outputFiles } = await build({
    entryPoints: [entry],
    write: false,
    outdir: dir,
    bundle: true,
    platform: 'node',
    format: 'esm',
    target: 'node20',
    packages: 'external',
    plugins,
    logLevel: 'silent'
  })
  const code = outputFiles[0]!.contents
  const file = join(dir, `${basename(entry, '.ts')}-${createHash('sha256').update(code).digest('hex').slice(0, 16)}.mjs`)
  if (!existsSync(file)) {
    mkdirSync(dir, { recursive: true })
    const partial = `${file}.${process.pid}.partial`
    writeFileSync(partial, code)
    renameSync(partial, file)
  }
  return file
}
