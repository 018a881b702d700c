/**
 * One run of `fastify-idempotency`: parse the command line, load the configuration, run the
 * operation against the store with the app's own key composition, print the result, close what it
 * opened, and say which exit code the process ends with:
 *
 *   0 done · 1 failed (the store did not answer in time, or failed) · 2 usage or configuration
 *   3 nothing under the key (inspect, forget) · 4 refused (forget of a key in flight) · 5 not supported by the store
 *
 * Nothing is written to the store unless the operation itself does: a bad command line, a key
 * no client could send, or a configuration that cannot be loaded ends before the store is used.
 */
import { userInfo } from 'node:os'
import { withinTime } from '../engine/time-limit.js'
import { isIdempotencyError } from '../errors.js'
import { IdempotencyOperationNotSupportedError, KeyOperations } from '../operations/index.js'
import { normalizeOptions, toMilliseconds } from '../options.js'
import { parseCommand, USAGE, type Command } from './args.js'
import { ConfigError, loadConfig } from './config.js'
import { forgotten, inFlight, inspection, json } from './format.js'

export const EXIT = { done: 0, failed: 1, usage: 2, absent: 3, refused: 4, unsupported: 5 } as const

/** Where the command writes, and where it runs. */
export interface CommandIO {
  stdout: (text: string) => void
  stderr: (text: string) => void
  cwd: string
  env: NodeJS.ProcessEnv
}

/** The command did not finish within --timeout. */
class CommandTimeoutError extends Error {}

export async function runCommand (argv: readonly string[], io: CommandIO): Promise<number> {
  let command: Command | 'help'
  let timeout: number
  try {
    command = parseCommand(argv, io.env)
    if (command === 'help') {
      io.stdout(`${USAGE}\n`)
      return EXIT.done
    }
    timeout = toMilliseconds(command.timeout, '--timeout', 'command line')
    if (command.olderThan !== undefined) toMilliseconds(command.olderThan, '--older-than', 'command line', true)
  } catch (error) {
    io.stderr(`fastify-idempotency: ${(error as Error).message.replace('fastify-idempotency: invalid command line: ', '')}\n\n${USAGE}\n`)
    return EXIT.usage
  }
  let close: (() => Promise<void>) | undefined
  try {
    return await withinTime(execute(command, io, (closing) => { close = closing }), timeout,
      () => new CommandTimeoutError(`gave up after ${command.timeout} (--timeout): the store did not answer`))
  } catch (error) {
    return failure(error, command.name, io)
  } finally {
    // The store's own connections (a subscriber, a listener); the clients it was given are the
    // module's, which the process exit ends.
    if (close !== undefined) await withinTime(close(), 1000, () => new Error('the store did not close within 1 s')).catch(() => {})
  }
}

async function execute (command: Command, io: CommandIO, closing: (close: () => Promise<void>) => void): Promise<number> {
  const config = await loadConfig(command.config, io.cwd)
  if (typeof config.storage.close === 'function') closing(async () => { await config.storage.close!() })
  let settings
  try {
    settings = normalizeOptions(config, config.storage)
  } catch (error) {
    throw new ConfigError(`the config module ${command.config} exports invalid options: ${(error as Error).message.replace(/^fastify-idempotency: /, '')}`)
  }
  const audit = (event: object, message: string): void => {
    const { error, ...fields } = event as { error?: unknown }
    io.stderr(`${JSON.stringify({ level: error === undefined ? 'info' : 'error', time: new Date().toISOString(), msg: message, idempotencyOperation: fields })}\n`)
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
      const result = await operations.purge({ actor })
      print(result, () => `purged ${result.purged} expired entr${result.purged === 1 ? 'y' : 'ies'}\n`)
      return EXIT.done
    }
  }
}

function failure (error: unknown, name: string, io: CommandIO): number {
  const message = (error as Error)?.message ?? String(error)
  if (error instanceof ConfigError) {
    io.stderr(`fastify-idempotency: ${message}\n`)
    return EXIT.usage
  }
  // A key no client could send: the command line.
  if (isIdempotencyError(error)) {
    io.stderr(`fastify-idempotency: the key is not one a client could send: ${message}\n`)
    return EXIT.usage
  }
  if (error instanceof IdempotencyOperationNotSupportedError) {
    io.stderr(`${message}\n`)
    return EXIT.unsupported
  }
  io.stderr(`fastify-idempotency: ${name} failed: ${message}\n`)
  return EXIT.failed
}

function systemUser (): string | undefined {
  try {
    return userInfo().username
  } catch {
    return undefined
  }
}
