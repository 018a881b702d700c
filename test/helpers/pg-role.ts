/**
 * A PostgreSQL login role of a test file's own, with a setting of its own (`ALTER ROLE ... SET`),
 * and a schema it owns, first on its search_path ("$user"), so that nothing is granted on the
 * shared server's public schema. Made before the file's tests, dropped after, with its tables.
 */
import { afterAll, beforeAll } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { pgConnection, type Availability } from './services.js'

/** The role's name; `setting` as `ALTER ROLE` takes it: `lock_timeout = '200ms'`. */
export function pgRoleWith (prefix: string, setting: string, postgres: Availability): string {
  const role = `${prefix}_${process.pid}_${Date.now().toString(36)}`
  let admin: Knex | undefined
  beforeAll(async () => {
    if (!postgres.available) return
    admin = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } })
    await admin.raw(`CREATE ROLE ${role} LOGIN`)
    await admin.raw(`ALTER ROLE ${role} SET ${setting}`)
    await admin.raw(`CREATE SCHEMA ${role} AUTHORIZATION ${role}`)
  })
  afterAll(async () => {
    if (admin === undefined) return
    await admin.raw(`DROP SCHEMA IF EXISTS ${role} CASCADE`)
    await admin.raw(`DROP ROLE IF EXISTS ${role}`)
    await admin.destroy()
  })
  return role
}
