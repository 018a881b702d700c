/**
 * The store's start-up check: when the app starts (Fastify's `onReady`), a store that can tell
 * whether it can work (`IdempotencyStorage.ready`) is asked once, within `storeTimeout`. A store
 * that cannot (database unreachable, its table missing) fails `app.ready()` with one line that
 * says why, instead of starting an app that answers 503 to every guarded request. `checkStore:
 * false` starts it anyway.
 */
import type { FastifyInstance } from 'fastify'
import { StoreDeadline } from '../engine/store-deadline.js'
import type { IdempotencyStorage } from '../storage/types.js'

/** Stores already checked by this process: several registrations may share one. */
const checked = new WeakMap<IdempotencyStorage, Promise<void>>()

export function checkStoreWhenReady (fastify: FastifyInstance, storage: IdempotencyStorage, timeout: number): void {
  if (typeof storage.ready !== 'function') return
  fastify.addHook('onReady', async function checkStore () {
    let check = checked.get(storage)
    if (check === undefined) {
      check = new StoreDeadline(timeout).run('ready', () => storage.ready!())
      checked.set(storage, check)
      // A later start (after the operator fixed the cause) asks again.
      check.catch(() => { checked.delete(storage) })
    }
    try {
      await check
    } catch (error) {
      const reason = (error instanceof Error ? error.message : String(error)).split('\n')[0]
      throw new Error(`fastify-idempotency: the store cannot work: ${reason} (checkStore: false starts the app anyway)`, { cause: error })
    }
  })
}
