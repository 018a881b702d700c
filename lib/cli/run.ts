/**
 * One run of `fastify-idempotency`: parse the command line, load the configuration, run the
 * operation against the store with the app's own key composition, print the result, close what it
 * opened, and say which exit code the process ends with:
 *
 *   0 done · 1 failed (the store did not answer in time, or failed) · 2 usage or configuration
 *   3 nothing under the key (inspect, forget) · 4 refused (forget of a key in flight) · 5 not supported by the store
 *   (doctor: 0 the store can work, warnings included · 1 a check failed)
 *
 * Nothing is written to the store unless the operation itself does: a bad command line, a key
 * no client could send, or a configuration that cannot be loaded ends before the store is used.
 *
 * A person at a terminal reads sentences: a usage error is one line and a hint to --help, a
 * failure one line that names its cause, a purge shows its progress, and the audit line (JSON, for
 * logs) is left out. With --json, or when stderr is not a terminal (a script, a log collector),
 * the audit line is written to stderr as JSON, as the app's logger would write it.
 */
import { userInfo } from 'node:os'
import { proveStore } from '../engine/store-proof.js'
import { withinTime } from '../engine/time-limit.js'
import { isIdempotencyError } from '../errors.js'
import { IdempotencyOperationNotSupportedError, KeyOperations } from '../operations/index.js'
import { normalizeOptions, toMilliseconds } from '../options.js'
import { parseCommand, USAGE, type Command } from './args.js'
import { ConfigError, loadConfig } from './config.js'
import { ConsoleCapture } from './console-capture.js'
import { forgotten, inFlight, inspection, json, proofReport, span } from './format.js'
import { driverMessage, storeProblem } from './store-problem.js'
import { packageVersion } from './version.js'

export const EXIT = { done: 0, failed: 1, usage: 2, absent: 3, refused: 4, unsupported: 5 } as const

/** Where the command writes, and where it runs. */
export interface CommandIO {
  stdout: (text: string) => void
  stderr: (text: string) => void
  cwd: string
  env: NodeJS.ProcessEnv
  /** stderr is a terminal: a person reads it. */
  terminal?: boolean
}

/** How far a purge got: its batches so far, and when the last one ended. */
interface PurgeProgress { purged: number, batches: number, lastAt: number | null }

/** The command did not finish within --timeout. */
class CommandTimeoutError extends Error {}

const HINT = 'run fastify-idempotency --help for the commands and options'

export async function runCommand (argv: readonly string[], io: CommandIO): Promise<number> {
  let command: Command | 'help' | 'version'
  let timeout: number
  try {
    command = parseCommand(argv, io.env)
    if (command === 'help') {
      io.stdout(`${USAGE}\n`)
      return EXIT.done
    }
    if (command === 'version') {
      io.stdout(`${packageVersion()}\n`)
      return EXIT.done
    }
    timeout = toMilliseconds(command.timeout, '--timeout', 'command line')
    if (command.olderThan !== undefined) toMilliseconds(command.olderThan, '--older-than', 'command line', true)
  } catch (error) {
    io.stderr(`fastify-idempotency: ${(error as Error).message.replace('fastify-idempotency: invalid command line: ', '')}\n${HINT}\n`)
    return EXIT.usage
  }
  let close: (() => Promise<void>) | undefined
  const stop = new AbortController()
  const progress: PurgeProgress = { purged: 0, batches: 0, lastAt: null }
  const capture = new ConsoleCapture()
  capture.start()
  let failed: Failure | null = null
  const running = execute(command, io, (closing) => { close = closing }, stop.signal, progress, timeout)
  try {
    return await withinTime(running, timeout, () => new CommandTimeoutError(`gave up after ${command.timeout} (--timeout)`))
  } catch (error) {
    if (error instanceof CommandTimeoutError) {
      // A purge stops between two batches; a second lets it end and its audit line be written.
      stop.abort(error)
      await withinTime(running, 1000, () => error).catch(() => {})
    }
    failed = failure(error, command, progress, capture.lines)
    return failed.code
  } finally {
    // The store's own connections (a subscriber, a listener); the clients it was given are the
    // module's, which the process exit ends.
    if (close !== undefined) await withinTime(close(), 1000, () => new Error('the store did not close within 1 s')).catch(() => {})
    capture.stop()
    // What the client library printed, unless the line below names the cause or repeats its words.
    const repeated = (line: string): boolean => failed !== null && (failed.named || (failed.cause !== '' && line.includes(failed.cause)))
    for (const line of capture.lines) if (!repeated(line)) io.stderr(`${line}\n`)
    if (failed !== null) io.stderr(`${failed.line}\n`)
  }
}

