/**
 * Transaction mode at every isolation level the plugin sets (`transaction: { isolationLevel }`),
 * on each real database: read committed, repeatable read and serializable on PostgreSQL and
 * MariaDB (and MariaDB with innodb_snapshot_isolation), and SQLite's two ways to begin (deferred, and immediate for `serializable`). Each runs
 * the workloads of test/helpers/transaction-matrix.ts: distinct keys at once, duplicates, a
 * handler longer than lockTimeout, recovery points, and a real write conflict.
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll } from 'vitest'
import knexFactory from 'knex'
import type { IsolationLevel } from '../lib/index.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service } from './helpers/services.js'
import { reportMatrix, transactionMatrix } from './helpers/transaction-matrix.js'

const LEVELS: IsolationLevel[] = ['read committed', 'repeatable read', 'serializable']
const postgres = await service(POSTGRES)
const mariadb = await service(MARIADB)
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-trx-levels-'))
afterAll(() => rmSync(sqliteDir, { recursive: true, force: true }))

const servers = [
  { name: 'PostgreSQL', availability: postgres, connect: () => knexFactory({ client: 'pg', connection: pgConnection }) },
  { name: 'MariaDB', availability: mariadb, connect: () => knexFactory({ client: 'mysql2', connection: mysqlConnection }) }
]
for (const { name, availability, connect } of servers) {
  for (const isolationLevel of LEVELS) {
    transactionMatrix({ label: `${name}, ${isolationLevel}`, availability, connect, transaction: { isolationLevel }, steps: true })
  }
}
// MariaDB 11.6 and later check snapshots on write by default (innodb_snapshot_isolation): a
// REPEATABLE READ transaction then cannot change a row changed after it read. 10.11 has the
// setting, off by default; each connection turns it on here.
transactionMatrix({
  label: 'MariaDB, repeatable read, innodb_snapshot_isolation on',
  availability: mariadb,
  connect: () => knexFactory({
    client: 'mysql2',
    connection: mysqlConnection,
    pool: { afterCreate: (connection: { query: (sql: string, done: (error: Error | null) => void) => void }, done: (error: Error | null, connection: unknown) => void) => { connection.query('SET SESSION innodb_snapshot_isolation = ON', (error) => { done(error, connection) }) } }
  }),
  transaction: { isolationLevel: 'repeatable read' },
  steps: true
})
for (const [begin, transaction] of [['deferred', true], ['immediate', { isolationLevel: 'serializable' }]] as const) {
  transactionMatrix({
    label: `SQLite, ${begin}`,
    availability: { available: true, reason: '' },
    connect: () => knexFactory({ client: 'better-sqlite3', connection: { filename: join(sqliteDir, `${begin}.db`) }, useNullAsDefault: true }),
    transaction,
    steps: false
  })
}
reportMatrix()
