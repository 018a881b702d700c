/**
 * The package as users install it: `npm pack`, unpacked into a consumer project, then loaded with
 * `import` and `require`, its types checked from both module systems, and checked by publint and
 * are-the-types-wrong. The consumer lives under .tmp/ in this repository, so the package's own
 * dependencies resolve from this repository's node_modules, as they would from the user's.
 *
 * PACKED_TARBALL names a tarball `npm pack` already made of this checkout (CI packs once for its
 * runs on several Node versions); without it, the test packs one. Child processes run
 * asynchronously: a compiler that blocked this worker for a minute on a loaded machine would make
 * vitest give up on it.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { execFile } from 'node:child_process'
import { readFileSync, readdirSync, statSync, writeFileSync } from 'node:fs'
import { isBuiltin } from 'node:module'
import { dirname, join, relative } from 'node:path'
import semver from 'semver'
import fastifyPackage from 'fastify/package.json' with { type: 'json' }
import type { Options } from 'tsup'
import tsupConfig from '../tsup.config.js'
import { checkLinks } from './helpers/markdown.js'
import { exec, packedConsumer, root, run, type PackedConsumer } from './helpers/packed.js'
import { scaled } from './helpers/pace.js'
import { PROBLEM_TYPE_BASE } from '../lib/errors.js'

let packed: PackedConsumer
let tarball = ''
let consumer = ''
let installed = ''
let work = ''

/** A command's standard output alone (its standard error may carry log lines); a failure throws. */
function stdoutOf (command: string, args: string[], cwd: string): Promise<string> {
  return new Promise((resolve, reject) => {
    execFile(command, args, { cwd, encoding: 'utf8' }, (error, stdout, stderr) => {
      if (error === null) resolve(stdout)
      else reject(new Error(`${command} ${args.join(' ')} failed:\n${stdout}${stderr}`))
    })
  })
}

beforeAll(async () => {
  packed = await packedConsumer('package')
  ;({ tarball, consumer, installed } = packed)
  work = dirname(consumer)
}, scaled(180_000))

afterAll(() => packed?.remove())

/**
 * A runtime run (IDEMPOTENCY_TESTS=runtime: CI's runs on Node 22 and on Fastify 6, vitest.config.ts)
 * checks what the Node.js or the Fastify under it can change. publint, are-the-types-wrong and the
 * declarations built with TypeScript 7 read files alone: the Node 20 run checks them. A consumer's
 * types depend on Fastify's, not on Node's: a runtime run checks them on another Fastify major than
 * the one the repository develops with (Fastify 6), and leaves them to the Node 20 run otherwise.
 */
const runtimeRun = process.env.IDEMPOTENCY_TESTS === 'runtime'
const ownFastify = semver.minVersion((JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { devDependencies: Record<string, string> }).devDependencies.fastify!)!.major
const typesOnThisFastify = !runtimeRun || semver.major(fastifyPackage.version) !== ownFastify

const entries = {
  'fastify-idempotency': ['default', 'idempotency', 'MemoryStorage', 'IdempotencyFingerprintMismatchError', 'idempotencyErrorHandler', 'isIdempotencyError'],
  'fastify-idempotency/redis': ['RedisStorage'],
  'fastify-idempotency/knex': ['KnexStorage', 'createIdempotencyTable', 'dropIdempotencyTable'],
  'fastify-idempotency/conformance': ['storageConformance'],
  'fastify-idempotency/standalone': ['createIdempotency', 'MemoryStorage', 'IdempotencyResultNotRecordedError']
}

