/**
 * The scheduled-job recipe (docs/jobs.md#scheduled-jobs, examples/recipes/scheduled-job.ts): two
 * instances of an app, each a process with the plugin on one KnexStorage table of the shared
 * PostgreSQL, fire the same job for the same time at once. One runs it (one report row, counted in
 * PostgreSQL); the other is told it runs elsewhere and skips; an instance that fires after it ended
 * gets its kept result.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { MemoryStorage } from '../lib/storage/memory.js'
import { createIdempotency } from '../lib/standalone.js'
import { dueAt, runScheduled } from '../examples/recipes/scheduled-job.js'
import { Gate } from './helpers/gate.js'
import { POSTGRES, pgConnection, service } from './helpers/services.js'
import { killWorkers, startWorker, type Worker } from './helpers/workers.js'
import { expectDocumented } from './helpers/recipes.js'

const postgres = await service(POSTGRES)
const run = `${process.pid}_${Date.now()}`
const STORE_TABLE = `recipes_cron_keys_${run}`
const REPORTS_TABLE = `recipes_cron_reports_${run}`

describe.skipIf(!postgres.available)(`Scheduled-job recipe: two instances fire a job at once, one runs it${postgres.reason}`, () => {
  let knex: Knex

  beforeAll(async () => {
    knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
    await createIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.createTable(REPORTS_TABLE, (t) => { t.increments('id'); t.string('due').notNullable(); t.integer('pid').notNullable() })
  })

  afterEach(killWorkers)

  afterAll(async () => {
    await killWorkers()
    await dropIdempotencyTable(knex, STORE_TABLE)
    await knex.schema.dropTable(REPORTS_TABLE)
    await knex.destroy()
  })

  const instance = (): Promise<Worker> => startWorker('cron-instance.ts', { STORE_TABLE, REPORTS_TABLE })
  const tickOf = async (worker: Worker, due: string): Promise<unknown> => JSON.parse((await worker.line(`TICK ${due} `)).slice(`TICK ${due} `.length))

  it('one instance runs it, the other skips it as running elsewhere, and a later tick gets the kept result', async () => {
    const instances = await Promise.all([instance(), instance()])
    const due = dueAt(60_000).toISOString()
    for (const worker of instances) worker.send(`TICK ${due}`)
    const { worker: runner } = await Promise.any(instances.map(async (worker) => ({ worker, line: await worker.line(`RUNNING ${due}`) })))
    const other = instances.find((worker) => worker !== runner)!
    expect(await tickOf(other, due)).toEqual({ ran: 'elsewhere' })

    runner.send(`FINISH ${due}`)
    const ran = await tickOf(runner, due) as { ran: string, result: { report: number, by: number } }
    expect(ran).toEqual({ ran: 'here', result: { report: expect.any(Number), by: runner.pid } })

    other.send(`TICK ${due}`)
    await other.line(`TICK ${due} {"ran":"before"`)
    expect(other.lines.filter((line) => line.startsWith(`TICK ${due}`)).map((line) => JSON.parse(line.slice(`TICK ${due} `.length)))).toEqual([{ ran: 'elsewhere' }, { ran: 'before', result: ran.result }])
    expect(await knex(REPORTS_TABLE).where({ due }).select('id', 'pid')).toEqual([{ id: ran.result.report, pid: runner.pid }])
  })

  it('with wait: true, a tick that comes while the job runs waits for it and gets its kept result', async () => {
    const storage = new MemoryStorage()
    // The waiting instance's store, which says when it first found the run in flight.
    let found!: () => void
    const foundInFlight = new Promise<void>((resolve) => { found = resolve })
    const seen = Object.create(storage) as MemoryStorage
    seen.begin = async (...args) => {
      const result = await storage.begin(...args)
      if (result.state === 'in-flight') found()
      return result
    }
    const [runner, waiter] = [createIdempotency({ storage }), createIdempotency({ storage: seen, wait: true })]
    const gate = new Gate()
    let runs = 0
    const report = async () => { await gate.hold(); return { report: ++runs } }
    const due = dueAt(60_000)
    const first = runScheduled(runner, 'report', due, report)
    await gate.entered
    const second = runScheduled(waiter, 'report', due, report)
    await foundInFlight
    gate.open()
    expect(await Promise.all([first, second])).toEqual([{ ran: 'here', result: { report: 1 } }, { ran: 'before', result: { report: 1 } }])
    await Promise.all([runner.close(), waiter.close(), storage.close()])
  })

  it('the instances name a run by the time it is due, rounded to the period: timers that disagree by less than half a period agree', () => {
    const minute = 60_000
    const due = Date.UTC(2026, 10, 27, 3, 0)
    expect(dueAt(minute, due - 29_000)).toEqual(new Date(due))
    expect(dueAt(minute, due + 29_000)).toEqual(new Date(due))
    expect(dueAt(minute, due + 31_000)).toEqual(new Date(due + minute))
  })

  it('docs/jobs.md shows the function these tests run', () => {
    expectDocumented('scheduled-job.ts')
  })
})
