/**
 * The package as users install it: the tarball `npm pack` makes of this checkout (or the one
 * PACKED_TARBALL names: CI packs once for its runs on several Node versions), unpacked into a
 * consumer project under .tmp/, so that the package's own dependencies resolve from this
 * repository's node_modules, as they would from the user's.
 */
import { execFile } from 'node:child_process'
import { mkdirSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'

export const root = resolve(import.meta.dirname, '..', '..')

export interface Finished { code: number, output: string }

/** A command's exit code and its output (stdout, then stderr), run asynchronously. */
export function exec (command: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<Finished> {
  return new Promise((resolve) => {
    execFile(command, args, { cwd, encoding: 'utf8', maxBuffer: 64 * 1024 * 1024, env: { ...process.env, npm_config_loglevel: 'error', ...env } }, (error, stdout, stderr) => {
      resolve({ code: error === null ? 0 : typeof error.code === 'number' ? error.code : 1, output: stdout + stderr })
    })
  })
}

/** A command's output; a failure throws with its output. */
export async function run (command: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<string> {
  const finished = await exec(command, args, cwd, env)
  if (finished.code !== 0) throw new Error(`${command} ${args.join(' ')} exited with ${finished.code}:\n${finished.output}`)
  return finished.output
}

export interface PackedConsumer {
  /** Where the tarball came from. */
  tarball: string
  /** The consumer project: a package.json and node_modules/fastify-idempotency. */
  consumer: string
  /** The unpacked package. */
  installed: string
  /** Remove what `packedConsumer` made. */
  remove: () => void
}

/** A consumer project under .tmp/`label`-pid with the packed package installed. */
export async function packedConsumer (label: string): Promise<PackedConsumer> {
  const work = join(root, '.tmp', `${label}-${process.pid}`)
  const consumer = join(work, 'consumer')
  const installed = join(consumer, 'node_modules', 'fastify-idempotency')
  mkdirSync(installed, { recursive: true })
  let tarball: string
  if (process.env.PACKED_TARBALL !== undefined) {
    tarball = resolve(process.env.PACKED_TARBALL)
  } else {
    await run('npm', ['pack', '--pack-destination', work], root)
    tarball = join(work, readdirSync(work).find((name) => name.endsWith('.tgz'))!)
  }
  await run('tar', ['-xzf', tarball, '-C', installed, '--strip-components=1'], root)
  writeFileSync(join(consumer, 'package.json'), JSON.stringify({ name: 'consumer', private: true }))
  return { tarball, consumer, installed, remove: () => { rmSync(work, { recursive: true, force: true }) } }
}
