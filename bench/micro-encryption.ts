/**
 * In-process microbenchmark of encryption at rest and of the memory store's request path: ns per
 * operation, the median of several runs of many iterations each, so that a loaded machine moves
 * the figures less than a socket benchmark.
 *
 *   npx tsx bench/micro-encryption.ts                    # lib/ alone
 *   npx tsx bench/micro-encryption.ts <dir> [<dir> ...]  # also other copies of encryption.ts and
 *                                                        # storage/memory.ts, runs interleaved
 *
 * A copy of an earlier version, for instance (its imports pointed back at lib/):
 *   mkdir -p bench/results/before && git show <commit>:lib/encryption.ts |
 *     sed "s#'./storage/#'../../../lib/storage/#" > bench/results/before/encryption.ts
 *   git show <commit>:lib/storage/memory.ts | sed "s#'./#'../../../lib/storage/#" > bench/results/before/memory.ts
 *
 * Instruction counts, which the machine's load does not move: `MICRO_CASE=<name> MICRO_COUNT=<n>`
 * runs one case of the first subject once, after a fixed warm-up, and nothing else; run it under
 * `valgrind --tool=callgrind` with two counts and divide the difference of the totals by the
 * difference of the counts (bench/micro-instructions.sh does).
 *
 * The response is the benchmark route's (`201`, a small JSON body, no other header); the storage
 * key is a keyed hash, as it is with encryption on.
 */
import { execFileSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { resolve } from 'node:path'
import { pathToFileURL } from 'node:url'
import type { StoredResponse } from '../lib/storage/types.js'

interface Cipher {
  hashKey: (composed: string) => string
  seal: (storageKey: string, response: StoredResponse) => StoredResponse
  open: (storageKey: string, entry: StoredResponse) => StoredResponse
}
interface Store {
  begin: (key: string, fingerprint: string, lockTimeout: number) => Promise<{ state: string, token?: string }>
  complete: (key: string, token: string, response: StoredResponse, expiration: number) => Promise<boolean>
}
interface Subject { name: string, cipher: Cipher, store: () => Store }

const ITERATIONS = Number(process.env.MICRO_ITERATIONS ?? 20_000)
const RUNS = Number(process.env.MICRO_RUNS ?? 9)

const response: StoredResponse = {
  statusCode: 201,
  contentType: 'application/json; charset=utf-8',
  headers: {},
  body: Buffer.from(JSON.stringify({ id: 123456, status: 'created', amount: 4200, currency: 'eur' }))
}
const large: StoredResponse = { ...response, headers: { etag: '"abc"', 'x-request-id': 'r-1' }, body: randomBytes(16 * 1024) }
const options = { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) }

async function load (dir: string, name: string): Promise<Subject> {
  const encryption = await import(pathToFileURL(resolve(dir, 'encryption.ts')).href) as { ResponseCipher: new (o: typeof options) => Cipher }
  const memoryPath = resolve(dir, dir.endsWith('lib') ? 'storage/memory.ts' : 'memory.ts')
  const memory = await import(pathToFileURL(memoryPath).href) as { MemoryStorage: new () => Store }
  return { name, cipher: new encryption.ResponseCipher(options), store: () => new memory.MemoryStorage() }
}

type Case = (subject: Subject) => (i: number) => unknown | Promise<unknown>

