/**
 * Every connection a KnexStorage opens is either the app's knex (which the app destroys) or one
 * that does not hold the process open: an app in wait mode whose duplicate waited (on PostgreSQL
 * on the store's own LISTEN connection) exits by itself once it has closed, without calling
 * `storage.close()`. On each database, and on PostgreSQL through PgBouncer.
 */
import { fileURLToPath } from 'node:url'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, describe, expect, it } from 'vitest'
import type { Knex } from 'knex'
import { bundle } from './helpers/bundle.js'
import { killChildren, runChild } from './helpers/child-run.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { scaled } from './helpers/pace.js'

const root = fileURLToPath(new URL('..', import.meta.url))
const program = bundle(fileURLToPath(new URL('./fixtures/knex-wait-exit.ts', import.meta.url)), join(root, '.tmp/bundles'))
const sqliteDir = mkdtempSync(join(tmpdir(), 'idem-exit-'))
afterAll(() => { killChildren(); rmSync(sqliteDir, { recursive: true, force: true }) })
const bouncer = await pgbouncer()

const databases: Array<{ name: string, availability: Availability, config: Knex.Config }> = [
  { name: 'PostgreSQL (LISTEN/NOTIFY)', availability: await service(POSTGRES), config: { client: 'pg', connection: pgConnection } },
  { name: 'PostgreSQL through PgBouncer (session pooling: LISTEN/NOTIFY)', availability: bouncer.availability, config: { client: 'pg', connection: bouncer.session } },
  { name: 'PostgreSQL through PgBouncer (transaction pooling: polling)', availability: bouncer.availability, config: { client: 'pg', connection: bouncer.transaction } },
  { name: 'MariaDB (polling)', availability: await service(MARIADB), config: { client: 'mysql2', connection: mysqlConnection } },
  { name: 'SQLite (polling)', availability: { available: true, reason: '' }, config: { client: 'better-sqlite3', connection: { filename: join(sqliteDir, 'exit.db') }, useNullAsDefault: true } }
]

describe('a KnexStorage app in wait mode exits by itself once closed', () => {
  for (const [index, database] of databases.entries()) {
    it.skipIf(!database.availability.available)(`on ${database.name}${database.availability.reason}`, async () => {
      const finished = await runChild(process.execPath, [await program], {
        cwd: root,
        env: { ...process.env, KNEX_CONFIG: JSON.stringify(database.config), TABLE: `exit_${process.pid}_${Date.now().toString(36)}_${index}` },
        limitMs: scaled(20_000)
      })
      expect(finished.stdout, finished.output).toContain('ANSWERS 201, 201 replayed')
      expect(finished.stdout, finished.output).toContain('CLOSED')
      expect({ code: finished.code, timedOut: finished.timedOut }, finished.output).toEqual({ code: 0, timedOut: false })
    })
  }
})