describe('the packed package', () => {
  it('ships the build, its types and the README, and no sources, tests or docs', async () => {
    const files = (await run('tar', ['-tzf', tarball], root)).split('\n').filter(Boolean)
    for (const file of ['dist/index.js', 'dist/index.cjs', 'dist/index.d.ts', 'dist/index.d.cts', 'README.md', 'CHANGELOG.md']) expect(files).toContain(`package/${file}`)
    // The pages are read in the repository, where the README's links lead.
    expect(files.some((file) => /^package\/(test|lib|docs)\//.test(file))).toBe(false)
  })

  it('ships its licence, and keeps what is for contributors in the repository', async () => {
    const files = (await run('tar', ['-tzf', tarball], root)).split('\n').filter(Boolean)
    expect(files).toContain('package/LICENSE')
    expect(readFileSync(join(installed, 'LICENSE'), 'utf8')).toMatch(/^MIT License\n\nCopyright \(c\) \d{4} The fastify-idempotency contributors\n/)
    expect(files).not.toContain('package/CONTRIBUTING.md')
    expect(files.some((file) => /^package\/(bench|examples|scripts|\.ci)\//.test(file) || file.startsWith('package/dist/cli/'))).toBe(false)
  })

  it('holds its code and its declarations once, in at most 250 kB packed and 1 MB unpacked', async () => {
    // What `npm pack` reports as the package size (the tarball's) and the unpacked size (its files').
    const listing = (await run('tar', ['-tvzf', tarball], root)).split('\n').filter(Boolean)
    const unpacked = listing.reduce((sum, line) => sum + Number(line.trim().split(/\s+/)[2]), 0)
    expect(statSync(tarball).size).toBeLessThanOrEqual(250_000)
    expect(unpacked).toBeLessThanOrEqual(1_000_000)
    const dist = readdirSync(join(installed, 'dist'), { recursive: true, encoding: 'utf8' })
    // One CommonJS build whose entries share chunks, and ES entries that re-export it: what the
    // core defines (the errors' problem type base, say) is written once.
    const code = dist.filter((file) => /\.c?js$/.test(file)).map((file) => readFileSync(join(installed, 'dist', file), 'utf8'))
    expect(code.join('').split(PROBLEM_TYPE_BASE)).toHaveLength(2)
    for (const entry of Object.keys(entries).map((name) => name === 'fastify-idempotency' ? 'index' : name.split('/')[1]!)) {
      expect(readFileSync(join(installed, 'dist', `${entry}.js`), 'utf8'), entry).toMatch(new RegExp(`^export \\{[^}]+\\} from '\\./${entry}\\.cjs';\\n`))
    }
    // Declarations once: a .d.cts for each module, a .d.ts only for each ES entry.
    expect(dist.filter((file) => file.endsWith('.d.ts')).sort()).toEqual(['conformance.d.ts', 'index.d.ts', 'knex.d.ts', 'redis.d.ts', 'standalone.d.ts'])
  })

  it('names its repository, and its CHANGELOG has a section for its version', () => {
    const pkg = JSON.parse(readFileSync(join(installed, 'package.json'), 'utf8')) as { version: string, repository: { url: string }, bugs: { url: string }, homepage: string }
    const repository = 'github.com/fastify-idempotency/fastify-idempotency'
    expect(pkg.repository.url).toBe(`git+https://${repository}.git`)
    expect(pkg.bugs.url).toBe(`https://${repository}/issues`)
    expect(pkg.homepage).toBe(`https://${repository}#readme`)
    expect(readFileSync(join(installed, 'CHANGELOG.md'), 'utf8')).toMatch(new RegExp(`^## ${pkg.version.replace(/\./g, '\\.')}$`, 'm'))
  })

  it('ships the licence of every package its build includes', () => {
    const bundled = [...new Set([tsupConfig as Options].flat().flatMap((options) => (options.noExternal ?? []).map(String)))]
    expect(bundled.length).toBeGreaterThan(0)
    const notices = readFileSync(join(installed, 'THIRD-PARTY-NOTICES.md'), 'utf8')
    for (const name of bundled) {
      expect(notices, name).toContain(`## ${name}\n`)
      expect(notices, name).toContain(readFileSync(join(root, 'node_modules', name, 'LICENSE'), 'utf8'))
    }
  })

  it('depends at run time on what its build imports, and on nothing else', () => {
    const pkg = JSON.parse(readFileSync(join(installed, 'package.json'), 'utf8')) as { dependencies: Record<string, string>, peerDependencies: Record<string, string> }
    const imported = new Set<string>()
    for (const file of readdirSync(join(installed, 'dist'), { recursive: true, encoding: 'utf8' }).filter((name) => /\.c?js$/.test(name))) {
      for (const [, imports, required] of readFileSync(join(installed, 'dist', file), 'utf8').matchAll(/\bfrom\s*["']([^"'./][^"']*)["']|\b(?:import|require)\s*\(\s*["']([^"'./][^"']*)["']\s*\)/g)) {
        const specifier = (imports ?? required)!
        const name = specifier.startsWith('@') ? specifier.split('/').slice(0, 2).join('/') : specifier.split('/')[0]!
        if (!isBuiltin(name)) imported.add(name)
      }
    }
    expect([...imported].filter((name) => !(name in pkg.dependencies) && !(name in pkg.peerDependencies) && name !== 'fastify-idempotency')).toEqual([])
    expect(Object.keys(pkg.dependencies).filter((name) => !imported.has(name))).toEqual([])
  })

  it('accepts, as a peer, every Fastify the README says it is tested with', () => {
    const pkg = JSON.parse(readFileSync(join(installed, 'package.json'), 'utf8')) as { peerDependencies: Record<string, string> }
    const row = readFileSync(join(installed, 'README.md'), 'utf8').split('\n').find((line) => line.startsWith('| Fastify |'))
    // The table's last column: the versions the suite runs on.
    const tested = [...(row?.split('|').at(-2) ?? '').matchAll(/\b\d+\.\d+\.\d+(?:-[\w.]+)?/g)].map(([version]) => version)
    expect(tested.some((version) => semver.major(version) === 5)).toBe(true)
    expect(tested.some((version) => semver.major(version) === 6)).toBe(true)
    for (const version of [...tested, fastifyPackage.version]) expect(semver.satisfies(version, pkg.peerDependencies.fastify!), version).toBe(true)
  })

  it('loads every entry with import', async () => {
    const script = `for (const [name, names] of Object.entries(${JSON.stringify(entries)})) {
      const mod = await import(name)
      for (const n of names) if (mod[n] === undefined) throw new Error(name + ' lacks ' + n)
    }
    const { default: plugin, idempotency } = await import('fastify-idempotency')
    if (plugin !== idempotency) throw new Error('default and named exports differ')
    console.log('ok')`
    expect((await run(process.execPath, ['--input-type=module', '-e', script], consumer)).trim()).toBe('ok')
  })

  it('loads every entry with require, and the main entry loads no store driver', async () => {
    const script = `const entries = ${JSON.stringify(entries)}
    const main = require('fastify-idempotency')
    const loaded = Object.keys(require.cache)
    if (loaded.some((file) => /node_modules[\\\\/](ioredis|knex|pg|mysql2|better-sqlite3)[\\\\/]/.test(file))) throw new Error('the main entry loaded a driver')
    // The plugin itself, its other exports its properties, as @fastify plugins are.
    if (typeof main !== 'function' || main.default !== main || main.idempotency !== main) throw new Error('bad main exports')
    for (const [name, names] of Object.entries(entries)) {
      const mod = require(name)
      for (const n of names) if (mod[n] === undefined) throw new Error(name + ' lacks ' + n)
    }
    console.log('ok')`
    expect((await run(process.execPath, ['-e', script], consumer)).trim()).toBe('ok')
  })

  it('links its pages only to files it ships, or to files and headings of its repository', async () => {
    const pages = (await run('tar', ['-tzf', tarball], root)).split('\n').filter((file) => file.endsWith('.md')).map((file) => join(installed, file.replace(/^package\//, '')))
    // The docs are not shipped: the README's links lead to the repository.
    const { broken, inRepository } = checkLinks(pages, installed, root)
    expect(broken).toEqual([])
    expect(inRepository).toBeGreaterThan(50)
  })

  it.skipIf(runtimeRun)('passes publint and are-the-types-wrong (node10, node16 from ESM and CJS, bundlers)', async () => {
    const bin = (name: string) => join(root, 'node_modules', '.bin', name)
    await run(bin('publint'), ['--strict', installed], root)
    const report = await run(bin('attw'), [tarball, '--format', 'json'], root)
    // node10 too: TypeScript 5 resolves so under `"module": "commonjs"` (NestJS's default), and
    // finds the subpath entries' types through `typesVersions`.
    expect((JSON.parse(report) as { analysis: { problems: unknown[] } }).analysis.problems).toEqual([])
  })

  it('ships the command as its bin, which loads a JavaScript or a TypeScript config module (through the project\'s tsx) and exits', async () => {
    const pkg = JSON.parse(readFileSync(join(installed, 'package.json'), 'utf8')) as { bin: Record<string, string> }
    expect(pkg.bin).toEqual({ 'fastify-idempotency': './dist/cli.cjs' })
    const bin = join(installed, pkg.bin['fastify-idempotency']!)
    expect(await run(process.execPath, [bin, '--help'], consumer)).toMatch(/^Usage: fastify-idempotency <command>/)
    writeFileSync(join(consumer, 'idempotency.config.mjs'), "import { MemoryStorage } from 'fastify-idempotency'\nexport default { storage: new MemoryStorage() }\n")
    // A type annotation: this Node.js loads it only through tsx.
    writeFileSync(join(consumer, 'idempotency.config.ts'), "import { MemoryStorage, type IdempotencyOptions } from 'fastify-idempotency'\nconst options: IdempotencyOptions = { storage: new MemoryStorage() }\nexport default options\n")
    for (const config of ['idempotency.config.mjs', 'idempotency.config.ts']) {
      const listing = JSON.parse(await stdoutOf(process.execPath, [bin, 'in-flight', '--json', '--config', config], consumer)) as unknown
      expect(listing, config).toEqual({ leases: [], complete: true })
    }
  }, scaled(120_000))

  // test/fixtures/consumer/app.ts, as an application's `.mts` and `.cts` (and require.cts) under
  // Node's module settings, or as its `.ts` under a bundler's, with the strictest settings an
  // application is likely to have, with both TypeScript lines.
  const strict = {
    strict: true,
    exactOptionalPropertyTypes: true,
    noUncheckedIndexedAccess: true,
    target: 'es2022',
    types: ['node'],
    typeRoots: [join(root, 'node_modules', '@types')],
    noEmit: true
  }
  const nodeFiles = ['esm.mts', 'cjs.cts', 'require.cts']
  const settings = [
    { name: 'NodeNext', module: 'nodenext', moduleResolution: 'nodenext', files: nodeFiles },
    // @tsconfig/node20's: a CommonJS file there cannot require() an ES module's declarations.
    { name: 'Node16', module: 'node16', moduleResolution: 'node16', files: nodeFiles },
    { name: 'a bundler\'s', module: 'preserve', moduleResolution: 'bundler', files: ['bundler.ts'] }
  ]
  for (const [typescript, line] of [['typescript', '5'], ['typescript7', '7']] as const) {
    for (const { name, files, ...modules } of settings) {
      it.skipIf(!typesOnThisFastify)(`type-checks a strict consumer under ${name} module settings${files === nodeFiles ? ', from ESM and from CommonJS' : ''}, with TypeScript ${line}`, async () => {
        const version = (JSON.parse(readFileSync(join(root, 'node_modules', typescript, 'package.json'), 'utf8')) as { version: string }).version
        expect(version.split('.')[0]).toBe(line)
        const source = readFileSync(join(root, 'test', 'fixtures', 'consumer', 'app.ts'), 'utf8')
        for (const file of ['esm.mts', 'cjs.cts', 'bundler.ts']) writeFileSync(join(consumer, file), source)
        writeFileSync(join(consumer, 'require.cts'), readFileSync(join(root, 'test', 'fixtures', 'consumer', 'require.cts'), 'utf8'))
        // The package's own declarations are checked too (no skipLibCheck).
        const project = join(consumer, `tsconfig.${modules.module}.json`)
        writeFileSync(project, JSON.stringify({ compilerOptions: { ...strict, ...modules }, files }))
        const tsc = join(root, 'node_modules', typescript, 'bin', 'tsc')
        const checked = await exec(process.execPath, [tsc, '-p', project], consumer)
        expect(checked.output).toBe('')
        expect(checked.code).toBe(0)
      }, scaled(120_000))
    }
  }

  it.skipIf(runtimeRun)('builds its declarations with TypeScript 7 as well, the same files as with TypeScript 5', async () => {
    const out = join(work, 'types-7')
    await run(process.execPath, [join(root, 'scripts', 'build-types.mjs'), '--typescript', 'typescript7', '--out-dir', relative(root, out)], root)
    const declarations = (dir: string): string[] => readdirSync(dir, { recursive: true, encoding: 'utf8' }).filter((file) => /\.d\.c?ts$/.test(file)).sort()
    expect(declarations(out)).toEqual(declarations(join(installed, 'dist')))
  }, scaled(120_000))
})
