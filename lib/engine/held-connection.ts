/**
 * Transaction mode on a store with one connection (SQLite through knex, a knex pool of one): while
 * a request's handler or a function run with `run` holds its transaction, the transaction holds
 * that connection. A call on the same store from inside it (a `run()` nested in the function or
 * the handler) would wait for the connection its own caller holds, until storeTimeout. The async
 * context of such a handler knows which store it holds, so that the nested call is refused at once.
 */
import { AsyncLocalStorage } from 'node:async_hooks'
import type { IdempotencyStorage } from '../storage/types.js'
import type { RequestState } from './request-state.js'
import type { RouteEngine } from './route-engine.js'

const held = new AsyncLocalStorage<IdempotencyStorage>()

/** Run `fn` (the handler, or the function of `run`) knowing the store whose only connection its transaction holds, if any. */
export function holdingConnection<T> ({ door }: RouteEngine, state: RequestState, fn: () => T): T {
  return state.transaction !== null && door.singleConnection ? held.run(door.storage, fn) : fn()
}

/** Refuse a call on `engine`'s store made where a transaction holds that store's only connection. */
export function checkConnectionFree ({ door }: RouteEngine, key: string): void {
  if (held.getStore() === door.storage && door.singleConnection) {
    throw new TypeError(`fastify-idempotency: key '${key}' was used inside a transaction-mode request or run on the same ${door.storeName}, whose transaction holds the store's only connection (SQLite has one, and so has a knex pool of max 1): it would wait for that connection until storeTimeout. Run it after the outer one, in the outer one's transaction, or (PostgreSQL, MySQL) give the pool 2 or more connections`)
  }
}
