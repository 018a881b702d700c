/**
 * Recovery points: `request.idempotency.step(name, fn)` runs `fn` once per idempotency key and
 * records its result, so that when the handler runs again for the same key and fingerprint (its
 * first run threw, answered an error, crashed, or lost its lease), every step that completed
 * returns its recorded result instead of running again.
 *
 * A step's record is an entry of its own in the same store, under a key derived from the
 * request's storage key and the step's name (under a prefix of the request's own, so that
 * `forget` removes a request's records with it), taken with `begin` and written with `complete` like
 * any response: a step that two runs reach at once runs once (the other gets 409 in progress), a
 * different fingerprint is refused, and the record expires `expiration` after it was written. It
 * needs nothing from a store beyond the storage interface, so every store has it, custom ones too.
 */
import { hash } from 'node:crypto'
import {
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError
} from '../errors.js'
import type { StorageTransaction, StoredResponse } from '../storage/types.js'
import { orLegacyRecord } from './legacy-steps.js'
import { UnreadableEntryError } from '../storage/unreadable-entry.js'
import { fingerprintRefusal } from './fingerprint-check.js'
import type { RequestState } from './request-state.js'
import type { RouteEngine } from './route-engine.js'
import { decodeValue, recordOrLost, ValueLostError, type ValueCodec } from './value-codec.js'

/** What a step's `fn` receives. */
export interface StepContext {
  /**
   * A key stable across every run of this step for this idempotency key and scope: pass it on
   * downstream (a payment provider's idempotency key, a message id), so that a step cut between
   * its call and its record is still deduplicated there. 48 URL-safe characters.
   */
  readonly key: string
  /**
   * Transaction mode (KnexStorage): this step's own transaction. Its writes commit together with
   * the step's record when `fn` returns, and roll back if it throws. `undefined` otherwise.
   */
  readonly transaction: unknown
}

/**
 * A recovery point's function for `request.idempotency.step(name, fn)`: its result is recorded and
 * a retry gets it back without running it again (docs/recovery-points.md).
 */
export type StepFunction<T> = (context: StepContext) => T | Promise<T>

/** Marks a step's storage key: apart from every request key (see storage-key.ts). */
const STEP_KEY_PREFIX = '\u0000step:'

/**
 * Every record of the recovery points of the request stored under `storageKey` is under a key
 * that starts with this, and no other key does: a request's key has no NUL, or a line feed after
 * it, or is a hash of one fixed length (storage-key.ts), and earlier versions kept records under
 * the marker and a hash alone, shorter than this.
 */
export function stepRecordPrefix (storageKey: string): string {
  return `${STEP_KEY_PREFIX}${hash('sha256', storageKey, 'base64url')}:`
}

/** Whether a storage key is a step's record (of this version or an earlier one), not a request's. */
export function isStepRecordKey (key: string): boolean {
  return key.startsWith(STEP_KEY_PREFIX)
}
/** Distinct steps one request may run: a loop that makes a step per item should batch them instead. */
export const MAX_STEPS = 100
const MAX_NAME_LENGTH = 200

/**
 * `codec`: how to keep a result the value codec cannot (an HTTP client's response, a class
 * instance): its `serialize` writes what is recorded, its `deserialize` makes the result a later
 * run returns. The run that called `fn` returns `fn`'s own result.
 */
export async function runStep<T> (engine: RouteEngine, state: RequestState, name: string, fn: StepFunction<T>, codec?: ValueCodec<T>): Promise<T> {
  if (typeof name !== 'string' || name.length === 0 || name.length > MAX_NAME_LENGTH) {
    throw new TypeError(`fastify-idempotency: a step needs a name of 1 to ${MAX_NAME_LENGTH} characters`)
  }
  // The storage key and the name are joined by a line feed to derive the downstream key: a name
  // holding one could give two callers' steps one downstream key.
  if (name.includes('\n')) throw new TypeError(`fastify-idempotency: a step's name holds no line feed (${JSON.stringify(name)})`)
  if (typeof fn !== 'function') throw new TypeError(`fastify-idempotency: step '${name}' needs a function`)
  if (codec !== undefined && (typeof codec?.serialize !== 'function' || typeof codec.deserialize !== 'function')) {
    throw new TypeError(`fastify-idempotency: step '${name}': its third argument is a codec of serialize and deserialize functions`)
  }
  const downstream = { key: downstreamKey(state.storageKey, name), transaction: undefined }
  switch (state.phase) {
    case 'running':
      break
    // failOpen runs the handler without a lease, and before the store's answer (a hook ahead of
    // the handler) there is none yet: nothing to record under.
    case 'unprotected':
    case 'keyed':
    case 'acquiring':
      return await fn(downstream)
    default:
      throw new Error(`fastify-idempotency: step '${name}' was called after the response was sent`)
  }
  const names = state.steps ??= new Set()
  names.add(name)
  if (names.size > MAX_STEPS) throw new RangeError(`fastify-idempotency: a request may run at most ${MAX_STEPS} distinct steps`)

  const { door, settings, renewal } = engine
  if (settings.transaction && door.singleConnection) {
    throw new TypeError(`fastify-idempotency: step '${name}': recovery points in transaction mode need a second connection beside the request's transaction: SQLite has one, and so has a knex pool of max 1 (give it 2 or more)`)
  }
  const recordHash = hash('sha256', `${state.storageKey}\n${name}`, 'base64url')
  const stepKey = stepRecordPrefix(state.storageKey) + recordHash
  let result
  let recordKey = stepKey
  try {
    result = (await door.begin(stepKey, state.fingerprint, renewal)).result
    if (result.state === 'acquired') ({ result, recordKey } = await orLegacyRecord(engine, state.fingerprint, stepKey, result, STEP_KEY_PREFIX + recordHash))
  } catch (error) {
    throw error instanceof UnreadableEntryError ? new IdempotencyStoredResponseUnreadableError(state.key, error) : new IdempotencyStoreUnavailableError(state.key, error)
  }
  if (result.state !== 'acquired') {
    const refusal = fingerprintRefusal(engine, state, result.fingerprint)
    if (refusal !== null) throw refusal
  }
  if (result.state === 'in-flight') {
    throw new IdempotencyRequestInProgressError(state.key, Math.max(0.1, (result.lockExpiresAt - Date.now()) / 1000))
  }
  if (result.state === 'completed') return recorded<T>(engine, state, name, recordKey, result.response, codec)
  return await record(engine, state, name, { stepKey, token: result.token, key: downstream.key }, fn, codec)
}

