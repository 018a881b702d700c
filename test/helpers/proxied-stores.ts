/**
 * Stores whose connections go through a proxy (test/helpers/proxy.ts) on a loopback port, for the
 * tests that stage an outage, a hung server or a lost answer, each on a namespace of its own. What
 * the test left is removed over a direct connection, which the proxy's state does not reach.
 */
import { Redis, type RedisOptions } from 'ioredis'
import knexFactory, { type Knex } from 'knex'
import { RedisStorage } from '../../lib/redis.js'
import { dropIdempotencyTable, KnexStorage } from '../../lib/knex.js'
import { REDIS, deleteRedisPrefix } from './services.js'

export interface ProxiedStore<S, D> {
  storage: S
  /** A client of the server itself, past the proxy: to see what the server holds. */
  direct: D
  /** Removes what the storage stored, and closes the clients. */
  dispose: () => Promise<void>
}

/** A RedisStorage under `prefix`, its client on the proxy's `port` with `options`. */
export function proxiedRedis (port: number, prefix: string, options: RedisOptions = {}): ProxiedStore<RedisStorage, Redis> {
  const client = new Redis({ host: '127.0.0.1', port, ...options })
  // A cut connection reports errors the storage sees through its calls.
  client.on('error', () => {})
  const direct = new Redis({ host: REDIS.host, port: REDIS.port })
  return {
    storage: new RedisStorage({ client, prefix }),
    direct,
    dispose: async () => {
      await deleteRedisPrefix(direct, prefix)
      client.disconnect()
      await direct.quit()
    }
  }
}

/** A KnexStorage on `table`, its knex (`config` added) connecting through the proxy's `port`. */
export function proxiedKnex (port: number, client: 'pg' | 'mysql2', connection: Record<string, unknown>, table: string, config: Partial<Knex.Config> = {}): ProxiedStore<KnexStorage, Knex> {
  const knex = knexFactory({ client, connection: { ...connection, port }, ...config })
  const direct = knexFactory({ client, connection, pool: { min: 0, max: 1 } })
  return {
    storage: new KnexStorage({ knex, tableName: table, createTable: true }),
    direct,
    dispose: async () => {
      await dropIdempotencyTable(direct, table).catch(() => {})
      await knex.destroy()
      await direct.destroy()
    }
  }
}
