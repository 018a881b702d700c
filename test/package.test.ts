/**
 * The package as users install it: `npm pack`, unpacked into a consumer project, then loaded with
 * `import` and `require`, its types checked from both module systems, and checked by publint and
 * are-the-types-wrong. The consumer lives under .tmp/ in this repository, so the package's own
 * dependencies resolve from this repository's node_modules, as they would from the user's.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { execFileSync } from 'node:child_process'
import { mkdirSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'

const root = resolve(import.meta.dirname, '..')
const work = join(root, '.tmp', `package-${process.pid}`)
const consumer = join(work, 'consumer')
const installed = join(consumer, 'node_modules', 'fastify-idempotency')
let tarball = ''

function run (command: string, args: string[], cwd: string): string {
  return execFileSync(command, args, { cwd, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, npm_config_loglevel: 'error' } })
}

beforeAll(() => {
  mkdirSync(installed, { recursive: true })
  run('npm', ['pack', '--pack-destination', work], root)
  tarball = join(work, readdirSync(work).find((name) => name.endsWith('.tgz'))!)
  run('tar', ['-xzf', tarball, '-C', installed, '--strip-components=1'], root)
  writeFileSync(join(consumer, 'package.json'), JSON.stringify({ name: 'consumer', private: true }))
}, 120_000)

afterAll(() => rmSync(work, { recursive: true, force: true }))

const entries = {
  'fastify-idempotency': ['default', 'idempotency', 'MemoryStorage', 'IdempotencyFingerprintMismatchError', 'idempotencyErrorHandler', 'isIdempotencyError'],
  'fastify-idempotency/redis': ['RedisStorage'],
  'fastify-idempotency/knex': ['KnexStorage', 'createIdempotencyTable', 'dropIdempotencyTable'],
  'fastify-idempotency/conformance': ['storageConformance']
}

describe('the packed package', () => {
  it('ships the build, the docs and the README, and no sources or tests', () => {
    const files = run('tar', ['-tzf', tarball], root).split('\n').filter(Boolean)
    expect(files).toContain('package/dist/index.js')
    expect(files).toContain('package/dist/index.cjs')
    expect(files).toContain('package/dist/index.d.ts')
    expect(files).toContain('package/README.md')
    expect(files).toContain('package/docs/errors.md')
    expect(files.some((file) => file.startsWith('package/test/') || file.startsWith('package/lib/'))).toBe(false)
  })

  it('loads every entry with import', () => {
    const script = `for (const [name, names] of Object.entries(${JSON.stringify(entries)})) {
      const mod = await import(name)
      for (const n of names) if (mod[n] === undefined) throw new Error(name + ' lacks ' + n)
    }
    const { default: plugin, idempotency } = await import('fastify-idempotency')
    if (plugin !== idempotency) throw new Error('default and named exports differ')
    console.log('ok')`
    expect(run(process.execPath, ['--input-type=module', '-e', script], consumer).trim()).toBe('ok')
  })

  it('loads every entry with require, and the main entry loads no store driver', () => {
    const script = `const entries = ${JSON.stringify(entries)}
    const main = require('fastify-idempotency')
    const loaded = Object.keys(require.cache)
    if (loaded.some((file) => /node_modules[\\\\/](ioredis|knex|pg|mysql2|better-sqlite3)[\\\\/]/.test(file))) throw new Error('the main entry loaded a driver')
    if (typeof main.default !== 'function' || main.default !== main.idempotency) throw new Error('bad main exports')
    for (const [name, names] of Object.entries(entries)) {
      const mod = require(name)
      for (const n of names) if (mod[n] === undefined) throw new Error(name + ' lacks ' + n)
    }
    console.log('ok')`
    expect(run(process.execPath, ['-e', script], consumer).trim()).toBe('ok')
  })

  it('passes publint and are-the-types-wrong (node16 from ESM and CJS, bundlers)', () => {
    const bin = (name: string) => join(root, 'node_modules', '.bin', name)
    expect(() => run(bin('publint'), ['--strict', installed], root)).not.toThrow()
    const report = run(bin('attw'), [tarball, '--profile', 'node16', '--format', 'json'], root)
    // node10 resolution predates `exports` and cannot see subpath entries; Node 20+ users never use it.
    const problems = (JSON.parse(report) as { analysis: { problems: Array<{ resolutionKind?: string }> } }).analysis.problems
    expect(problems.filter((problem) => problem.resolutionKind !== 'node10')).toEqual([])
  })

  it('type-checks a consumer from ESM and from CommonJS', () => {
    const source = `import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler, IdempotencyFingerprintMismatchError, MemoryStorage, type IdempotencyOptions, type IdempotencyStorage } from 'fastify-idempotency'
import { RedisStorage } from 'fastify-idempotency/redis'
import { KnexStorage } from 'fastify-idempotency/knex'
import { storageConformance } from 'fastify-idempotency/conformance'
const options: IdempotencyOptions = { storage: new MemoryStorage(), expiration: '1h', fingerprint: { query: true } }
const app = Fastify()
void app.register(idempotency, options)
app.setErrorHandler(idempotencyErrorHandler())
app.post('/o', { config: { idempotency: { required: true } } }, async () => ({}))
const title: string = IdempotencyFingerprintMismatchError.title
const storages: Array<IdempotencyStorage | typeof RedisStorage | typeof KnexStorage> = []
export { title, storages, storageConformance }
`
    writeFileSync(join(consumer, 'esm.mts'), source)
    writeFileSync(join(consumer, 'cjs.cts'), source)
    const tsc = join(root, 'node_modules', 'typescript', 'bin', 'tsc')
    const flags = ['--noEmit', '--strict', '--skipLibCheck', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--types', 'node', '--typeRoots', join(root, 'node_modules', '@types')]
    expect(() => run(process.execPath, [tsc, ...flags, 'esm.mts', 'cjs.cts'], consumer)).not.toThrow()
  })
})
