/**
 * What every benchmark server shares: the one route's behaviour, the handler-execution counter,
 * and the settings the orchestrator hands down through the environment.
 *
 * The route is `POST /orders`: a small JSON body in, `201` with a small JSON body out. Its handler
 * counts every execution per idempotency key, so the orchestrator can tell a scenario that ran a
 * handler twice for one key (incorrect) from one that is merely fast.
 */
import { setTimeout as sleep } from 'node:timers/promises'

export const ROUTE = '/orders'
export const KEY_HEADER = 'idempotency-key'

/** The request body every workload sends; CONFLICT adds `delay` (ms the handler takes). */
export interface OrderBody {
  amount: number
  currency: string
  item: string
  delay?: number
}

export interface OrderResult {
  id: number
  status: string
  amount: number
  currency: string
}

/** Handler executions since the last reset, per idempotency key. */
export class ExecutionCounter {
  executions = 0
  duplicateKeys = 0
  maxPerKey = 0
  #keys = new Map<string, number>()

  record (key: unknown): void {
    this.executions++
    if (typeof key !== 'string') return
    const count = (this.#keys.get(key) ?? 0) + 1
    this.#keys.set(key, count)
    if (count === 2) this.duplicateKeys++
    if (count > this.maxPerKey) this.maxPerKey = count
  }

  snapshot (): ExecutionStats {
    return {
      executions: this.executions,
      distinctKeys: this.#keys.size,
      duplicateKeys: this.duplicateKeys,
      maxPerKey: this.maxPerKey
    }
  }

  reset (): void {
    this.executions = 0
    this.duplicateKeys = 0
    this.maxPerKey = 0
    this.#keys = new Map()
  }
}

export interface ExecutionStats {
  executions: number
  /** Distinct idempotency keys whose handler ran. */
  distinctKeys: number
  /** Keys whose handler ran more than once: anything above 0 is a correctness failure. */
  duplicateKeys: number
  maxPerKey: number
}

/**
 * The business logic of the route, framework-free: count the execution, take `delay` ms when the
 * body asks for it (CONFLICT), and build the result.
 */
export async function placeOrder (counter: ExecutionCounter, key: unknown, body: OrderBody): Promise<OrderResult> {
  counter.record(key)
  const id = counter.executions
  if (typeof body.delay === 'number' && body.delay > 0) await sleep(body.delay)
  return { id, status: 'created', amount: body.amount, currency: body.currency }
}

/** Settings from the orchestrator. */
export interface BenchEnv {
  /** Unique per orchestrator run and round: prefixes every Redis key and SQL table. */
  tag: string
  /** A private temporary directory (SQLite files). */
  tmpDir: string
  redisHost: string
  redisPort: number
  pg: { host: string, port: number, user: string, database: string }
  mysql: { host: string, port: number, user: string, password: string, database: string }
}

export function benchEnv (): BenchEnv {
  const env = process.env
  return {
    tag: env.BENCH_TAG ?? `local${process.pid}`,
    tmpDir: env.BENCH_TMP ?? '/tmp',
    redisHost: env.BENCH_REDIS_HOST ?? '127.0.0.1',
    redisPort: Number(env.BENCH_REDIS_PORT ?? 6379),
    pg: {
      host: env.BENCH_PG_HOST ?? '127.0.0.1',
      port: Number(env.BENCH_PG_PORT ?? 5432),
      user: env.BENCH_PG_USER ?? 'postgres',
      database: env.BENCH_PG_DATABASE ?? 'test'
    },
    mysql: {
      host: env.BENCH_MYSQL_HOST ?? '127.0.0.1',
      port: Number(env.BENCH_MYSQL_PORT ?? 3306),
      user: env.BENCH_MYSQL_USER ?? 'root',
      password: env.BENCH_MYSQL_PASSWORD ?? '',
      database: env.BENCH_MYSQL_DATABASE ?? 'test'
    }
  }
}

/** A started server: where it listens, and how to stop it and free what it created. */
export interface BenchServer {
  port: number
  counter: ExecutionCounter
  close: () => Promise<void>
}
