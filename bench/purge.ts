/**
 * `purgeExpired` at scale: `npm run bench:purge`. On each database (PostgreSQL, MariaDB, SQLite in
 * WAL), a table holding 1,000,000 expired rows is purged while the plugin serves first requests
 * (a fresh key each, 20 connections) on the same store. It prints how long the purge took, and the
 * throughput and latency of the requests before and during it, and writes them to
 * bench/results/purge.json (git-ignored) for bench/analysis.md.
 *
 *   --rows N       expired rows to purge (default 1,000,000)
 *   --only a,b     only these databases (postgres, mariadb, sqlite)
 */
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import Fastify from 'fastify'
import knexFactory, { type Knex } from 'knex'
import idempotency from '../lib/index.js'
import { KnexStorage, createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { benchEnv } from './scenarios/common.js'
import { workloadRequests } from './workloads.js'
import { REPO_ROOT } from './processes.js'

const { values: args } = parseArgs({ options: { rows: { type: 'string' }, only: { type: 'string' } } })
const ROWS = Number(args.rows ?? 1_000_000)
const CONNECTIONS = 20
const BASELINE_SECONDS = 5

interface Database {
  name: 'postgres' | 'mariadb' | 'sqlite'
  connect: () => Knex
  /** One statement that writes ROWS expired rows. */
  fill: (knex: Knex, table: string) => Promise<void>
}

const env = benchEnv()
const sqliteFile = join(env.tmpDir, `purge-${process.pid}.sqlite`)

const databases: Database[] = [
  {
    name: 'postgres',
    connect: () => knexFactory({ client: 'pg', connection: env.pg }),
    fill: async (knex, table) => {
      await knex.raw(`INSERT INTO ?? (idempotency_key, fingerprint, state, status_code, headers, body, expires_at)
        SELECT convert_to('expired-' || g, 'UTF8'), 'fp', 'completed', 201, '{}', '\\x7b7d'::bytea, 1 FROM generate_series(1, ?::integer) g`, [table, ROWS])
    }
  },
  {
    name: 'mariadb',
    connect: () => knexFactory({ client: 'mysql2', connection: env.mysql }),
    fill: async (knex, table) => {
      await knex.raw(`INSERT INTO ?? (idempotency_key, fingerprint, state, status_code, headers, body, expires_at)
        SELECT CONCAT('expired-', seq), 'fp', 'completed', 201, '{}', '{}', 1 FROM seq_1_to_${ROWS}`, [table])
    }
  },
  {
    name: 'sqlite',
    connect: () => knexFactory({
      client: 'better-sqlite3',
      connection: { filename: sqliteFile },
      useNullAsDefault: true,
      pool: {
        afterCreate: (db: { pragma: (sql: string) => unknown }, done: (error: Error | null, db: unknown) => void) => {
          db.pragma('journal_mode = WAL')
          db.pragma('synchronous = NORMAL')
          db.pragma('busy_timeout = 5000')
          done(null, db)
        }
      }
    }),
    fill: async (knex, table) => {
      await knex.raw(`WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < ?)
        INSERT INTO ?? (idempotency_key, fingerprint, state, status_code, headers, body, expires_at)
        SELECT CAST('expired-' || x AS BLOB), 'fp', 'completed', 201, '{}', X'7b7d', 1 FROM c`, [ROWS, table])
    }
  }
]

interface Load { requests: number, rps: number, p50: number, p99: number, max: number, non2xx: number }

function summary (result: autocannon.Result, seconds: number): Load {
  return {
    requests: result.requests.total,
    rps: Math.round(result.requests.total / seconds),
    p50: result.latency.p50,
    p99: result.latency.p99,
    max: result.latency.max,
    non2xx: result.non2xx
  }
}

/** Load until `until` settles (or for `seconds`), and what the clients saw. */
async function load (url: string, tag: string, seconds: number, until?: Promise<unknown>): Promise<Load> {
  const started = performance.now()
  const instance = autocannon({ url, connections: CONNECTIONS, duration: until === undefined ? seconds : 3600, requests: workloadRequests('NEW', tag, `${tag}-${Date.now()}`) })
  // autocannon's instance is a promise of its result with a stop() of its own.
  if (until !== undefined) void until.finally(() => { (instance as unknown as { stop: () => void }).stop() })
  const result = await instance
  return summary(result, (performance.now() - started) / 1000)
}

const results: Array<{ database: string, rows: number, purgeSeconds: number, purged: number, before: Load, during: Load }> = []
const only = args.only?.split(',')
for (const database of databases.filter((db) => only === undefined || only.includes(db.name))) {
  const knex = database.connect()
  const table = `purge_${process.pid}`
  try {
    await dropIdempotencyTable(knex, table)
    await createIdempotencyTable(knex, table)
    const filling = performance.now()
    await database.fill(knex, table)
    console.log(`${database.name}: ${ROWS.toLocaleString('en')} expired rows written in ${((performance.now() - filling) / 1000).toFixed(1)} s`)
    const storage = new KnexStorage({ knex, tableName: table })
    const app = Fastify()
    await app.register(idempotency, { storage })
    app.post('/orders', { config: { idempotency: true } }, async (_request, reply) => { reply.code(201); return { ok: true } })
    const url = `${await app.listen({ host: '127.0.0.1', port: 0 })}/orders`
    const before = await load(url, `${database.name}-before`, BASELINE_SECONDS)
    const purgeStarted = performance.now()
    let purgeSeconds = 0
    const purge = storage.purgeExpired().then((purged) => { purgeSeconds = (performance.now() - purgeStarted) / 1000; return purged })
    const during = await load(url, `${database.name}-during`, 0, purge)
    const purged = await purge
    await app.close()
    results.push({ database: database.name, rows: ROWS, purgeSeconds, purged, before, during })
    console.log(`${database.name}: purged ${purged.toLocaleString('en')} rows in ${purgeSeconds.toFixed(1)} s (${Math.round(purged / purgeSeconds).toLocaleString('en')} rows/s); ` +
      `first requests before ${before.rps} req/s p99 ${before.p99} ms, during ${during.rps} req/s p99 ${during.p99} ms (max ${during.max} ms, non-2xx ${during.non2xx})`)
  } finally {
    await dropIdempotencyTable(knex, table).catch(() => {})
    await knex.destroy()
    if (database.name === 'sqlite') for (const suffix of ['', '-wal', '-shm']) rmSync(sqliteFile + suffix, { force: true })
  }
}

mkdirSync(join(REPO_ROOT, 'bench', 'results'), { recursive: true })
writeFileSync(join(REPO_ROOT, 'bench', 'results', 'purge.json'), JSON.stringify({ date: new Date().toISOString(), connections: CONNECTIONS, results }, null, 2))
