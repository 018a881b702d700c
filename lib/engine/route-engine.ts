/**
 * What the engine needs for one guarded route: its store, its settings, where it reports, and the
 * timer that keeps its running handlers' leases alive. Built once per route, when it is added.
 */
import type { ResponseCipher } from '../encryption.js'
import type { RouteSettings } from '../options.js'
import { MemoryStorage } from '../storage/memory.js'
import type { IdempotencyStorage } from '../storage/types.js'
import { HandlerDurations } from './handler-durations.js'
import { InFlight } from './in-flight.js'
import { LeaseRenewal } from './lease-renewal.js'
import { Reporter } from './report.js'
import { StoreDeadline } from './store-deadline.js'
import type { RequestState } from './request-state.js'

export interface RouteEngine {
  readonly storage: IdempotencyStorage
  readonly settings: RouteSettings
  readonly reporter: Reporter
  /** Renews the lease of every request of this route whose handler is running. */
  readonly renewal: LeaseRenewal<RequestState>
  /** How long this route's requests recently held their key (for Retry-After). */
  readonly durations: HandlerDurations
  /** Bounds every call to the store by `storeTimeout`. */
  readonly deadline: StoreDeadline
  /** Seals what is stored and opens what is replayed; `null` without encryption. */
  readonly cipher: ResponseCipher | null
  /** The registration's requests between their first store call and their settling, which closing the app waits for. */
  readonly inFlight: InFlight
}

export function createRouteEngine (storage: IdempotencyStorage, settings: RouteSettings, route: string, cipher: ResponseCipher | null = null, inFlight = new InFlight()): RouteEngine {
  const reporter = new Reporter(storage.constructor.name, route)
  // The embedded store answers from this process's memory and cannot hang: nothing to bound.
  const deadline = new StoreDeadline(storage instanceof MemoryStorage ? 0 : settings.storeTimeout)
  const renewal = new LeaseRenewal<RequestState>(settings.lockTimeout, settings.maxLockHold,
    (state) => { renewLease(storage, settings, reporter, deadline, state) },
    (state) => { reporter.report(state, 'lease-lost', { phase: 'max-hold' }, 'warn', 'idempotency lease no longer renewed: the request has held its key for maxLockHold; it lapses within lockTimeout') },
    (state, stalledMs) => { state.log.warn({ idempotencyKey: state.key, stalledMs, lockTimeout: settings.lockTimeout }, 'idempotency lease renewed late: the event loop was blocked for stalledMs; a stall longer than 7/8 of lockTimeout loses the lease, and a duplicate may then run') })
  return { storage, settings, reporter, renewal, durations: new HandlerDurations(), deadline, cipher, inFlight }
}

/** One renewal: the store extends the lease, or says it was lost. */
function renewLease (storage: IdempotencyStorage, settings: RouteSettings, reporter: Reporter, deadline: StoreDeadline, state: RequestState): void {
  // The deadline calls through a promise, so a custom store that throws instead of rejecting
  // cannot throw out of the shared timer (which would end the process).
  deadline.run('renew', () => storage.renew(state.storageKey, state.token, settings.lockTimeout)).then((held) => {
    if (held || state.phase !== 'running') return
    reporter.report(state, 'lease-lost', { phase: 'renew' }, 'warn', 'idempotency lease lost while the handler was running')
  }, (error: unknown) => {
    reporter.report(state, 'store-error', { phase: 'renew', error }, 'warn', 'idempotency lease renewal failed')
  })
}
