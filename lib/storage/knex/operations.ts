/**
 * KnexStorage's operations (docs/operations.md): reading a row without taking it, forgetting a
 * key with the rows related to it, and listing the leases held. None of them is on a request's
 * path, so they go through knex's query builder, the same on every dialect.
 */
import { tokenIssuedAt } from '../tokens.js'
import type { StorageForgetOptions, StorageForgetResult, LeaseListing, StoredState } from '../types.js'
import type { Dialect } from './dialect.js'
import { encodeKey, millis, READ_COLUMNS, toBuffer, toResult, type Row } from './rows.js'

/** What the operations need of a KnexStorage: its dialect's table, clock and bound, and its waiters. */
export type TableView = Pick<Dialect, 'knex' | 'table' | 'clock' | 'bound' | 'wakeWaiters'>

/** The bytes just past every key that starts with `prefix`, or `null` when there are none. */
function pastPrefix (prefix: Buffer): Buffer | null {
  let end = prefix.length
  while (end > 0 && prefix[end - 1] === 0xff) end--
  if (end === 0) return null
  const bound = Buffer.from(prefix.subarray(0, end))
  bound[end - 1]!++
  return bound
}

export async function inspectRow (view: TableView, key: string): Promise<StoredState> {
  const { knex, table, clock, bound } = view
  const row = await bound(knex(table).first([...READ_COLUMNS, 'token', 'expires_at as expiresat']).where('idempotency_key', encodeKey(key))
    .andWhereRaw(`expires_at > ${clock.now}`, clock.values())) as (Row & { expiresat: unknown }) | undefined
  if (row === undefined) return { state: 'absent' }
  const found = toResult(row)
  if (found.state === 'in-flight') return { ...found, since: tokenIssuedAt(row.token) }
  if (found.state !== 'completed') throw new Error('KnexStorage: unexpected row')
  // A row stored by an earlier version has no lease end once completed.
  return { ...found, storedAt: row.leaseend === null ? null : millis(row.leaseend), expiresAt: millis(row.expiresat) }
}

export async function forgetRow (view: TableView, key: string, options: StorageForgetOptions): Promise<StorageForgetResult> {
  const { knex, table, clock, bound } = view
  const id = encodeKey(key)
  const found = await inspectRow(view, key)
  if (found.state === 'in-flight' && !options.force) return { outcome: 'refused', lockExpiresAt: found.lockExpiresAt }
  const row = knex(table).where('idempotency_key', id)
  // A lease taken since the row was read is never removed without `force`.
  if (!options.force) row.andWhereRaw(`NOT (state = 'in_flight' AND lease_end > ${clock.now})`, clock.values())
  const deleted = Number(await bound(row.del()))
  if (deleted === 0 && found.state !== 'absent') {
    const now = await inspectRow(view, key)
    if (now.state === 'in-flight') return { outcome: 'refused', lockExpiresAt: now.lockExpiresAt }
  }
  if (deleted > 0 && found.state === 'in-flight') await view.wakeWaiters?.(id)
  const prefix = encodeKey(options.relatedPrefix)
  const past = pastPrefix(prefix)
  const related = knex(table).where('idempotency_key', '>=', prefix)
  if (past !== null) related.andWhere('idempotency_key', '<', past)
  return { outcome: 'forgotten', previous: deleted > 0 ? found.state : 'absent', related: Number(await bound(related.del())) }
}

export async function listLeaseRows (view: TableView, limit: number): Promise<LeaseListing> {
  const { knex, table, clock, bound } = view
  // Served by the in-flight index (schema.ts); `id`, not a name a column renaming would change (see Row).
  const rows = await bound(knex(table).select('idempotency_key as id', 'fingerprint', 'token', 'lease_end as leaseend')
    .where('state', 'in_flight').andWhereRaw(`lease_end > ${clock.scan}`, clock.values())
    .orderBy('lease_end').limit(limit + 1)) as Array<{ id: unknown, fingerprint: string, token: string | null, leaseend: unknown }>
  return {
    leases: rows.slice(0, limit).map((row) => ({
      key: toBuffer(row.id).toString('utf8'),
      fingerprint: row.fingerprint,
      lockExpiresAt: millis(row.leaseend),
      since: tokenIssuedAt(row.token)
    })),
    complete: rows.length <= limit
  }
}
