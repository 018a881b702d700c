/**
 * Every scenario, by name: how to start its server, what it is compared with, and which
 * workloads it serves. The orchestrator and the report read this table; nothing else lists them.
 */
import type { BenchServer } from './common.js'

export type Workload = 'REPLAY' | 'NEW' | 'MIXED' | 'CONFLICT'
export const WORKLOADS: readonly Workload[] = ['REPLAY', 'NEW', 'MIXED', 'CONFLICT']

export type ScenarioKind = 'baseline' | 'floor' | 'ours' | 'peer'

export interface ScenarioInfo {
  name: string
  label: string
  /** A few words, for the chart. */
  short: string
  kind: ScenarioKind
  /** Which store the idempotency layer uses, for comparing ours with a peer of the same kind. */
  store: 'none' | 'memory' | 'redis' | 'postgres' | 'mariadb' | 'sqlite'
  framework: 'fastify' | 'express'
  /** The measured route is guarded: its handler must run at most once per key. */
  guarded: boolean
  workloads: readonly Workload[]
  /** The scenario each throughput is divided by (same workload, same round); none for baselines. */
  baseline: string | null
  start: () => Promise<BenchServer>
}

const ALL = WORKLOADS
const THROUGHPUT = ['REPLAY', 'NEW', 'MIXED'] as const

