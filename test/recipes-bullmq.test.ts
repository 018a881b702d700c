/**
 * The BullMQ recipe (docs/jobs.md#bullmq, examples/recipes/bullmq-processor.ts) on the shared
 * Redis: worker processes on a fresh queue prefix, with a short job lock and stalled-job check;
 * the work a charge and a receipt, each a recovery point that pushes its worker's pid on a Redis
 * list. A worker is killed with SIGKILL between the two; BullMQ hands the stalled job to another
 * worker, which completes it: one charge, one receipt.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { Queue } from 'bullmq'
import { Redis } from 'ioredis'
import { REDIS, deleteRedisPrefix, service } from './helpers/services.js'
import { killWorkers, startWorker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'
import { scaled } from './helpers/pace.js'

const redisUp = await service(REDIS)
const PREFIX = `recipes_bull_${process.pid}_${Date.now()}`

describe.skipIf(!redisUp.available)(`BullMQ recipe: a job whose worker is killed mid-job is completed by another, its work done once${redisUp.reason}`, () => {
  let redis: Redis
  const queues: Queue[] = []

  beforeAll(() => { redis = new Redis({ host: REDIS.host, port: REDIS.port }) })

  afterEach(killWorkers)

  afterAll(async () => {
    await killWorkers()
    for (const queue of queues) await queue.close()
    await deleteRedisPrefix(redis, `${PREFIX}:`)
    await redis.quit()
  })

  const list = async (name: string): Promise<string[]> => await redis.lrange(`${PREFIX}:${name}`, 0, -1)

  it('a worker killed between the charge and the receipt: the stalled job is completed by another worker, with one charge and one receipt', async () => {
    const name = `invoices-${queues.length}`
    const queue = new Queue(name, { connection: { host: REDIS.host, port: REDIS.port }, prefix: PREFIX })
    queues.push(queue)
    const job = await queue.add('invoice', { amount: 4200, email: 'ada@example.com' }, { jobId: 'invoice-1' })

    // The key's lease outlives the job lock by more than a worker takes to start and to pick the
    // stalled job up, on this machine (2 s on a quiet one; helpers/pace.ts).
    const env = { QUEUE: name, PREFIX, LEASE_MS: String(scaled(2000)) }
    const first = await startWorker('bullmq-worker.ts', { ...env, HANG: '1' })
    await first.line(`HANGING ${job.id}`)
    // Ready before the first dies, so that the lease is still held when it takes the job.
    const survivor = await startWorker('bullmq-worker.ts', env)
    await first.kill('SIGKILL')
    // The job lock lapses before the key's lease: the job's next run finds its work still in
    // progress, and puts the job off without spending an attempt.
    await survivor.line(`DELAYED ${job.id} `)
    const completed = await survivor.line(`COMPLETED ${job.id} `)

    const result = { charge: { id: 'ch_invoice-1', amount: 4200 }, receipt: { sentTo: 'ada@example.com' } }
    expect(JSON.parse(completed.split(' ').slice(2).join(' '))).toEqual(result)
    expect(await list(`charges:${job.id}`)).toEqual([String(first.pid)])
    expect(await list(`receipts:${job.id}`)).toEqual([String(survivor.pid)])
    const done = await queue.getJob(job.id!)
    expect(await done!.getState()).toBe('completed')
    expect(done!.returnvalue).toEqual(result)
    // One attempt, the one that completed it: neither the stall nor the delay spent one.
    expect(done!.attemptsMade).toBe(1)
  })

  /** A fresh queue of this test's own, `invoices-<n>`. */
  function freshQueue (): Queue {
    const queue = new Queue(`invoices-${queues.length}`, { connection: { host: REDIS.host, port: REDIS.port }, prefix: PREFIX })
    queues.push(queue)
    return queue
  }

  it('the work\'s own SyntaxError (a downstream HTML page) after the charge fails that attempt, and BullMQ\'s retry completes the job: one charge, one receipt', async () => {
    const queue = freshQueue()
    const job = await queue.add('invoice', { amount: 4200, email: 'ada@example.com' }, { jobId: 'invoice-3', attempts: 3 })
    const worker = await startWorker('bullmq-worker.ts', { QUEUE: queue.name, PREFIX, FAIL: 'once' })
    await worker.line(`COMPLETED ${job.id} `)
    expect(worker.lines).toContain(`FAILED ${job.id} SyntaxError 1`)
    expect(await list(`charges:${job.id}`)).toEqual([String(worker.pid)])
    expect(await list(`receipts:${job.id}`)).toEqual([String(worker.pid)])
    expect((await queue.getJob(job.id!))!.attemptsMade).toBe(2)
  })

  it('another job\'s data under a job id that was done: UnrecoverableError, failed without spending its other attempts, and nothing charged again', async () => {
    const queue = freshQueue()
    const worker = await startWorker('bullmq-worker.ts', { QUEUE: queue.name, PREFIX })
    const first = await queue.add('invoice', { amount: 4200, email: 'ada@example.com' }, { jobId: 'invoice-4' })
    await worker.line(`COMPLETED ${first.id} `)
    await first.remove()
    const other = await queue.add('invoice', { amount: 9900, email: 'bob@example.com' }, { jobId: 'invoice-4', attempts: 3 })
    await worker.line(`FAILED ${other.id} UnrecoverableError 1`)
    expect(await (await queue.getJob(other.id!))!.getState()).toBe('failed')
    expect(await list(`charges:${other.id}`)).toEqual([String(worker.pid)])
  })

  it('docs/jobs.md shows the processor this test runs', () => {
    expectDocumented('bullmq-processor.ts')
  })
})
