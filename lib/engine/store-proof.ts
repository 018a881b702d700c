/**
 * A store's start-up proof, run one way for the plugin when the app starts and for the `doctor`
 * command: within a time limit, the store's `prove` where it has one (each check it makes), or
 * else its `ready` (one check: whether it says it can work). Each check is published on
 * `storeCheckChannel`.
 */
import { storeCheckChannel, type IdempotencyStoreCheckEvent } from '../diagnostics.js'
import { checkLine, proofFailure } from '../storage/proof.js'
import { storeNameOf, type IdempotencyStorage, type StoreCheck } from '../storage/types.js'
import { StoreDeadline } from './store-deadline.js'
import { withinTime } from './time-limit.js'

export interface StoreProof {
  /** The store's name, as events and logs give it. */
  store: string
  /** Every check, in the order made; none for a store that has neither `prove` nor `ready`. */
  checks: StoreCheck[]
  /** The one line that says why the store cannot work; `null` when it can. */
  failure: string | null
  /** Each warning as one line: the store, what it found, the cure. */
  warnings: string[]
}

export interface ProofSettings {
  /** A route waits for keys in flight: the store's signal is proven too. */
  wait: boolean
  /** Milliseconds the whole proof may take. */
  timeout: number
  via: IdempotencyStoreCheckEvent['via']
}

/** Time a store is given past the limit to say which step was still waiting, before it is given up on. */
const GRACE_MS = 1000

export async function proveStore (storage: IdempotencyStorage, settings: ProofSettings): Promise<StoreProof> {
  const store = storeNameOf(storage)
  let checks: StoreCheck[]
  let failure: string | null
  if (typeof storage.prove === 'function') {
    checks = await proofChecks(storage, settings)
    failure = proofFailure(store, checks)?.message ?? null
  } else if (typeof storage.ready === 'function') {
    try {
      await new StoreDeadline(settings.timeout).run('ready', () => storage.ready!({ wait: settings.wait }))
      checks = [{ name: 'ready', outcome: 'passed', found: 'the store says it can work' }]
      failure = null
    } catch (error) {
      failure = (error instanceof Error ? error.message : String(error)).split('\n')[0]!
      checks = [{ name: 'ready', outcome: 'failed', found: failure }]
    }
  } else {
    checks = []
    failure = null
  }
  if (storeCheckChannel.hasSubscribers) {
    for (const { name, ...check } of checks) storeCheckChannel.publish({ store, check: name, ...check, via: settings.via } satisfies IdempotencyStoreCheckEvent)
  }
  return { store, checks, failure, warnings: checks.filter((check) => check.outcome === 'warning').map((check) => checkLine(store, check)) }
}

/** The store's own checks, its steps given up on at `timeout`, and the store itself a moment later. */
async function proofChecks (storage: IdempotencyStorage, { wait, timeout }: ProofSettings): Promise<StoreCheck[]> {
  const stop = new AbortController()
  const timer = setTimeout(() => { stop.abort() }, timeout)
  try {
    return await withinTime(storage.prove!({ wait, signal: stop.signal }), timeout + GRACE_MS, () => new Error(`the store did not answer within ${timeout} ms`))
  } catch (error) {
    const reason = (error instanceof Error ? error.message : String(error)).split('\n')[0]!
    return [{ name: 'proof', outcome: 'failed', found: `the start-up proof failed: ${reason}`, cure: 'see the store\'s documentation of its start-up check' }]
  } finally {
    clearTimeout(timer)
  }
}
