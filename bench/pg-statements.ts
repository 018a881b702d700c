/**
 * What each PostgreSQL statement of the hot path costs PostgreSQL itself: `npm run bench:pg-statements`.
 *
 * The HTTP benchmark gives the store's first requests as a ratio of the floor's; on 2 cores shared
 * by the load generator, the server and the database, that ratio is set by the CPU each side
 * spends per request. This measures the database's side, statement by statement, with no HTTP:
 * 50 callers in flight through one knex pool (its default, as in the benchmark), each statement
 * run `--ops` times on fresh keys, and the CPU time (user + system, from /proc) of this run's own
 * server processes (the backends of its connections) and of the server's background processes
 * (WAL writer, checkpointer, ...), divided by the statements run: other clients' backends on a
 * shared server are not counted. Rounds are interleaved and the median is printed (after a round
 * that warms up and is not counted). It needs PostgreSQL on this machine (Linux), since it reads
 * its processes.
 *
 *   floor INSERT / UPDATE / SELECT        the floor's statements, through knex, as the benchmark's floor runs them
 *   begin (first request), complete,      the store's own, through KnexStorage
 *   begin (replay)
 *   table variants                        the store's begin and complete on the same table with
 *                                         other indexes (what each index costs a first request):
 *     as created                          createIdempotencyTable's: the primary key, the expiry
 *                                         index, the in-flight index
 *     expiry index of completed rows      the expiry index partial (WHERE state = 'completed'): a
 *                                         first begin does not write it
 *     one (state, expires_at) index       instead of the expiry and in-flight indexes
 *     primary key only                    no secondary index (what no purge could use)
 *     primary key only, fillfactor 70     ... with room for complete's row in its page
 *
 *   begin variants (--begin-variants)     what `begin` would cost without parts of what it does,
 *                                         on the store's table (prepared, like the store's):
 *     guarded INSERT                      inserts only when no live row exists; no takeover of an
 *                                         expired row, does not return the live row
 *     guarded INSERT ... ON CONFLICT      takes over an expired row; does not return the live row
 *     CTE without ON CONFLICT             returns the live row; no takeover
 *
 *   --ops N            statements per measurement (default 30,000)
 *   --rounds N         interleaved rounds (default 3)
 *   --begin-variants   measure the begin variants too
 */
import { readdirSync, readFileSync } from 'node:fs'
import { parseArgs } from 'node:util'
import knexFactory from 'knex'
import { KnexStorage, createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { onConnection } from '../lib/storage/knex/connection.js'
import type { PgConnection } from '../lib/storage/knex/postgres.js'
import { expiryIndexName, inFlightIndexName } from '../lib/storage/knex/schema.js'
import { benchEnv } from './scenarios/common.js'

const { values: args } = parseArgs({ options: { ops: { type: 'string' }, rounds: { type: 'string' }, 'begin-variants': { type: 'boolean' } } })
const OPS = Number(args.ops ?? 30_000)
const ROUNDS = Number(args.rounds ?? 3)
const IN_FLIGHT = 50
const TICK_US = 10_000 // /proc times are in clock ticks, 100 per second on Linux

/** The server processes of this run's connections (their backend pids). */
const backends = new Set<number>()

/** CPU time of this run's backends and of the server's background processes, in clock ticks. */
function databaseTicks (): number {
  let total = 0
  for (const pid of readdirSync('/proc')) {
    if (!/^\d+$/.test(pid)) continue
    let stat: string
    let command: string
    try {
      stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
      command = readFileSync(`/proc/${pid}/cmdline`, 'utf8')
    } catch { continue }
    const name = stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')'))
    if (!name.startsWith('postgres')) continue
    // Another client's backend ("postgres: 15/main: user db host(port) ..."): not ours to count.
    const clientBackend = /\(\d+\)|\[local\]/.test(command)
    if (clientBackend && !backends.has(Number(pid))) continue
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
    total += Number(fields[11]) + Number(fields[12])
  }
  return total
}

