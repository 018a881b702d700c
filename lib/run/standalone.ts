/**
 * The engine without Fastify: `createIdempotency({ storage, ... })` for a worker, a queue consumer
 * or a scheduled job that has no server. Options are normalized as the plugin's are; the store
 * given belongs to the caller (the default MemoryStorage belongs to this object, and `close`
 * closes it).
 */
import { InFlight, reportStillInFlight } from '../engine/in-flight.js'
import type { Logger } from '../engine/report.js'
import { normalizeOptions, toMilliseconds, type IdempotencyOptions } from '../options.js'
import { loggerAudit, type AuditLogger } from '../operations/audit.js'
import { MemoryStorage } from '../storage/memory.js'
import { Idempotency, type IdempotencyApi } from './idempotency.js'

/** The options of `createIdempotency`: the plugin's, but those of HTTP. */
export interface StandaloneOptions extends Pick<IdempotencyOptions,
'storage' | 'expiration' | 'lockTimeout' | 'maxLockHold' | 'storeTimeout' | 'maxResponseBytes' | 'failOpen' | 'wait' | 'waitTimeout' | 'transaction' | 'encryption' | 'maxKeyLength'> {
  /**
   * Where warnings, errors and the operations' audit lines go: a pino logger, or anything with its
   * `debug`, `info`, `warn` and `error`. Default: warnings and errors to the console.
   */
  logger?: Logger & AuditLogger
  /** How long `close()` waits for runs in flight to keep their result (default `'5s'`). */
  closeTimeout?: number | string
}

export interface StandaloneIdempotency extends IdempotencyApi {
  /**
   * Wait for the runs in flight to keep their results (at most `closeTimeout`), refuse new ones,
   * and close the store if this object made it. Call it before closing your store's client.
   */
  close: () => Promise<void>
}

const DEFAULT_CLOSE_TIMEOUT = 5000

const consoleLogger: Logger & AuditLogger = {
  debug: () => {},
  info: () => {},
  warn: (fields, message) => { console.warn(`fastify-idempotency: ${message}`, fields) },
  error: (fields, message) => { console.error(`fastify-idempotency: ${message}`, fields) }
}

/**
 * The engine without Fastify: `createIdempotency({ storage }).run(key, input, fn)` runs `fn` once
 * per key and input, keeps its result for retries, and offers the operations on stored keys
 * (docs/jobs.md).
 */
export function createIdempotency (options: StandaloneOptions = {}): StandaloneIdempotency {
  const { logger = consoleLogger, closeTimeout: closeOption, ...rest } = options
  const closeTimeout = closeOption === undefined ? DEFAULT_CLOSE_TIMEOUT : toMilliseconds(closeOption, 'closeTimeout', 'createIdempotency options')
  const ownStorage = rest.storage === undefined ? new MemoryStorage() : null
  const settings = normalizeOptions(rest, rest.storage ?? ownStorage!)
  const inFlight = new InFlight()
  const idempotency = new Idempotency(settings, loggerAudit(logger), logger, inFlight)
  let closing: Promise<void> | null = null
  return Object.assign(idempotency, {
    close: async (): Promise<void> => {
      closing ??= (async () => {
        for (const [state, reporter] of await inFlight.drain(closeTimeout)) reportStillInFlight(state, reporter)
        idempotency.stop()
        await ownStorage?.close()
      })()
      await closing
    }
  })
}
