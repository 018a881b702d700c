/**
 * The four workloads as autocannon requests. Every workload goes through the same `setupRequest`
 * hook (a key chosen per request), so the load generator spends the same work per request
 * whichever workload it sends, and a throughput difference is the server's.
 *
 *   REPLAY    one key, stored before the run: every request is a replay
 *   NEW       a fresh key per request: every request is a first execution
 *   MIXED     nine requests in ten use the REPLAY key, the tenth a fresh key
 *   CONFLICT  every connection on the same key, which changes every 100 ms, while the handler
 *             takes 20 ms: per key, one execution, then "in progress" answers (409 for the
 *             plugin), then replays
 */
import type autocannon from 'autocannon'
import { KEY_HEADER, ROUTE, type OrderBody } from './scenarios/common.js'
import type { Workload } from './scenarios/index.js'

export const ORDER: OrderBody = { amount: 4200, currency: 'eur', item: 'book' }
export const CONFLICT_HANDLER_MS = 20
export const CONFLICT_KEY_PERIOD_MS = 100

const BODY = JSON.stringify(ORDER)
const CONFLICT_BODY = JSON.stringify({ ...ORDER, delay: CONFLICT_HANDLER_MS })

/** The key REPLAY and MIXED replay; servers of one round store it during their warm-up. */
export function replayKey (tag: string): string {
  return `r-${tag}`
}

/**
 * The requests of one autocannon run. `unique` must differ between runs, so that NEW keys are
 * fresh across runs, rounds and the warm-up.
 */
export function workloadRequests (workload: Workload, tag: string, unique: string): autocannon.Request[] {
  const replay = replayKey(tag)
  let n = 0
  let nextKey: () => string
  let body = BODY
  switch (workload) {
    case 'REPLAY':
      nextKey = () => replay
      break
    case 'NEW':
      nextKey = () => `n-${unique}-${n++}`
      break
    case 'MIXED':
      nextKey = () => (++n % 10 === 0 ? `n-${unique}-${n}` : replay)
      break
    case 'CONFLICT':
      body = CONFLICT_BODY
      nextKey = () => `c-${unique}-${Math.floor(Date.now() / CONFLICT_KEY_PERIOD_MS)}`
      break
  }
  return [{
    method: 'POST',
    path: ROUTE,
    headers: { 'content-type': 'application/json' },
    body,
    setupRequest: (request) => {
      // autocannon hands us a fresh copy of the request and its headers on every call.
      (request.headers as Record<string, string>)[KEY_HEADER] = nextKey()
      return request
    }
  }]
}
