/**
 * Each dialect on its own, as KnexStorage uses it: built once for its knex and its table, and
 * driven step by step (takeLease, readEntry, renewLease, storeResponse, giveBack, purgeBatch) on
 * every database that answers. The storage's behaviour is tested in storage-knex.test.ts; this
 * pins what each step does, so that the storage can rely on one meaning per name.
 */
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import type { Completion, Dialect, DialectOptions } from '../lib/storage/knex/dialect.js'
import { MysqlDialect } from '../lib/storage/knex/mysql.js'
import { PostgresDialect } from '../lib/storage/knex/postgres.js'
import { SqliteDialect } from '../lib/storage/knex/sqlite.js'
import { MARIADB, mysqlConnection, pgConnection, POSTGRES, service } from './helpers/services.js'

const postgres = await service(POSTGRES)
const mariadb = await service(MARIADB)
const directory = mkdtempSync(join(tmpdir(), 'knex-dialects-'))

interface Case {
  name: string
  available: boolean
  reason: string
  knex: () => Knex
  dialect: (options: DialectOptions) => Dialect
}

const CASES: Case[] = [
  {
    name: 'sqlite',
    available: true,
    reason: '',
    knex: () => knexFactory({ client: 'better-sqlite3', connection: { filename: join(directory, 'dialects.db') }, useNullAsDefault: true }),
    dialect: (options) => new SqliteDialect(options)
  },
  { name: 'postgres', ...postgres, knex: () => knexFactory({ client: 'pg', connection: pgConnection }), dialect: (options) => new PostgresDialect(options) },
  { name: 'mariadb', ...mariadb, knex: () => knexFactory({ client: 'mysql2', connection: mysqlConnection }), dialect: (options) => new MysqlDialect(options) }
]

afterAll(() => { rmSync(directory, { recursive: true, force: true }) })

const id = (): Buffer => Buffer.from(`dialect-${randomBytes(6).toString('hex')}`)
const LEASE = 60_000

function completion (key: Buffer, token: string, ttl = LEASE): Completion {
  return { id: key, token, statusCode: 201, contentType: 'application/json', headers: '{"x-a":"1"}', body: Buffer.from('{"ok":true}'), ttl }
}

for (const { name, available, reason, knex: open, dialect: build } of CASES) {
  describe.skipIf(!available)(`the ${name} dialect, step by step${reason}`, () => {
    let knex: Knex
    let dialect: Dialect
    let now = Date.now()
    const table = `dialect_steps_${name}_${randomBytes(4).toString('hex')}`

    beforeAll(async () => {
      knex = open()
      await createIdempotencyTable(knex, table)
      // The application's clock, so that a lease can be made to lapse without waiting.
      dialect = build({ knex, table, statementTimeout: 4000, now: () => now, namedStatements: true })
      await dialect.probeServer()
    })
    afterAll(async () => {
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
    })

    it('owns its table and its knex: no step is told which', () => {
      expect(dialect.name).toBe(name === 'mariadb' ? 'mysql' : name)
      expect(dialect.table).toBe(table)
      expect(dialect.knex).toBe(knex)
    })

    it('takeLease takes an absent key; a second takeLease reads the lease that holds it', async () => {
      const key = id()
      expect(await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: LEASE })).toEqual({ state: 'acquired', token: 't1' })
      expect(await dialect.takeLease({ id: key, token: 't2', fingerprint: 'g', lease: LEASE })).toEqual({ state: 'in-flight', fingerprint: 'f', lockExpiresAt: now + LEASE })
      expect(await dialect.readEntry(key)).toEqual({ state: 'in-flight', fingerprint: 'f', lockExpiresAt: now + LEASE })
    })

    it('storeResponse stores under the lease it holds, and only under it; readEntry then gives the response', async () => {
      const key = id()
      await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: LEASE })
      expect(await dialect.storeResponse(knex, completion(key, 'other'))).toBe(0)
      expect(await dialect.storeResponse(knex, completion(key, 't1'))).toBe(1)
      expect(await dialect.storeResponse(knex, completion(key, 't1'))).toBe(0)
      const entry = await dialect.readEntry(key)
      expect(entry).toMatchObject({ state: 'completed', fingerprint: 'f', response: { statusCode: 201, contentType: 'application/json', headers: { 'x-a': '1' } } })
      expect(entry?.state === 'completed' && entry.response.body.toString()).toBe('{"ok":true}')
    })

    it('storeResponse in a transaction stores only when it commits', async () => {
      const key = id()
      await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: LEASE })
      const trx = await knex.transaction()
      expect(await dialect.storeResponse(trx, completion(key, 't1'))).toBe(1)
      await trx.rollback()
      expect(await dialect.readEntry(key)).toMatchObject({ state: 'in-flight' })
    })

    it('renewLease extends the lease it holds, and only that one', async () => {
      const key = id()
      await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: 1000 })
      expect(await dialect.renewLease({ id: key, token: 'other', lease: LEASE })).toBe(0)
      expect(await dialect.renewLease({ id: key, token: 't1', lease: LEASE })).toBe(1)
      expect(await dialect.readEntry(key)).toEqual({ state: 'in-flight', fingerprint: 'f', lockExpiresAt: now + LEASE })
    })

    it('giveBack removes the lease it holds, and only that one', async () => {
      const key = id()
      await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: LEASE })
      expect(await dialect.giveBack({ id: key, token: 'other' })).toBe(0)
      expect(await dialect.giveBack({ id: key, token: 't1' })).toBe(1)
      expect(await dialect.readEntry(key)).toBeUndefined()
      expect(await dialect.takeLease({ id: key, token: 't2', fingerprint: 'g', lease: LEASE })).toEqual({ state: 'acquired', token: 't2' })
    })

    it('a lapsed lease is taken over, and a lapsed holder can neither store nor give back', async () => {
      const key = id()
      await dialect.takeLease({ id: key, token: 't1', fingerprint: 'f', lease: 1000 })
      now += 1000
      expect(await dialect.readEntry(key)).toBeUndefined()
      expect(await dialect.storeResponse(knex, completion(key, 't1'))).toBe(0)
      expect(await dialect.giveBack({ id: key, token: 't1' })).toBe(0)
      expect(await dialect.takeLease({ id: key, token: 't2', fingerprint: 'g', lease: LEASE })).toEqual({ state: 'acquired', token: 't2' })
    })

    it('purgeBatch deletes expired rows, a batch at a time, and leaves live ones', async () => {
      const live = id()
      await dialect.takeLease({ id: live, token: 'live', fingerprint: 'f', lease: 10 * LEASE })
      for (let i = 0; i < 3; i++) {
        const key = id()
        await dialect.takeLease({ id: key, token: 'e', fingerprint: 'f', lease: LEASE })
        await dialect.storeResponse(knex, completion(key, 'e', 1000))
      }
      now += 5000
      const first = await dialect.purgeBatch(2)
      expect(first.chosen).toBe(2)
      let deleted = first.deleted
      for (let batch = await dialect.purgeBatch(2); ; batch = await dialect.purgeBatch(2)) {
        deleted += batch.deleted
        if (batch.chosen < 2) break
      }
      // Leases of earlier tests lapsed too: at least the three responses went.
      expect(deleted).toBeGreaterThanOrEqual(3)
      expect(await dialect.readEntry(live)).toMatchObject({ state: 'in-flight' })
    })
  })
}
