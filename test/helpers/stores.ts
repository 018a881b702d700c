/**
 * Every store the behaviour tests run against, each on its real server. A store whose server is
 * unreachable is skipped with the reason (and fails under CI=true, see services.ts).
 */
import type { IdempotencyStorage } from '../../lib/storage/types.js'
import { MemoryStorage } from '../../lib/storage/memory.js'

export interface StoreCase {
  name: string
  available: boolean
  reason: string
  /** A storage on a fresh namespace (prefix or table) of the shared server. */
  create: () => Promise<IdempotencyStorage>
  /** Drop what `create` made (tables, connections). */
  cleanup: () => Promise<void>
}

export async function storeCases (): Promise<StoreCase[]> {
  return [
    { name: 'memory', available: true, reason: '', create: async () => new MemoryStorage(), cleanup: async () => {} }
  ]
}
