/**
 * The code samples of the documentation are programs, and this file proves it. Every ```ts block
 * of README.md and docs/**\/*.md is written to .tmp/ (the package's import specifiers rewritten to
 * the sources in lib/), type-checked by one run of the repository's TypeScript compiler with the
 * repository's settings and, when it is a complete program, bundled with the sources it imports
 * and run in a child process with a time limit.
 *
 * What a page can say about a block, on the line just before its fence (HTML comments, which do
 * not show on the rendered page):
 *
 * - `<!-- fragment -->`: not a program on its own (a one-line illustration of an option, say). It
 *   is type-checked appended to the page's previous complete block, in a block scope of its own
 *   with its imports hoisted, and it is never run.
 * - `<!-- no-run: why -->`: a complete program that needs what no test machine has (a Redis
 *   Cluster, say). It is type-checked only, and its run is reported as skipped with the reason.
 *
 * A block whose first line is a comment naming a file (`// map-storage.ts`) is written under that
 * name, so that a later block of the same page can import it (`./map-storage.js`). A block that
 * only declares (imports, types, classes, functions) is type-checked and not run: it does nothing.
 *
 * A `console.log(...)` line with a trailing comment claims what it prints: the comment is the line
 * printed, with `…` standing for any text. A run passes when it exits with 0 within the time limit
 * and every claim of the block appears in its output, in order.
 *
 * Samples that use Redis (ioredis, @fastify/redis, bullmq), PostgreSQL (`client: 'pg'`,
 * DATABASE_URL), RabbitMQ (amqplib) or NATS (@nats-io/*) run against the local services of
 * test/helpers/services.ts, and are skipped with the reason when one is down (a failure under
 * CI=true); their queues and streams are named uniquely, since several suites run at once.
 * `DATABASE_URL` points at a PostgreSQL schema of this run's own, dropped at the end, and the Redis
 * keys that appear under the store's default prefix while the samples run are deleted at the end.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { dirname, join, relative, resolve, sep } from 'node:path'
import { Redis } from 'ioredis'
import knexFactory, { type Knex } from 'knex'
import { bundle } from './helpers/bundle.js'
import { killChildren, runChild } from './helpers/child-run.js'
import { MARIADB, NATS, POSTGRES, RABBITMQ, REDIS, pgConnection, service, type Availability, type ServiceConfig } from './helpers/services.js'
import { scaled } from './helpers/pace.js'

const root = resolve(import.meta.dirname, '..')
const work = join(root, '.tmp', `docs-samples-${process.pid}`)
/** A run that takes longer than this is killed and fails (30 s on a quiet machine: helpers/pace.ts). */
const RUN_LIMIT_MS = scaled(30_000)
/** The one compiler run for every sample. */
const COMPILE_LIMIT_MS = scaled(120_000)
/** Runs at a time: the compiler and the other test files share the cores. */
const PARALLEL_RUNS = 3

/** The package's entry points, as package.json exports them, and their sources. */
const ENTRY_POINTS: Record<string, string> = {
  'fastify-idempotency': 'lib/index.js',
  'fastify-idempotency/redis': 'lib/redis.js',
  'fastify-idempotency/knex': 'lib/knex.js',
  'fastify-idempotency/conformance': 'lib/storage/conformance.js',
  'fastify-idempotency/standalone': 'lib/standalone.js'
}

interface Sample {
  /** The page, relative to the repository, and the line of the block's opening fence. */
  page: string
  line: number
  id: string
  code: string[]
  fragment: boolean
  /** Why a complete block is not run, or null. */
  noRun: string | null
  /** For a fragment: the page's previous complete block. */
  context: Sample | null
  /** The generated file, and for each of its lines the page's line it came from. */
  file: string
  origin: Array<number | null>
  needs: ServiceConfig[]
}

