/**
 * Real services for the tests: where they are, and whether they are reachable.
 *
 * A suite that needs a service runs when it answers. When it does not, the suite is skipped with
 * the reason in its name; under CI=true a missing service is a failure instead, so CI can never
 * go green by skipping.
 */
import { connect } from 'node:net'

export interface ServiceConfig {
  name: string
  host: string
  port: number
}

export const REDIS = { name: 'Redis', host: process.env.REDIS_HOST ?? '127.0.0.1', port: Number(process.env.REDIS_PORT ?? 6379) }
export const POSTGRES = { name: 'PostgreSQL', host: process.env.PGHOST ?? '127.0.0.1', port: Number(process.env.PGPORT ?? 5432) }
export const MARIADB = { name: 'MariaDB', host: process.env.MYSQL_HOST ?? '127.0.0.1', port: Number(process.env.MYSQL_PORT ?? 3306) }
export const RABBITMQ = { name: 'RabbitMQ', host: process.env.RABBITMQ_HOST ?? '127.0.0.1', port: Number(process.env.RABBITMQ_PORT ?? 5672) }
/** NATS with JetStream (`nats-server -js`). */
export const NATS = { name: 'NATS', host: process.env.NATS_HOST ?? '127.0.0.1', port: Number(process.env.NATS_PORT ?? 4222) }

/** knex connection settings for the shared servers (database `test`). */
export const pgConnection = { host: POSTGRES.host, port: POSTGRES.port, user: process.env.PGUSER ?? 'postgres', database: process.env.PGDATABASE ?? 'test' }
export const mysqlConnection = { host: MARIADB.host, port: MARIADB.port, user: process.env.MYSQL_USER ?? 'root', password: process.env.MYSQL_PASSWORD ?? '', database: process.env.MYSQL_DATABASE ?? 'test' }
/** amqplib's URL for the shared RabbitMQ (user guest, the default virtual host). */
export const amqpUrl = `amqp://${process.env.RABBITMQ_USER ?? 'guest'}:${process.env.RABBITMQ_PASSWORD ?? 'guest'}@${RABBITMQ.host}:${RABBITMQ.port}`
/** The NATS client's `servers`. */
export const natsServer = `${NATS.host}:${NATS.port}`

export interface Availability {
  available: boolean
  /** Why the suite is skipped, or '' when it runs. */
  reason: string
}

function reachable (service: ServiceConfig, timeoutMs = 2000): Promise<string | null> {
  return new Promise((resolve) => {
    const socket = connect({ host: service.host, port: service.port })
    const done = (problem: string | null) => { socket.destroy(); resolve(problem) }
    socket.setTimeout(timeoutMs, () => done(`no answer within ${timeoutMs} ms`))
    socket.once('connect', () => done(null))
    socket.once('error', (error: NodeJS.ErrnoException) => done(error.code ?? error.message))
  })
}

/**
 * Probe a service once per test file. Use the result with `describe.skipIf(!x.available)` and put
 * `x.reason` in the suite name, so a skip says why.
 */
export async function service (config: ServiceConfig): Promise<Availability> {
  const problem = await reachable(config)
  if (problem === null) return { available: true, reason: '' }
  const reason = `${config.name} unreachable at ${config.host}:${config.port} (${problem})`
  if (process.env.CI === 'true') throw new Error(`${reason}: under CI=true a missing service is a failure, not a skip`)
  return { available: false, reason: ` [skipped: ${reason}]` }
}

/** Delete every key under `prefix` on the shared Redis, so a test leaves nothing behind. */
export async function deleteRedisPrefix (client: { keys: (pattern: string) => Promise<string[]>, del: (...keys: string[]) => Promise<number> }, prefix: string): Promise<void> {
  const keys = await client.keys(`${prefix}*`)
  if (keys.length > 0) await client.del(...keys)
}
