/**
 * The store's start-up check: when the app starts (Fastify's `onReady`), the store's start-up proof
 * (engine/store-proof.ts: every command, privilege and form requests will use, and the server's
 * settings that would break the plugin's promise) is made once, within `storeTimeout`. A store that
 * cannot work fails `app.ready()` with one line that says why and what to do, instead of starting an
 * app that answers 503 to every guarded request, or runs keys twice; what it can do with a risk or
 * a fallback is logged at `warn`. `checkStore: false` starts it anyway.
 */
import type { FastifyInstance } from 'fastify'
import { proveStore, type StoreProof } from '../engine/store-proof.js'
import type { IdempotencyStorage } from '../storage/types.js'

/**
 * Stores already proven by this process, per wait mode: several registrations may share one. Each
 * proof's warnings are logged by the start that made it.
 */
const proven = new WeakMap<IdempotencyStorage, Map<boolean, Promise<StoreProof>>>()

/** `waits()`: whether a route waits for keys in flight, known once every route is added. */
export function checkStoreWhenReady (fastify: FastifyInstance, storage: IdempotencyStorage, timeout: number, waits: () => boolean): void {
  if (typeof storage.ready !== 'function' && typeof storage.prove !== 'function') return
  fastify.addHook('onReady', async function checkStore () {
    const wait = waits()
    let byWait = proven.get(storage)
    if (byWait === undefined) proven.set(storage, byWait = new Map())
    let proof = byWait.get(wait)
    if (proof === undefined) {
      const made = proof = proveStore(storage, { wait, timeout, via: 'app' }).then((result) => {
        for (const line of result.warnings) fastify.log.warn(`fastify-idempotency: ${line}`)
        // A later start (after the operator fixed the cause) proves it again.
        if (result.failure !== null && byWait.get(wait) === made) byWait.delete(wait)
        return result
      })
      byWait.set(wait, made)
    }
    const { failure } = await proof
    if (failure !== null) throw new Error(`fastify-idempotency: the store cannot work: ${failure} (checkStore: false starts the app anyway)`)
  })
}
