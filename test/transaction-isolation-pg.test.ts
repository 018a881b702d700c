/**
 * Transaction mode on PostgreSQL where the level does not come from the plugin's option, or the
 * connection is not a direct one: a role whose default is SERIALIZABLE (`ALTER ROLE ... SET
 * default_transaction_isolation`, on a role of this file's own, with a schema of its own), and
 * PgBouncer in transaction pooling at the levels that record what they read. The same workloads
 * as test/transaction-isolation.test.ts.
 */
import { afterAll, beforeAll } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { POSTGRES, pgConnection, service } from './helpers/services.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { reportMatrix, transactionMatrix } from './helpers/transaction-matrix.js'

const postgres = await service(POSTGRES)
const bouncer = await pgbouncer()
const role = `idem_serializable_${process.pid}_${Date.now().toString(36)}`
let admin: Knex | undefined

beforeAll(async () => {
  if (!postgres.available) return
  admin = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } })
  await admin.raw(`CREATE ROLE ${role} LOGIN`)
  await admin.raw(`ALTER ROLE ${role} SET default_transaction_isolation = 'serializable'`)
  // Its tables go to a schema of its own (first on its search_path, "$user"), so nothing is
  // granted on the shared server's public schema.
  await admin.raw(`CREATE SCHEMA ${role} AUTHORIZATION ${role}`)
})
afterAll(async () => {
  if (admin === undefined) return
  await admin.raw(`DROP SCHEMA IF EXISTS ${role} CASCADE`)
  await admin.raw(`DROP ROLE IF EXISTS ${role}`)
  await admin.destroy()
})

transactionMatrix({
  label: 'PostgreSQL, serializable as the role\'s default (no isolationLevel)',
  availability: postgres,
  connect: () => knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } }),
  transaction: true,
  steps: true
})
for (const isolationLevel of ['repeatable read', 'serializable'] as const) {
  transactionMatrix({
    label: `PostgreSQL through PgBouncer (transaction pooling), ${isolationLevel}`,
    availability: bouncer.availability,
    connect: () => knexFactory({ client: 'pg', connection: bouncer.transaction }),
    transaction: { isolationLevel },
    steps: true
  })
}
reportMatrix()