const cases: Record<string, Case> = {
  // What the harness itself costs per operation (instruction counts include it).
  noop: () => () => undefined,
  hashKey: ({ cipher }) => (i) => cipher.hashKey(`scope-of-someone\nkey-${i}`),
  'seal (route response)': ({ cipher }) => () => cipher.seal('\u0000hmac:RbOZgJRPz04_D6wv1ri4fT-O0b9UhFshwNZr9BclMVc', response),
  'open (route response)': ({ cipher }) => {
    const sealed = cipher.seal('\u0000hmac:RbOZgJRPz04_D6wv1ri4fT-O0b9UhFshwNZr9BclMVc', response)
    return () => cipher.open('\u0000hmac:RbOZgJRPz04_D6wv1ri4fT-O0b9UhFshwNZr9BclMVc', sealed)
  },
  'seal (16 KiB)': ({ cipher }) => () => cipher.seal('k', large),
  'open (16 KiB)': ({ cipher }) => {
    const sealed = cipher.seal('k', large)
    return () => cipher.open('k', sealed)
  },
  'memory NEW: begin + complete': ({ store }) => {
    const storage = store()
    return async (i) => {
      const key = `key-${i}-${Math.random()}`
      const begun = await storage.begin(key, 'fp', 30_000)
      await storage.complete(key, begun.token!, response, 86_400_000)
    }
  },
  'memory REPLAY: begin': ({ store }) => {
    const storage = store()
    let ready: Promise<unknown> | null = (async () => {
      const begun = await storage.begin('replay', 'fp', 30_000)
      await storage.complete('replay', begun.token!, response, 86_400_000)
    })()
    return async () => {
      if (ready !== null) { await ready; ready = null }
      return await storage.begin('replay', 'fp', 30_000)
    }
  },
  'sealed NEW: hashKey + seal + begin + complete': ({ cipher, store }) => {
    const storage = store()
    return async (i) => {
      const key = cipher.hashKey(`key-${i}-${Math.random()}`)
      const begun = await storage.begin(key, 'fp', 30_000)
      await storage.complete(key, begun.token!, cipher.seal(key, response), 86_400_000)
    }
  }
}

async function time (run: (i: number) => unknown, iterations: number): Promise<number> {
  const start = process.hrtime.bigint()
  for (let i = 0; i < iterations; i++) {
    const result = run(i)
    if (result instanceof Promise) await result
  }
  return Number(process.hrtime.bigint() - start) / iterations
}

function median (values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.floor(sorted.length / 2)]!
}

const dirs = process.argv.slice(2)
const subjects = [await load(resolve(import.meta.dirname, '../lib'), 'lib')]
for (const dir of dirs) subjects.push(await load(resolve(dir), dir))

if (process.env.MICRO_CASE !== undefined) {
  const make = cases[process.env.MICRO_CASE]
  if (make === undefined) throw new Error(`no case ${process.env.MICRO_CASE}: ${Object.keys(cases).join(', ')}`)
  const subject = subjects.at(-1)!
  const run = make(subject)
  await time(run, 3000)
  // A collection now, so that the measured loop starts from the same heap whatever came before.
  ;(globalThis as { gc?: () => void }).gc?.()
  // Under callgrind (started with --instr-atstart=no), count the measured loop alone.
  const callgrind = (on: boolean): void => { if (process.env.MICRO_CALLGRIND === '1') execFileSync('callgrind_control', ['-i', on ? 'on' : 'off', String(process.pid)], { stdio: 'ignore' }) }
  callgrind(true)
  await time(run, Number(process.env.MICRO_COUNT ?? 0))
  callgrind(false)
  process.exit(0)
}

console.log(`${ITERATIONS} iterations, median of ${RUNS} runs (min-max), ns/op; node ${process.version}`)
for (const [name, make] of Object.entries(cases)) {
  const runs = subjects.map((subject) => ({ subject, run: make(subject), ns: [] as number[] }))
  for (const entry of runs) await time(entry.run, Math.min(ITERATIONS, 5000))
  for (let round = 0; round < RUNS; round++) {
    // Interleaved, so that the machine's load falls on every subject alike.
    for (const entry of round % 2 === 0 ? runs : [...runs].reverse()) entry.ns.push(await time(entry.run, ITERATIONS))
  }
  const figures = runs.map(({ subject, ns }) => `${subject.name}: ${median(ns).toFixed(0)} (${Math.min(...ns).toFixed(0)}-${Math.max(...ns).toFixed(0)})`)
  console.log(`${name.padEnd(48)} ${figures.join('   ')}`)
}