const env = benchEnv()
const knex = knexFactory({
  client: 'pg',
  connection: env.pg,
  pool: {
    // Each connection's backend, so that only this run's server processes are counted.
    afterCreate: (connection: { query: (sql: string, done: (error: Error | null, result: { rows: Array<{ pid: number }> }) => void) => void }, done: (error: Error | null, connection: unknown) => void) => {
      connection.query('SELECT pg_backend_pid() AS pid', (error, result) => {
        if (error === null) backends.add(result.rows[0]!.pid)
        done(error, connection)
      })
    }
  }
})
const table = `bench_statements_${env.tag}`.replace(/\W/g, '_')
const floorTable = `${table}_floor`
const storage = new KnexStorage({ knex, tableName: table, createTable: true })
const body = Buffer.from(JSON.stringify({ id: 'ord_0001', amount: 1234, currency: 'usd', status: 'created' }))
const response = { statusCode: 201, contentType: 'application/json; charset=utf-8', headers: {}, body }
const FINGERPRINT = 'a'.repeat(64)
const LEASE = 60_000

/** The store's clock expression and the prepared variants of `begin` (see the file's comment). */
const N = '(extract(epoch from clock_timestamp()) * 1000)::bigint'
const insertInto = `INSERT INTO "${table}" AS cur (idempotency_key, fingerprint, state, token, lease_end, expires_at)
  SELECT $1::bytea, $2::text, 'in_flight', $3::text, ${N} + $4::bigint, ${N} + $4::bigint`
const liveRow = `SELECT fingerprint, state, lease_end, status_code, content_type, headers, body FROM "${table}" WHERE idempotency_key = $1 AND expires_at > ${N}`
const takeover = `ON CONFLICT (idempotency_key) DO UPDATE SET fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token,
    lease_end = ${N} + $4::bigint, expires_at = ${N} + $4::bigint, status_code = NULL, content_type = NULL, headers = NULL, body = NULL, waiting = false
  WHERE cur.expires_at <= ${N}`
const VARIANTS: Record<string, string> = {
  'guarded INSERT': `${insertInto} WHERE NOT EXISTS (${liveRow}) RETURNING 1`,
  'guarded INSERT ... ON CONFLICT': `${insertInto} WHERE NOT EXISTS (${liveRow}) ${takeover} RETURNING 1`,
  'CTE without ON CONFLICT': `WITH live AS (${liveRow}), taken AS (${insertInto} WHERE NOT EXISTS (SELECT 1 FROM live) RETURNING 1)
SELECT (SELECT count(*) FROM taken)::integer AS taken, live.* FROM (VALUES (1)) AS one LEFT JOIN live ON true`
}

/** The same table with other indexes: each variant's statements, run on a table created as the store creates it. */
const TABLE_VARIANTS: Array<{ name: string, change: (t: string) => string[] }> = [
  { name: 'as created', change: () => [] },
  {
    name: 'expiry index of completed rows',
    change: (t) => [`DROP INDEX "${expiryIndexName(t)}"`, `CREATE INDEX "${t}_done_idx" ON "${t}" (expires_at) WHERE state = 'completed'`]
  },
  {
    name: 'one (state, expires_at) index',
    change: (t) => [`DROP INDEX "${expiryIndexName(t)}"`, `DROP INDEX "${inFlightIndexName(t)}"`, `CREATE INDEX "${t}_state_idx" ON "${t}" (state, expires_at)`]
  },
  { name: 'primary key only', change: (t) => [`DROP INDEX "${expiryIndexName(t)}"`, `DROP INDEX "${inFlightIndexName(t)}"`] },
  {
    name: 'primary key only, fillfactor 70',
    change: (t) => [`DROP INDEX "${expiryIndexName(t)}"`, `DROP INDEX "${inFlightIndexName(t)}"`, `ALTER TABLE "${t}" SET (fillfactor = 70)`]
  }
]
const variantTables = TABLE_VARIANTS.map(({ name, change }, index) => ({ name, table: `${table}_v${index}`, change }))
const variantStorages = variantTables.map(({ table }) => new KnexStorage({ knex, tableName: table }))

/** A variant as the store sends its own: prepared, on a pooled connection directly. */
async function prepared (name: string, text: string, values: unknown[]): Promise<void> {
  await onConnection<PgConnection, unknown>(knex, 0, async (connection) => await connection.query({ name: `bench_${name.replace(/\W/g, '_')}`, text, values }))
}

/** One measurement: `run(i)` for i in 0..OPS-1, IN_FLIGHT at a time; database and Node CPU per call. */
async function measure (run: (i: number) => Promise<void>): Promise<{ database: number, node: number }> {
  let next = 0
  const caller = async (): Promise<void> => { while (next < OPS) await run(next++) }
  const ticks = databaseTicks()
  const cpu = process.cpuUsage()
  await Promise.all(Array.from({ length: IN_FLIGHT }, caller))
  const used = process.cpuUsage(cpu)
  return { database: (databaseTicks() - ticks) * TICK_US / OPS, node: (used.user + used.system) / OPS }
}

