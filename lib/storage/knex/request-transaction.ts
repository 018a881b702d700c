/**
 * A transaction of KnexStorage, for transaction mode: opened at the isolation level asked for
 * (before its first statement: PostgreSQL's BEGIN ISOLATION LEVEL, MySQL's SET TRANSACTION before
 * BEGIN, SQLite's BEGIN IMMEDIATE), and, for a request's transaction, told where its request's
 * lease is renewed while it is open (`LeaseHolding`, dialect.ts): where the transaction holds the
 * lease, it locks the key's row, as soon as it opens or at the lease's first renewal.
 */
import type { Knex } from 'knex'
import { duration } from '../durations.js'
import type { TransactionOptions } from '../types.js'
import type { Dialect, LeaseHolding } from './dialect.js'
import { encodeKey, trimmed } from './rows.js'

/** Renew the lease `token` holds on `key` through the transaction: `false` when it was lost. */
export type RenewInside = (key: string, token: string, lockTimeout: number) => Promise<boolean>

export interface OpenedTransaction {
  trx: Knex.Transaction
  /** Present when the transaction holds its request's lease. */
  renew?: RenewInside
}

/**
 * Open a transaction as `options` say. `singleConnection`: the pool has one connection, which the
 * transaction holds, so nothing else can renew the lease meanwhile. A request's transaction that
 * finds its lease lost as it locks it is rolled back, and this throws.
 */
export async function openTransaction (dialect: Dialect, options: TransactionOptions, singleConnection: boolean): Promise<OpenedTransaction> {
  const trx = await dialect.beginTransaction(options.isolationLevel)
  // knex hands out a transaction whose BEGIN failed (SQLite's IMMEDIATE on a busy database, say):
  // only its own promise says so, rejected, and every statement on it would fail as "already
  // complete". It is not handed on.
  if (trx.isCompleted()) {
    await trx.executionPromise.catch((error: unknown) => { throw trimmed(error) })
    throw new Error('KnexStorage: the transaction ended as it began')
  }
  const { lease } = options
  if (lease === undefined) return { trx }
  try {
    const holding = await leaseHolding(dialect, trx, options, singleConnection)
    if (holding === 'outside') return { trx }
    const renew = holdingLease(dialect, trx)
    if (holding === 'locked' && !await renew(lease.key, lease.token, lease.lockTimeout)) {
      throw new Error('KnexStorage: the lease was lost before its transaction could hold it')
    }
    return { trx, renew }
  } catch (error) {
    await trx.rollback().catch(() => {})
    throw trimmed(error)
  }
}

/**
 * A pool of one cannot renew beside the transaction: there the transaction locks the key's row as
 * it opens, before the handler's statements can keep its connection busy.
 */
async function leaseHolding (dialect: Dialect, trx: Knex.Transaction, options: TransactionOptions, singleConnection: boolean): Promise<LeaseHolding> {
  const holding = await dialect.leaseHolding(trx, options.isolationLevel)
  return holding === 'outside' && singleConnection ? 'locked' : holding
}

/**
 * The lease renewed through `trx`: by writing the key's row once, which locks it until the
 * transaction ends (PostgreSQL's and InnoDB's row lock, SQLite's write lock). From then on nothing
 * else can take the key over, and inside the transaction the row is fenced by the lease's token
 * alone (heldLease, base-dialect.ts), so the later renewals write nothing: they could not be relied
 * on anyway while a statement of the handler keeps the connection busy, and a second query sent
 * to a busy node-postgres client is deprecated.
 */
function holdingLease (dialect: Dialect, trx: Knex.Transaction): RenewInside {
  let held = false
  return async (key, token, lockTimeout) => {
    held ||= await dialect.renewLease({ id: encodeKey(key), token, lease: duration('KnexStorage', 'lockTimeout', lockTimeout) }, trx).catch((error: unknown) => { throw trimmed(error) }) === 1
    return held
  }
}