function pages (): string[] {
  const found: string[] = ['README.md']
  const walk = (dir: string) => {
    for (const entry of readdirSync(join(root, dir), { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
      const path = `${dir}/${entry.name}`
      if (entry.isDirectory()) walk(path)
      else if (entry.name.endsWith('.md')) found.push(path)
    }
  }
  walk('docs')
  return found
}

/** Problems with the Markdown itself (an unknown marker, two blocks naming one file). */
const markupProblems: string[] = []

function parsePage (page: string): Sample[] {
  const lines = readFileSync(join(root, page), 'utf8').split('\n')
  const samples: Sample[] = []
  const names = new Set<string>()
  let lastComplete: Sample | null = null
  for (let i = 0; i < lines.length; i++) {
    const open = /^( *)(`{3,}|~{3,})\s*([\w-]*)/.exec(lines[i]!)
    if (open === null) continue
    const [, indent = '', fence = '', lang = ''] = open
    let end = i + 1
    while (end < lines.length) {
      const close = /^ *(`{3,}|~{3,})\s*$/.exec(lines[end]!)
      if (close !== null && close[1]![0] === fence[0] && close[1]!.length >= fence.length) break
      end++
    }
    const body = lines.slice(i + 1, end).map((text) => text.startsWith(indent) ? text.slice(indent.length) : text.trimStart())
    const fenceLine = i + 1
    i = end
    if (lang !== 'ts' && lang !== 'typescript') continue

    const id = `${page}:${fenceLine}`
    const marker = (lines[fenceLine - 2] ?? '').trim()
    let fragment = false
    let noRun: string | null = null
    if (marker.startsWith('<!--')) {
      const text = marker.replace(/^<!--\s*|\s*-->$/g, '')
      if (text === 'fragment') fragment = true
      else if (/^no-run:\s*\S/.test(text)) noRun = text.replace(/^no-run:\s*/, '')
      else markupProblems.push(`${id}: unknown marker ${marker} (use <!-- fragment --> or <!-- no-run: why -->)`)
    } else if (marker === '' && /^<!--\s*(fragment|no-run:)/.test((lines[fenceLine - 3] ?? '').trim())) {
      markupProblems.push(`${id}: a marker must be on the line just before the fence, without a blank line`)
    }

    const named = /^\/\/\s*([\w.-]+\.ts)\s*$/.exec(body[0] ?? '')
    const name = named?.[1] ?? `L${fenceLine}${fragment ? '.fragment' : ''}.ts`
    if (names.has(name)) markupProblems.push(`${id}: a second block named ${name} on the page`)
    names.add(name)
    const file = join(work, page.replace(/\.md$/, '').replaceAll('/', '__'), name)
    const text = body.join('\n')
    const needs: ServiceConfig[] = []
    if (/from '(ioredis|iovalkey|redis|@fastify\/redis|@valkey\/valkey-glide)'/.test(text)) needs.push(REDIS)
    if (/client: 'pg'|DATABASE_URL/.test(text)) needs.push(POSTGRES)
    if (/client: 'mysql2?'/.test(text)) needs.push(MARIADB)
    if (/from 'amqplib'/.test(text)) needs.push(RABBITMQ)
    if (/from '@nats-io\//.test(text)) needs.push(NATS)
    if (/from 'bullmq'/.test(text) && !needs.includes(REDIS)) needs.push(REDIS)

    const sample: Sample = { page, line: fenceLine, id, code: body, fragment, noRun, context: fragment ? lastComplete : null, file, origin: [], needs }
    samples.push(sample)
    if (!fragment) lastComplete = sample
  }
  return samples
}

/** Point the package's own import specifiers at the sources in lib/, relative to `file`. */
function rewriteImports (line: string, file: string): string {
  return line.replace(/(\bfrom\s*|\bimport\s*\(?\s*)(['"])(fastify-idempotency(?:\/[\w-]+)?)\2/g, (match, before: string, quote: string, specifier: string) => {
    const target = ENTRY_POINTS[specifier]
    if (target === undefined) return match
    let path = relative(dirname(file), join(root, target)).split(sep).join('/')
    if (!path.startsWith('.')) path = `./${path}`
    return `${before}${quote}${path}${quote}`
  })
}

/** Split a block into its import statements (which may span lines) and the rest. */
function splitImports (code: string[]): { imports: Array<{ lines: string[], first: number }>, rest: Array<{ text: string, index: number }> } {
  const imports: Array<{ lines: string[], first: number }> = []
  const rest: Array<{ text: string, index: number }> = []
  for (let i = 0; i < code.length; i++) {
    if (/^import[\s{]/.test(code[i]!)) {
      const first = i
      while (i < code.length - 1 && !/from\s*['"][^'"]+['"]|^import\s*['"]/.test(code[i]!)) i++
      imports.push({ lines: code.slice(first, i + 1), first })
    } else {
      rest.push({ text: code[i]!, index: i })
    }
  }
  return { imports, rest }
}

function generate (sample: Sample): string {
  const lines: string[] = []
  const origin: Array<number | null> = []
  const push = (text: string, from: number | null) => { lines.push(rewriteImports(text, sample.file)); origin.push(from) }
  if (!sample.fragment) {
    sample.code.forEach((text, index) => push(text, sample.line + 1 + index))
  } else {
    const context = sample.context
    if (context !== null) context.code.forEach((text, index) => push(text, context.line + 1 + index))
    const seen = new Set(lines)
    const { imports, rest } = splitImports(sample.code)
    for (const statement of imports) {
      const rewritten = statement.lines.map((text) => rewriteImports(text, sample.file))
      if (rewritten.length === 1 && seen.has(rewritten[0]!)) continue
      statement.lines.forEach((text, offset) => push(text, sample.line + 1 + statement.first + offset))
    }
    push('{', null)
    for (const { text, index } of rest) push(text, sample.line + 1 + index)
    push('}', null)
  }
  push('export {}', null)
  sample.origin = origin
  return lines.join('\n') + '\n'
}

/** A few runs at a time. */
let running = 0
const queue: Array<() => void> = []
async function limited<T> (task: () => Promise<T>): Promise<T> {
  if (running >= PARALLEL_RUNS) await new Promise<void>((resolve) => queue.push(resolve))
  running++
  try {
    return await task()
  } finally {
    running--
    queue.shift()?.()
  }
}

/** A block that only declares (imports, types, classes, functions): running it would do nothing. */
function declaresOnly (sample: Sample): boolean {
  return sample.code.every((line) => !/^\S/.test(line) || /^(import|export|interface|type|class|(async )?function|declare|\/\/|\/\*|\*|\}|\))/.test(line))
}

/** The output claims of a block: the trailing comments of its `console.log(...)` lines. */
function claims (sample: Sample): string[] {
  const found: string[] = []
  for (const line of sample.code) {
    const claim = /^\s*(?:await\s+)?console\.log\(.*\)\s+\/\/ (.+)$/.exec(line)
    if (claim !== null) found.push(claim[1]!.trim())
  }
  return found
}

/** The claims not printed, in order: each must match a later line of the output than the last. */
function unmetClaims (expected: string[], output: string): string[] {
  const lines = output.split('\n').map((line) => line.trimEnd())
  const unmet: string[] = []
  let at = 0
  for (const claim of expected) {
    const pattern = new RegExp(`^${claim.split('…').map((part) => part.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')).join('.*')}$`)
    const found = lines.findIndex((line, index) => index >= at && pattern.test(line.trim()))
    if (found === -1) unmet.push(claim)
    else at = found + 1
  }
  return unmet
}

const samples = pages().flatMap(parsePage)
const runnable = samples.filter((sample) => !sample.fragment && sample.noRun === null && !declaresOnly(sample))
const needed = [...new Set(runnable.flatMap((sample) => sample.needs))]
const availability = new Map<ServiceConfig, Availability>()
for (const config of needed) availability.set(config, await service(config))
const unavailable = (sample: Sample): string => sample.needs.map((config) => availability.get(config)!).find((a) => !a.available)?.reason ?? ''

const schema = `docs_samples_${process.pid}`
const databaseUrl = `postgres://${pgConnection.user}@${pgConnection.host}:${pgConnection.port}/${pgConnection.database}?options=${encodeURIComponent(`-c search_path=${schema}`)}`
let pg: Knex | undefined
let redis: Redis | undefined
let redisKeysBefore = new Set<string>()
const REDIS_DEFAULT_PREFIX = 'idempotency:'

interface Diagnostic { file: string, line: number, text: string }
let compiled: Promise<{ diagnostics: Diagnostic[], output: string }>

beforeAll(async () => {
  rmSync(work, { recursive: true, force: true })
  for (const sample of samples) {
    mkdirSync(dirname(sample.file), { recursive: true })
    writeFileSync(sample.file, generate(sample))
  }
  writeFileSync(join(work, 'tsconfig.json'), JSON.stringify({
    extends: relative(work, join(root, 'tsconfig.json')).split(sep).join('/'),
    // Nest's decorators (docs/frameworks/nestjs.md) are TypeScript's experimental ones, as in a
    // Nest project's own settings; tsx reads this file too, so the samples run with them.
    compilerOptions: { noEmit: true, incremental: false, experimentalDecorators: true, emitDecoratorMetadata: true },
    include: ['**/*.ts']
  }, null, 2))
  compiled = runChild(process.execPath, [join(root, 'node_modules/typescript/bin/tsc'), '-p', join(work, 'tsconfig.json'), '--pretty', 'false'], { cwd: root, env: process.env, limitMs: COMPILE_LIMIT_MS })
    .then(({ stdout, stderr, timedOut }) => {
      if (timedOut) throw new Error(`tsc did not finish within ${COMPILE_LIMIT_MS} ms`)
      const diagnostics: Diagnostic[] = []
      for (const line of stdout.split('\n')) {
        const head = /^(.+?)\((\d+),\d+\): (error|warning) (TS\d+: .*)$/.exec(line)
        if (head !== null) diagnostics.push({ file: resolve(root, head[1]!), line: Number(head[2]), text: head[4]! })
        else if (line.startsWith(' ') && diagnostics.length > 0) diagnostics.at(-1)!.text += `\n${line}`
      }
      return { diagnostics, output: stdout + stderr }
    })
  // Keep the rejection for the tests that await it.
  compiled.catch(() => {})

  if (availability.get(POSTGRES)?.available === true) {
    pg = knexFactory({ client: 'pg', connection: pgConnection })
    await pg.raw('CREATE SCHEMA IF NOT EXISTS ??', [schema])
  }
  if (availability.get(REDIS)?.available === true) {
    redis = new Redis({ host: REDIS.host, port: REDIS.port })
    redisKeysBefore = new Set(await redis.keys(`${REDIS_DEFAULT_PREFIX}*`))
  }
}, scaled(60_000))

afterAll(async () => {
  killChildren()
  if (pg !== undefined) {
    await pg.raw('DROP SCHEMA IF EXISTS ?? CASCADE', [schema])
    await pg.destroy()
  }
  if (redis !== undefined) {
    const added = (await redis.keys(`${REDIS_DEFAULT_PREFIX}*`)).filter((key) => !redisKeysBefore.has(key))
    if (added.length > 0) await redis.del(...added)
    await redis.quit()
  }
  rmSync(work, { recursive: true, force: true })
}, scaled(60_000))

describe('documentation samples', () => {
  it('are found, and their markers are known', () => {
    expect(samples.length).toBeGreaterThan(20)
    expect(markupProblems).toEqual([])
  })

  // The runs come first, so that they overlap with the compiler, which started in beforeAll.
  for (const sample of samples.filter((s) => !s.fragment)) {
    const notRun = sample.noRun ?? (declaresOnly(sample) ? 'it only declares' : null)
    if (notRun !== null) {
      // Concurrent too, so that it does not split the runs around it into separate batches.
      it.concurrent.skip(`${sample.id} runs [not run: ${notRun}]`, () => {})
      continue
    }
    const reason = unavailable(sample)
    const test = reason === '' ? it.concurrent : it.concurrent.skip
    test(`${sample.id} runs${reason}`, async () => {
      // Bundled with the sources it imports, it starts as plain node (test/helpers/bundle.ts).
      const result = await limited(async () => runChild(process.execPath, [await bundle(sample.file, join(dirname(sample.file), '.bundled'))], {
        cwd: dirname(sample.file), env: { ...process.env, DATABASE_URL: databaseUrl, NO_COLOR: '1' }, limitMs: RUN_LIMIT_MS
      }))
      const report = `exit ${result.code ?? result.signal}${result.timedOut ? ` (killed after ${RUN_LIMIT_MS} ms)` : ''}\n--- stdout\n${result.stdout}--- stderr\n${result.stderr}`
      expect(result.timedOut, report).toBe(false)
      expect(result.code, report).toBe(0)
      expect(unmetClaims(claims(sample), result.stdout), report).toEqual([])
    }, scaled(300_000))
  }

  for (const sample of samples) {
    it(`${sample.id} type-checks${sample.fragment ? ' (a fragment)' : ''}`, async () => {
      const { diagnostics } = await compiled
      const mine = diagnostics
        .filter((d) => d.file === sample.file)
        .map((d) => `${sample.page}:${sample.origin[d.line - 1] ?? `(generated line ${d.line})`}: ${d.text}`)
      expect(mine.join('\n')).toBe('')
    }, COMPILE_LIMIT_MS + 30_000)
  }

  it('the compiler reports nothing outside the samples', async () => {
    const { diagnostics, output } = await compiled
    const files = new Set(samples.map((sample) => sample.file))
    const elsewhere = diagnostics.filter((d) => !files.has(d.file))
    expect(elsewhere.map((d) => `${d.file}:${d.line}: ${d.text}`).join('\n')).toBe('')
    if (diagnostics.length === 0) expect(output.trim()).toBe('')
  }, COMPILE_LIMIT_MS + 30_000)
})
