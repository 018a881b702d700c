/**
 * What the stores' start-up proofs share (`IdempotencyStorage.prove`): how a check is written,
 * how a proof that failed becomes the one line `ready()` rejects with, and how a step of a proof
 * gives up when its time is up.
 */
import type { StoreCheck, StoreProofOptions } from './types.js'

export function passed (name: string, found: string): StoreCheck {
  return { name, outcome: 'passed', found }
}

export function failed (name: string, found: string, cure: string): StoreCheck {
  return { name, outcome: 'failed', found, cure }
}

export function warning (name: string, found: string, cure: string): StoreCheck {
  return { name, outcome: 'warning', found, cure }
}

/** A check as one line, for a log or an error: the store, what it found, and the cure. */
export function checkLine (store: string, check: StoreCheck): string {
  return `${store}: ${check.found}${check.cure === undefined ? '' : `: ${check.cure}`}`
}

/** The first failed check as the error `ready()` rejects with; `null` when none failed. */
export function proofFailure (store: string, checks: readonly StoreCheck[]): Error | null {
  const failures = checks.filter((check) => check.outcome === 'failed')
  if (failures.length === 0) return null
  const more = failures.length === 1 ? '' : ` (and ${failures.length - 1} more check${failures.length === 2 ? '' : 's'} failed: ${failures.slice(1).map((check) => check.name).join(', ')})`
  return new Error(checkLine(store, failures[0]!) + more)
}

/**
 * `ready()` of a store that proves itself: its proof (`wait` false unless said), rejecting with the
 * first failure's line.
 */
export async function readyWhenProven (store: string, prove: (options: StoreProofOptions) => Promise<StoreCheck[]>, { wait = false, signal }: Partial<StoreProofOptions>): Promise<void> {
  const failure = proofFailure(store, await prove(signal === undefined ? { wait } : { wait, signal }))
  if (failure !== null) throw failure
}

/** The proof's time is up: a step that was still waiting says which it was. */
export class ProofAbortedError extends Error {}

/**
 * `promise`, or a rejection that names `step` once `signal` is aborted. The step itself goes on
 * (a command cannot be taken back); its outcome is then of no interest, and never unhandled.
 */
export async function beforeAbort<T> (promise: Promise<T>, signal: AbortSignal | undefined, step: string): Promise<T> {
  if (signal === undefined) return await promise
  promise.catch(() => {})
  let onAbort!: () => void
  const aborted = new Promise<never>((_resolve, reject) => {
    onAbort = () => { reject(new ProofAbortedError(`${step}: no answer before the proof's time was up`)) }
    if (signal.aborted) onAbort()
    else signal.addEventListener('abort', onAbort, { once: true })
  })
  try {
    return await Promise.race([promise, aborted])
  } finally {
    signal.removeEventListener('abort', onAbort)
  }
}

/** An error's message, first line, or what was thrown. */
export function messageOf (error: unknown): string {
  return (error instanceof Error ? error.message : String(error)).split('\n')[0]!.trim()
}

/**
 * A driver's message as a person reads it: knex writes the statement (with its values) in front
 * of it, ` - ` between them, and a statement of several lines leaves the driver's message alone on
 * the last line. Anything else: the message's first line.
 */
export function driverReason (error: unknown): string {
  const message = String((error as { message?: unknown } | null)?.message ?? error).trim()
  const lines = message.split('\n')
  const last = lines[lines.length - 1]!
  const cut = last.lastIndexOf(' - ')
  if (cut === -1 || !STATEMENT.test(lines[0]!)) return lines[0]!.trim()
  return last.slice(cut + 3).trim()
}

/** How a statement knex put in front of a message begins. */
const STATEMENT = /^\s*(?:select|insert|update|delete|with|create|drop|alter|lock|begin|commit|rollback|savepoint|release|set)\b/i
