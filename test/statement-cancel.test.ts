/**
 * On PostgreSQL the store's hot statements run on a pooled connection directly, cancelled past
 * `statementTimeout` by knex's `cancelQuery` (pg_cancel_backend, through a connection of its own).
 * A cancel that lands after its statement has ended must not stop the next statement sent on that
 * connection: the connection goes back to the pool only once the cancel is done.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { onConnection } from '../lib/storage/knex/connection.js'
import { POSTGRES, pgConnection, service } from './helpers/services.js'

const postgres = await service(POSTGRES)

interface PgConnection { query: (text: string) => Promise<unknown> }
interface CancellingClient { cancelQuery: (connection: unknown) => Promise<unknown> }

describe.skipIf(!postgres.available)(`a cancel that lands after its statement on postgres${postgres.reason}`, () => {
  let knex: Knex
  beforeAll(() => {
    // One connection: the next statement goes where the cancel was aimed.
    knex = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } })
  })
  afterAll(async () => { await knex.destroy() })

  it('stops no other statement on that connection', async () => {
    const client = knex.client as CancellingClient
    const cancelQuery = client.cancelQuery.bind(client)
    let ended!: () => void
    const statementEnded = new Promise<void>((resolve) => { ended = resolve })
    // The cancel's own connection is slow to come: it reaches the server after the statement ended.
    client.cancelQuery = async (connection) => {
      await statementEnded
      return await cancelQuery(connection)
    }
    try {
      await onConnection<PgConnection, unknown>(knex, 20, async (connection) => {
        const result = await connection.query('SELECT pg_sleep(0.1)')
        ended()
        return result
      })
      const next = await knex.raw('SELECT pg_sleep(0.3), 1 AS ok')
      expect(next.rows[0].ok).toBe(1)
    } finally {
      client.cancelQuery = cancelQuery
    }
  })
})
