/**
 * What the engine needs for one guarded operation (a route, or the functions run with `run`): the
 * door to its store, its settings, where it reports, and the timer that keeps its running
 * handlers' leases alive. Built once per route, when it is added.
 */
import type { ResponseCipher } from '../encryption.js'
import type { RouteSettings } from '../options.js'
import type { IdempotencyStorage } from '../storage/types.js'
import { HandlerDurations } from './handler-durations.js'
import { InFlight } from './in-flight.js'
import { LeaseRenewal } from './lease-renewal.js'
import { Reporter } from './report.js'
import type { RequestState } from './request-state.js'
import { StoreDoor } from './store-door.js'

export interface RouteEngine {
  /** Every call to the store goes through it. */
  readonly door: StoreDoor
  readonly settings: RouteSettings
  readonly reporter: Reporter
  /** Renews the lease of every request of this route whose handler is running. */
  readonly renewal: LeaseRenewal<RequestState>
  /** How long this route's requests recently held their key (for Retry-After). */
  readonly durations: HandlerDurations
  /** The registration's requests between their first store call and their settling, which closing the app waits for. */
  readonly inFlight: InFlight
}

export function createRouteEngine (storage: IdempotencyStorage, settings: RouteSettings, route: string, cipher: ResponseCipher | null = null, inFlight = new InFlight()): RouteEngine {
  const door = new StoreDoor(storage, settings, cipher)
  const reporter = new Reporter(door.storeName, route)
  const renewal = new LeaseRenewal<RequestState>(settings.lockTimeout, settings.maxLockHold,
    (state) => { renewLease(door, reporter, state) },
    (state) => { reporter.report(state, 'lease-lost', { phase: 'max-hold' }, 'warn', 'idempotency lease no longer renewed: the request has held its key for maxLockHold; it lapses within lockTimeout') },
    (state, stalledMs) => { state.log.warn({ idempotencyKey: state.key, stalledMs, lockTimeout: settings.lockTimeout }, 'idempotency lease renewed late: the event loop was blocked for stalledMs; a stall longer than 7/8 of lockTimeout loses the lease, and a duplicate may then run') })
  return { door, settings, reporter, renewal, durations: new HandlerDurations(), inFlight }
}

/** Stop what runs on the engine's timers (the server is closing). */
export function stopRouteEngine (engine: RouteEngine): void {
  engine.renewal.stop()
  engine.door.stop()
}

/**
 * One renewal: the store extends the lease, or says it was lost. Through the request's transaction
 * when that transaction holds the lease (StorageTransaction.renew).
 */
function renewLease (door: StoreDoor, reporter: Reporter, state: RequestState): void {
  const { transaction } = state
  // The door calls through a promise, so a custom store that throws instead of rejecting cannot
  // throw out of the shared timer (which would end the process).
  const renewed = transaction?.renew === undefined ? door.renew(state.storageKey, state.token) : door.renewIn(transaction, state.storageKey, state.token)
  renewed.then((held) => {
    if (held || state.phase !== 'running') return
    reporter.report(state, 'lease-lost', { phase: 'renew' }, 'warn', 'idempotency lease lost while the handler was running')
  }, (error: unknown) => {
    reporter.report(state, 'store-error', { phase: 'renew', error }, 'warn', 'idempotency lease renewal failed')
  })
}