async function execute (command: Command, io: CommandIO, closing: (close: () => Promise<void>) => void, signal: AbortSignal, progress: PurgeProgress, timeout: number): Promise<number> {
  const config = await loadConfig(command.config, io.cwd)
  if (typeof config.storage.close === 'function') closing(async () => { await config.storage.close!() })
  let settings
  try {
    settings = normalizeOptions(config, config.storage)
  } catch (error) {
    throw new ConfigError(`the config module ${command.config} exports invalid options: ${(error as Error).message.replace(/^fastify-idempotency: /, '')}`)
  }
  const forLogs = command.json || io.terminal !== true
  const audit = (event: object, message: string): void => {
    if (!forLogs) return
    const { error, ...fields } = event as { error?: unknown }
    io.stderr(`${JSON.stringify({ level: error === undefined ? 'info' : 'error', time: new Date().toISOString(), msg: message, idempotencyOperation: fields })}\n`)
  }
  if (command.name === 'doctor') {
    // Half the command's time: a step that hangs is named before the command gives up.
    const proof = await proveStore(config.storage, { wait: true, timeout: Math.max(1, Math.floor(timeout / 2)), via: 'command' })
    io.stdout(command.json ? json(proof) : proofReport(proof))
    return proof.failure === null ? EXIT.done : EXIT.failed
  }
  const operations = new KeyOperations(settings, audit, 'command')
  const actor = command.actor ?? systemUser()
  const now = Date.now
  const print = (value: unknown, text: (now: number) => string): void => { io.stdout(command.json ? json(value) : text(now())) }
  switch (command.name) {
    case 'inspect': {
      const result = await operations.inspect(command.key!, { scope: command.scope ?? null, body: command.body, actor })
      print(result, (at) => inspection(result, at))
      return result.state === 'absent' ? EXIT.absent : EXIT.done
    }
    case 'forget': {
      const result = await operations.forget(command.key!, { scope: command.scope ?? null, force: command.force, actor })
      print(result, (at) => forgotten(result, at))
      if (result.outcome === 'refused') return EXIT.refused
      return result.previous === 'absent' && result.recoveryPoints === 0 ? EXIT.absent : EXIT.done
    }
    case 'in-flight': {
      const result = await operations.inFlight({ ...(command.olderThan === undefined ? {} : { olderThan: command.olderThan }), ...(command.limit === undefined ? {} : { limit: command.limit }), actor })
      print(result, (at) => inFlight(result, at))
      return EXIT.done
    }
    case 'purge': {
      const shown = io.terminal === true && !command.json
      const onProgress = (purged: number): void => {
        Object.assign(progress, { purged, batches: progress.batches + 1, lastAt: Date.now() })
        if (shown) io.stderr(`\rpurging: ${purged.toLocaleString('en-US')} expired entries deleted`)
      }
      try {
        const result = await operations.purge({ actor, onProgress, signal, ...(command.batchSize === undefined ? {} : { batchSize: command.batchSize }) })
        print(result, () => `purged ${result.purged} expired entr${result.purged === 1 ? 'y' : 'ies'}\n`)
        return EXIT.done
      } finally {
        if (shown && progress.batches > 0) io.stderr('\r\u001b[K')
        // A script gets what a stopped or failed purge did on stdout, as it gets a finished one's.
        if (command.json && signal.aborted) io.stdout(json({ purged: progress.purged, complete: false }))
      }
    }
  }
}

/**
 * How the command failed: its exit code, the one line that says why, the store's own words in it,
 * and whether that line names the cause (then what the client library printed is not repeated).
 */
interface Failure { code: number, line: string, cause: string, named: boolean }

function failure (error: unknown, command: Command, progress: PurgeProgress, printed: readonly string[]): Failure {
  const message = (error as Error)?.message ?? String(error)
  let cause = ''
  let named = false
  const said = (code: number, line: string): Failure => ({ code, line, cause, named })
  if (error instanceof ConfigError) return said(EXIT.usage, `fastify-idempotency: ${message}`)
  // A key no client could send: the command line.
  if (isIdempotencyError(error)) return said(EXIT.usage, `fastify-idempotency: the key is not one a client could send: ${message}`)
  if (error instanceof IdempotencyOperationNotSupportedError) return said(EXIT.unsupported, message)
  const problem = storeProblem(error, printed)
  named = problem !== null
  cause = problem ?? driverMessage(error)
  const { name } = command
  const deleted = `${progress.purged.toLocaleString('en-US')} expired entries deleted`
  if (error instanceof CommandTimeoutError) {
    const given = `after ${command.timeout} (--timeout)`
    if (name === 'purge' && progress.lastAt !== null) {
      return said(EXIT.failed, `fastify-idempotency: purge stopped ${given} with ${deleted}, in ${progress.batches} batch${progress.batches === 1 ? '' : 'es'}; ` +
        `the last ended ${span(Date.now() - progress.lastAt)} before: the store was ${named ? `failing: ${cause}` : 'still deleting'}. ` +
        'What is left is deleted by the next purge: run it again, or with a longer --timeout')
    }
    return said(EXIT.failed, `fastify-idempotency: ${name} failed: ${named ? `${cause}; gave up ${given}` : `gave up ${given}: the store did not answer`}`)
  }
  if (name === 'purge' && progress.batches > 0) return said(EXIT.failed, `fastify-idempotency: purge failed with ${deleted}: ${cause}`)
  return said(EXIT.failed, `fastify-idempotency: ${name} failed: ${cause}`)
}

function systemUser (): string | undefined {
  try {
    return userInfo().username
  } catch {
    return undefined
  }
}
