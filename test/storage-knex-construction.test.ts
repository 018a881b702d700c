import knexFactory, { type Knex } from 'knex'
import { describe, expect, it } from 'vitest'
import { KnexStorage } from '../lib/knex.js'
import { dropIdempotencyTable } from '../lib/storage/knex/schema.js'
import { watchConnections } from './helpers/knex-instrument.js'
import { EXPIRY, LEASE, pgDriver, postgres } from './helpers/knex-targets.js'
import { pgConnection } from './helpers/services.js'

/** KnexStorage's options: the clients it knows, when it has waitFor, prepared statements or not. */
describe('KnexStorage construction', () => {
  const fake = (client: unknown, driverName?: string) => ({ client: { config: { client }, driverName } }) as unknown as Knex

  it('knows the supported clients and their aliases', async () => {
    for (const [client, dialect] of [['pg', 'postgres'], ['postgres', 'postgres'], ['postgresql', 'postgres'], ['mysql', 'mysql'],
      ['mysql2', 'mysql'], ['better-sqlite3', 'sqlite'], ['sqlite3', 'sqlite']] as const) {
      expect(new KnexStorage({ knex: fake(client) }).dialect).toBe(dialect)
    }
    // A Client class instead of a name: the driver tells.
    expect(new KnexStorage({ knex: fake(class {}, 'pg') }).dialect).toBe('postgres')
    const real = knexFactory({ client: 'pg' })
    expect(new KnexStorage({ knex: real }).tableName).toBe('idempotency_keys')
    await real.destroy()
  })

  it('gives waitFor only to PostgreSQL storages whose knex opens its own connections', async () => {
    const pgKnex = knexFactory({ client: 'pg', connection: pgConnection })
    const sqlite = knexFactory({ client: 'better-sqlite3', connection: { filename: ':memory:' }, useNullAsDefault: true })
    // With an external pool knex has no settings to open a listening connection with.
    const pool = new (pgDriver(pgKnex).Pool)(pgConnection)
    const pooled = knexFactory({ client: 'pg', connectionPool: pool } as Knex.Config)
    try {
      expect(new KnexStorage({ knex: pgKnex }).waitFor).toBeTypeOf('function')
      expect('waitFor' in new KnexStorage({ knex: sqlite })).toBe(false)
      expect('waitFor' in new KnexStorage({ knex: pooled })).toBe(false)
      expect('waitFor' in new KnexStorage({ knex: fake('pg') })).toBe(false)
    } finally {
      await Promise.all([pgKnex.destroy(), sqlite.destroy(), pooled.destroy(), pool.end()])
    }
  })

  it('refuses an unknown client with a clear error', () => {
    expect(() => new KnexStorage({ knex: fake('mssql') })).toThrow(/knex client "mssql" is not supported/)
    expect(() => new KnexStorage({ knex: fake('oracledb') })).toThrow(/use pg, mysql2/)
    expect(() => new KnexStorage({ knex: fake('mariadb') })).toThrow(/for MariaDB use the mysql2 client/)
    expect(() => new KnexStorage({ knex: {} as Knex })).toThrow(/expected a knex instance/)
    expect(() => new KnexStorage({ knex: fake('pg'), tableName: '' })).toThrow(/tableName/)
  })

  it('refuses a preparedStatements that is not a boolean', () => {
    expect(() => new KnexStorage({ knex: fake('pg'), preparedStatements: 'yes' as never })).toThrow(/preparedStatements must be a boolean/)
  })

  it.skipIf(!postgres.available)('works without prepared statements, and with them sends each statement by name', async () => {
    const knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 1, max: 1 } })
    const names: Array<string | undefined> = []
    // The store's hot statements reach the pooled connection's query directly.
    watchConnections(knex, ['query'], (query, connection) => (config: unknown, ...rest: unknown[]) => {
      if (typeof config === 'object' && config !== null && 'text' in config) names.push((config as { name?: string }).name)
      return query.call(connection, config, ...rest)
    })
    const name = `prep_${process.pid}_${Date.now()}`
    try {
      for (const preparedStatements of [false, true]) {
        names.length = 0
        const storage = new KnexStorage({ knex, tableName: name, createTable: true, preparedStatements })
        const begun = await storage.begin(`k-${String(preparedStatements)}`, 'fp', LEASE)
        expect(begun.state).toBe('acquired')
        if (begun.state !== 'acquired') return
        expect(await storage.complete(`k-${String(preparedStatements)}`, begun.token, { statusCode: 201, contentType: null, headers: {}, body: Buffer.from('x') }, EXPIRY)).toBe(true)
        const replay = await storage.begin(`k-${String(preparedStatements)}`, 'fp', LEASE)
        expect(replay.state).toBe('completed')
        const named = names.filter((item) => item !== undefined)
        if (preparedStatements) expect(named.length).toBeGreaterThanOrEqual(3)
        else expect(named).toEqual([])
      }
    } finally {
      await dropIdempotencyTable(knex, name)
      await knex.destroy()
    }
  })
})