export const SCENARIOS: readonly ScenarioInfo[] = [
  {
    name: 'bare',
    short: 'bare route',
    guarded: false,
    label: 'Fastify bare route',
    kind: 'baseline',
    store: 'none',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./fastify.js')).bare()
  },
  {
    name: 'unflagged',
    short: 'unflagged route',
    guarded: false,
    label: 'plugin registered, route unflagged',
    kind: 'ours',
    store: 'none',
    framework: 'fastify',
    workloads: ['REPLAY', 'NEW'],
    baseline: 'bare',
    start: async () => await (await import('./fastify.js')).unflagged()
  },
  {
    name: 'memory',
    short: 'MemoryStorage',
    guarded: true,
    label: 'fastify-idempotency, MemoryStorage',
    kind: 'ours',
    store: 'memory',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'bare',
    start: async () => await (await import('./fastify.js')).memory()
  },
  {
    name: 'memory-floor',
    short: 'in-process floor',
    guarded: true,
    label: 'in-process floor (hooks, SHA-256, a Map)',
    kind: 'floor',
    store: 'memory',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: 'bare',
    start: async () => await (await import('./fastify.js')).memoryFloor()
  },
  {
    name: 'memory-sealed',
    short: 'MemoryStorage, encrypted',
    guarded: true,
    label: 'fastify-idempotency, MemoryStorage, encryption on',
    kind: 'ours',
    store: 'memory',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: 'memory',
    start: async () => await (await import('./fastify.js')).memorySealed()
  },
  {
    name: 'redis-floor',
    short: 'Redis floor',
    guarded: false,
    label: 'Redis floor (1 GET / SET NX + SET)',
    kind: 'floor',
    store: 'redis',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./fastify.js')).redisFloor()
  },
  {
    name: 'redis',
    short: 'RedisStorage',
    guarded: true,
    label: 'fastify-idempotency, RedisStorage',
    kind: 'ours',
    store: 'redis',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'redis-floor',
    start: async () => await (await import('./fastify.js')).redis()
  },
  {
    name: 'redis-node-redis',
    short: 'RedisStorage, node-redis',
    guarded: true,
    label: 'fastify-idempotency, RedisStorage on node-redis 6',
    kind: 'ours',
    store: 'redis',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: 'redis-floor',
    start: async () => await (await import('./fastify.js')).redisOn('node-redis')
  },
  {
    name: 'redis-glide',
    short: 'RedisStorage, GLIDE',
    guarded: true,
    label: 'fastify-idempotency, RedisStorage on Valkey GLIDE 2',
    kind: 'ours',
    store: 'redis',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: 'redis-floor',
    start: async () => await (await import('./fastify.js')).redisOn('glide')
  },
  {
    name: 'redis-iovalkey',
    short: 'RedisStorage, iovalkey',
    guarded: true,
    label: 'fastify-idempotency, RedisStorage on iovalkey',
    kind: 'ours',
    store: 'redis',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: 'redis-floor',
    start: async () => await (await import('./fastify.js')).redisOn('iovalkey')
  },
  {
    name: 'pg-floor',
    short: 'PostgreSQL floor',
    guarded: false,
    label: 'PostgreSQL floor (1 SELECT / INSERT + UPDATE)',
    kind: 'floor',
    store: 'postgres',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./sql.js')).pgFloor()
  },
  {
    name: 'pg-trx-floor',
    short: 'PostgreSQL transaction floor',
    guarded: false,
    label: 'PostgreSQL transaction floor (INSERT, then INSERT + UPDATE in a transaction)',
    kind: 'floor',
    store: 'postgres',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./sql.js')).pgTransactionFloor()
  },
  {
    name: 'mariadb-floor',
    short: 'MariaDB floor',
    guarded: false,
    label: 'MariaDB floor (1 SELECT / INSERT + UPDATE)',
    kind: 'floor',
    store: 'mariadb',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./sql.js')).mariadbFloor()
  },
  {
    name: 'knex-mariadb',
    short: 'KnexStorage on MariaDB',
    guarded: true,
    label: 'fastify-idempotency, KnexStorage MariaDB',
    kind: 'ours',
    store: 'mariadb',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'mariadb-floor',
    start: async () => await (await import('./sql.js')).knexMariadb()
  },
  {
    name: 'sqlite-floor',
    short: 'SQLite floor',
    guarded: false,
    label: 'SQLite floor, WAL (1 SELECT / INSERT + UPDATE)',
    kind: 'floor',
    store: 'sqlite',
    framework: 'fastify',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./sql.js')).sqliteFloor()
  },
  {
    name: 'knex-pg',
    short: 'KnexStorage on PostgreSQL',
    guarded: true,
    label: 'fastify-idempotency, KnexStorage PostgreSQL',
    kind: 'ours',
    store: 'postgres',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'pg-floor',
    start: async () => await (await import('./sql.js')).knexPostgres()
  },
  {
    name: 'knex-pg-trx',
    short: 'KnexStorage on PostgreSQL, transaction mode',
    guarded: true,
    label: 'fastify-idempotency, KnexStorage PostgreSQL, transaction mode',
    kind: 'ours',
    store: 'postgres',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'pg-trx-floor',
    start: async () => await (await import('./sql.js')).knexPostgresTransaction()
  },
  {
    name: 'knex-sqlite',
    short: 'KnexStorage on SQLite',
    guarded: true,
    label: 'fastify-idempotency, KnexStorage SQLite',
    kind: 'ours',
    store: 'sqlite',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'sqlite-floor',
    start: async () => await (await import('./sql.js')).knexSqlite()
  },
  {
    name: 'node-idem-memory',
    short: '@node-idempotency, memory',
    guarded: true,
    label: '@node-idempotency/core, memory adapter',
    kind: 'peer',
    store: 'memory',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'bare',
    start: async () => await (await import('./peers.js')).nodeIdempotencyMemory()
  },
  {
    name: 'node-idem-redis',
    short: '@node-idempotency, Redis',
    guarded: true,
    label: '@node-idempotency/core, Redis adapter',
    kind: 'peer',
    store: 'redis',
    framework: 'fastify',
    workloads: ALL,
    baseline: 'redis-floor',
    start: async () => await (await import('./peers.js')).nodeIdempotencyRedis()
  },
  {
    name: 'express-bare',
    short: 'Express bare route',
    guarded: false,
    label: 'Express bare route',
    kind: 'baseline',
    store: 'none',
    framework: 'express',
    workloads: THROUGHPUT,
    baseline: null,
    start: async () => await (await import('./peers.js')).expressBare()
  },
  {
    name: 'express-idempotency',
    short: 'express-idempotency',
    guarded: true,
    label: 'express-idempotency, in-memory adapter',
    kind: 'peer',
    store: 'memory',
    framework: 'express',
    workloads: ALL,
    baseline: 'express-bare',
    start: async () => await (await import('./peers.js')).expressIdempotencyMemory()
  }
]

export function scenario (name: string): ScenarioInfo {
  const found = SCENARIOS.find((s) => s.name === name)
  if (found === undefined) throw new Error(`unknown scenario ${JSON.stringify(name)}; known: ${SCENARIOS.map((s) => s.name).join(', ')}`)
  return found
}