/**
 * A step that an earlier run completed: its recorded result, opened when sealed. One that ran with
 * its result lost is refused (409 #result-not-recorded): running it again could repeat its side
 * effect, and going on without its result would hand the handler a wrong value.
 */
function recorded<T> ({ door: { cipher }, reporter }: RouteEngine, state: RequestState, name: string, stepKey: string, stored: StoredResponse, codec: ValueCodec<T> | undefined): T {
  let value: T
  try {
    value = decodeValue(cipher === null ? stored : cipher.open(stepKey, stored), codec as ValueCodec | undefined) as T
  } catch (error) {
    if (error instanceof ValueLostError) {
      state.log.error({ idempotencyKey: state.key }, `idempotency step '${name}' ran in an earlier run, and its result could not be recorded (${error.reason}): refused with 409 #result-not-recorded rather than run again`)
      throw new IdempotencyResultNotRecordedError(state.key, error.reason, error)
    }
    reporter.report(state, 'unreadable', { error, step: name }, 'error', `idempotency step '${name}' has a record that cannot be read: refused with 409`)
    throw new IdempotencyStoredResponseUnreadableError(state.key, error)
  }
  reporter.report(state, 'step-replay', { step: name })
  return value
}

/**
 * Run a step whose record this run holds the lease of, and record its result. Whenever it ends
 * without a record, the record's lease is given back (fenced: a record that went through after
 * all stays), so the next run calls `fn` again at once.
 */
async function record<T> (engine: RouteEngine, state: RequestState, name: string, step: { stepKey: string, token: string, key: string }, fn: StepFunction<T>, codec: ValueCodec<T> | undefined): Promise<T> {
  const { door, settings, reporter } = engine
  const { cipher } = door
  const { stepKey, token } = step
  const giveBack = (): Promise<void> => door.giveBack(stepKey, token)
  let transaction: StorageTransaction | null = null
  const rollBack = async (): Promise<void> => { if (transaction !== null) await door.rollback(transaction).catch(() => {}) }
  let value: T
  let stored: StoredResponse
  try {
    if (settings.transaction) transaction = await openTransaction(engine, state)
    value = await fn({ key: step.key, transaction: transaction?.handle })
  } catch (error) {
    // Not recorded: the next run calls `fn` again.
    await rollBack()
    await giveBack()
    throw error
  }
  stored = recordOrLost(value, `step '${name}' returned`, settings.maxResponseBytes, codec as ValueCodec | undefined, (error) => {
    state.log.error({ idempotencyKey: state.key }, `idempotency ${error.message}. The step ran: this run goes on with its result, and a later run of this key that reaches the step is refused (409 #result-not-recorded) rather than running it again. Give the step a codec: step(name, fn, { serialize, deserialize }) (docs/recovery-points.md)`)
  })
  if (cipher !== null) stored = cipher.seal(stepKey, stored)
  let kept: boolean
  try {
    kept = transaction === null
      ? await door.complete(stepKey, token, stored)
      : await door.completeIn(transaction, stepKey, token, stored)
    if (kept && transaction !== null) await door.commit(transaction)
  } catch (error) {
    await rollBack()
    await giveBack()
    reporter.report(state, 'store-error', { phase: 'complete', error }, 'error', `idempotency step '${name}' ran but its result could not be recorded: the request fails, and a retry runs the step again (its downstream key still holds)`)
    throw new IdempotencyStoreUnavailableError(state.key, error)
  }
  if (!kept) {
    await rollBack()
    await giveBack()
    reporter.report(state, 'lease-lost', { phase: 'complete' }, 'warn', `idempotency step '${name}' ran but its lease was lost before its result was recorded`)
    throw new IdempotencyStoreUnavailableError(state.key, new Error(`the lease of step '${name}' was lost`))
  }
  reporter.report(state, 'step-run', { step: name })
  return value
}

/** The key `fn` passes downstream: derived apart from the step's storage key, never equal to it. */
function downstreamKey (storageKey: string, name: string): string {
  return `idem_${hash('sha256', `downstream\n${storageKey}\n${name}`, 'base64url')}`
}

/** Transaction mode: the step's own transaction; refused like the request's when it cannot be opened. */
async function openTransaction ({ door, settings }: RouteEngine, state: RequestState): Promise<StorageTransaction> {
  try {
    // At the route's level: the step's writes are the route's.
    return await door.openTransaction({ ...settings.transaction })
  } catch (error) {
    throw new IdempotencyStoreUnavailableError(state.key, error)
  }
}
