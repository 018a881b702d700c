/**
 * The memory check: `node --expose-gc --import tsx bench/memory.ts <requests>`, started by
 * bench/run.ts. Drives <requests> NEW requests (a fresh key each) through `app.inject` into the
 * plugin on a `MemoryStorage` with its default bounds, and reports the heap after a full GC and
 * whether the store's `size` stayed within `maxEntries` at every sample.
 */
import Fastify from 'fastify'
import { ExecutionCounter, ROUTE, type OrderBody } from './scenarios/common.js'
import { loadCore } from './scenarios/source.js'

export interface MemoryReport {
  requests: number
  concurrency: number
  seconds: number
  maxEntries: number
  maxBytes: number
  /** After a full GC, before any request. */
  before: { heapUsed: number, external: number, arrayBuffers: number, rss: number }
  /** After a full GC, after the last request. */
  after: { heapUsed: number, external: number, arrayBuffers: number, rss: number }
  /** Highest heapUsed seen at a sample (no GC forced there). */
  peakHeapUsed: number
  finalSize: number
  maxSizeSeen: number
  finalCalculatedSize: number
  finalLeases: number
  sizeWithinBound: boolean
  executions: number
  non201: number
  samples: Array<{ requests: number, size: number, heapUsed: number }>
}

const MAX_ENTRIES_DEFAULT = 100_000
const MAX_BYTES_DEFAULT = 64 * 1024 * 1024

function forceGc (): void {
  const gc = (globalThis as { gc?: () => void }).gc
  if (gc === undefined) throw new Error('run with --expose-gc')
  gc()
  gc()
}

function usage (): MemoryReport['before'] {
  const m = process.memoryUsage()
  return { heapUsed: m.heapUsed, external: m.external, arrayBuffers: m.arrayBuffers, rss: m.rss }
}

const requests = Number(process.argv[2] ?? 100_000)
const concurrency = 32
const { idempotency, idempotencyErrorHandler, MemoryStorage } = await loadCore()
const storage = new MemoryStorage()
const app = Fastify({ logger: false })
const counter = new ExecutionCounter()
await app.register(idempotency, { storage })
app.setErrorHandler(idempotencyErrorHandler())
app.post(ROUTE, { config: { idempotency: true } }, async (request, reply) => {
  // Executions are counted, not remembered per key: a million keys in the counter would be
  // measured as the store's memory.
  counter.executions++
  const body = request.body as OrderBody
  reply.code(201)
  return { id: counter.executions, status: 'created', amount: body.amount, currency: body.currency }
})
await app.ready()

forceGc()
const before = usage()
const payload = JSON.stringify({ amount: 4200, currency: 'eur', item: 'book' })
const sampleEvery = Math.max(1, Math.floor(requests / 50))
const samples: MemoryReport['samples'] = []
let next = 0
let non201 = 0
let maxSizeSeen = 0
let peakHeapUsed = before.heapUsed
const started = performance.now()

async function worker (): Promise<void> {
  while (next < requests) {
    const n = next++
    const response = await app.inject({
      method: 'POST',
      url: ROUTE,
      headers: { 'content-type': 'application/json', 'idempotency-key': `m-${n}` },
      payload
    })
    if (response.statusCode !== 201) non201++
    if (storage.size > maxSizeSeen) maxSizeSeen = storage.size
    if (n % sampleEvery === 0) {
      const heapUsed = process.memoryUsage().heapUsed
      if (heapUsed > peakHeapUsed) peakHeapUsed = heapUsed
      samples.push({ requests: n, size: storage.size, heapUsed })
    }
  }
}

await Promise.all(Array.from({ length: concurrency }, worker))
const seconds = (performance.now() - started) / 1000
forceGc()
const after = usage()

const report: MemoryReport = {
  requests,
  concurrency,
  seconds,
  maxEntries: MAX_ENTRIES_DEFAULT,
  maxBytes: MAX_BYTES_DEFAULT,
  before,
  after,
  peakHeapUsed,
  finalSize: storage.size,
  maxSizeSeen,
  finalCalculatedSize: storage.calculatedSize,
  finalLeases: storage.leases,
  sizeWithinBound: maxSizeSeen <= MAX_ENTRIES_DEFAULT && storage.calculatedSize <= MAX_BYTES_DEFAULT,
  executions: counter.executions,
  non201,
  samples
}
await app.close()
if (process.send !== undefined) {
  process.send(report, () => process.exit(0))
} else {
  console.log(JSON.stringify(report, null, 2))
}