const results = new Map<string, Array<{ database: number, node: number }>>()
let warmingUp = true
const record = (name: string, value: { database: number, node: number }): void => {
  if (!warmingUp) results.set(name, [...(results.get(name) ?? []), value])
}

await knex.schema.dropTableIfExists(floorTable)
await knex.schema.createTable(floorTable, (t) => { t.binary('idempotency_key', 1024).primary(); t.string('state', 16).notNullable(); t.binary('body') })
await storage.begin('warm-up', FINGERPRINT, 1) // creates the table
for (const variant of variantTables) {
  await dropIdempotencyTable(knex, variant.table)
  await createIdempotencyTable(knex, variant.table)
  for (const sql of variant.change(variant.table)) await knex.raw(sql)
}

// Round 0 warms up (connections, prepared statements, caches) and is not counted.
for (let round = 0; round <= ROUNDS; round++) {
  warmingUp = round === 0
  const key = (what: string, i: number): string => `${what}-${round}-${i}`
  record('floor INSERT', await measure(async (i) => { await knex(floorTable).insert({ idempotency_key: Buffer.from(key('f', i)), state: 'in_flight' }) }))
  record('floor UPDATE', await measure(async (i) => { await knex(floorTable).where('idempotency_key', Buffer.from(key('f', i))).update({ state: 'completed', body }) }))
  record('floor SELECT', await measure(async (i) => { await knex(floorTable).first('body').where('idempotency_key', Buffer.from(key('f', i))) }))
  const tokens: string[] = []
  record('begin (first request)', await measure(async (i) => {
    const result = await storage.begin(key('s', i), FINGERPRINT, LEASE)
    if (result.state !== 'acquired') throw new Error(`begin: ${result.state}`)
    tokens[i] = result.token
  }))
  record('complete', await measure(async (i) => {
    if (!await storage.complete(key('s', i), tokens[i]!, response, LEASE)) throw new Error('complete: the lease was lost')
  }))
  record('begin (replay)', await measure(async (i) => {
    const result = await storage.begin(key('s', i), FINGERPRINT, LEASE)
    if (result.state !== 'completed') throw new Error(`replay: ${result.state}`)
  }))
  for (const [index, variant] of variantTables.entries()) {
    const variantStorage = variantStorages[index]!
    const begun = await measure(async (i) => {
      const result = await variantStorage.begin(key('v', i), FINGERPRINT, LEASE)
      if (result.state !== 'acquired') throw new Error(`begin: ${result.state}`)
      tokens[i] = result.token
    })
    const completed = await measure(async (i) => {
      if (!await variantStorage.complete(key('v', i), tokens[i]!, response, LEASE)) throw new Error('complete: the lease was lost')
    })
    record(`table ${variant.name}: begin`, begun)
    record(`table ${variant.name}: complete`, completed)
    record(`table ${variant.name}: first request`, { database: begun.database + completed.database, node: begun.node + completed.node })
  }
  for (const [name, text] of args['begin-variants'] === true ? Object.entries(VARIANTS) : []) {
    record(`variant: ${name}`, await measure(async (i) => { await prepared(name, text, [Buffer.from(key(name, i)), FINGERPRINT, `t${i}`, LEASE]) }))
  }
  console.log(round === 0 ? 'warm-up round done' : `round ${round} of ${ROUNDS} done`)
}

const median = (values: number[]): number => { const s = [...values].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]! }
console.log(`\nPostgreSQL CPU per statement (this run's backends and the server's background processes), median of ${ROUNDS} rounds of ${OPS.toLocaleString('en')} statements, ${IN_FLIGHT} in flight:\n`)
console.log('| statement | PostgreSQL µs | Node µs | rounds (PostgreSQL µs) |')
console.log('|---|---:|---:|---|')
for (const [name, values] of results) {
  const database = values.map((v) => v.database)
  console.log(`| ${name} | ${median(database).toFixed(0)} | ${median(values.map((v) => v.node)).toFixed(0)} | ${database.map((v) => v.toFixed(0)).join(', ')} |`)
}

await knex.schema.dropTableIfExists(floorTable)
await dropIdempotencyTable(knex, table)
for (const variant of variantTables) await dropIdempotencyTable(knex, variant.table)
await knex.destroy()
