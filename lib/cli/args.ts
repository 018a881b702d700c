/**
 * The command line of `fastify-idempotency`: one command, its key where it takes one, and the
 * options, checked strictly (an unknown option, or one the command does not take, is a usage
 * error, before anything is loaded).
 */
import { parseArgs } from 'node:util'
import { NO_CALLER_SCOPE } from '../operations/index.js'

export type CommandName = 'inspect' | 'forget' | 'in-flight' | 'purge' | 'doctor'

export interface Command {
  name: CommandName
  /** inspect, forget: the key as typed. */
  key?: string
  config: string
  scope?: string
  body: boolean
  force: boolean
  olderThan?: string
  limit?: number
  /** purge: rows deleted per statement. */
  batchSize?: number
  actor?: string
  json: boolean
  /** Milliseconds or a duration, for the whole command. */
  timeout: string
}

/** The command line is wrong: exit 2 with this message and a hint to --help. */
class UsageError extends Error {}

export const USAGE = `Usage: fastify-idempotency <command> [key] --config <module> [options]

Commands:
  inspect <key>      what is held under the key: absent, in flight or stored (exit 3 when absent)
  forget <key>       remove it and its recovery-point records, so that it runs afresh
                     (exit 3 when nothing was there, 4 when it is in flight and --force is not given)
  in-flight          the keys held now, oldest first
  purge              delete expired entries (stores that need it: KnexStorage)
  doctor             prove the store as the app does when it starts: each command, privilege
                     and setting requests need, what was found, and the cure (exit 1 on a failure)

Options:
  -c, --config <module>   a module whose default export is { storage, encryption? }, the options
                          the app registers the plugin with (or FASTIFY_IDEMPOTENCY_CONFIG)
  -s, --scope <scope>     the scope, as the app's scope(request) returns it for the client
      --no-caller         the requests a scoped route got without a caller (its scope
                          returned undefined or null), instead of --scope
      --body              inspect: print the stored body too
  -f, --force             forget: remove a key in flight too
      --older-than <age>  in-flight: held for longer than this (ms, or '30s', '5m', '1h')
      --limit <n>         in-flight: at most this many (default 100)
      --batch-size <n>    purge: rows deleted per statement (default 1000)
      --actor <name>      who asks, for the audit line (default: the system user)
      --json              print JSON, for scripts; with it, or when stderr is not a terminal,
                          the audit line goes to stderr as JSON
      --timeout <time>    give up after this long (default 30s)
  -v, --version           the version
  -h, --help              this text

Exit codes: 0 done, 1 failed (the store did not answer, or failed), 2 usage or configuration,
3 nothing under the key, 4 refused (the key is in flight), 5 the store does not support it.`

const COMMANDS: readonly CommandName[] = ['inspect', 'forget', 'in-flight', 'purge', 'doctor']
/** The options only some commands take. */
const ONLY: Record<string, readonly CommandName[]> = {
  scope: ['inspect', 'forget'],
  'no-caller': ['inspect', 'forget'],
  body: ['inspect'],
  force: ['forget'],
  'older-than': ['in-flight'],
  limit: ['in-flight'],
  'batch-size': ['purge']
}

/** The command, `'help'`, `'version'`, or a UsageError. */
export function parseCommand (argv: readonly string[], env: NodeJS.ProcessEnv): Command | 'help' | 'version' {
  let parsed
  try {
    parsed = parseArgs({
      args: [...argv],
      allowPositionals: true,
      strict: true,
      options: {
        config: { type: 'string', short: 'c' },
        scope: { type: 'string', short: 's' },
        'no-caller': { type: 'boolean' },
        body: { type: 'boolean' },
        force: { type: 'boolean', short: 'f' },
        'older-than': { type: 'string' },
        limit: { type: 'string' },
        'batch-size': { type: 'string' },
        actor: { type: 'string' },
        json: { type: 'boolean' },
        timeout: { type: 'string' },
        help: { type: 'boolean', short: 'h' },
        version: { type: 'boolean', short: 'v' }
      }
    })
  } catch (error) {
    throw new UsageError((error as Error).message)
  }
  const { values, positionals } = parsed
  if (values.help === true) return 'help'
  if (values.version === true) return 'version'
  const [name, key, ...extra] = positionals
  if (name === undefined) throw new UsageError('no command given')
  if (!COMMANDS.includes(name as CommandName)) throw new UsageError(`unknown command '${name}'`)
  const command = name as CommandName
  const takesKey = command === 'inspect' || command === 'forget'
  if (takesKey && key === undefined) throw new UsageError(`${command} needs the key`)
  if ((!takesKey && key !== undefined) || extra.length > 0) throw new UsageError(`unexpected argument '${takesKey ? extra[0] : key}'`)
  for (const [option, commands] of Object.entries(ONLY)) {
    if (values[option as keyof typeof values] !== undefined && !commands.includes(command)) throw new UsageError(`--${option} does not apply to ${command}`)
  }
  if (values['no-caller'] === true && values.scope !== undefined) throw new UsageError('--scope and --no-caller are two scopes: give one')
  const scope = values['no-caller'] === true ? NO_CALLER_SCOPE : values.scope
  const config = values.config ?? env.FASTIFY_IDEMPOTENCY_CONFIG
  if (config === undefined || config === '') throw new UsageError('--config is required (or FASTIFY_IDEMPOTENCY_CONFIG)')
  const limit = positiveInteger(values.limit, '--limit')
  const batchSize = positiveInteger(values['batch-size'], '--batch-size')
  return {
    name: command,
    ...(takesKey ? { key } : {}),
    config,
    ...(scope !== undefined ? { scope } : {}),
    body: values.body === true,
    force: values.force === true,
    ...(values['older-than'] !== undefined ? { olderThan: values['older-than'] } : {}),
    ...(limit !== undefined ? { limit } : {}),
    ...(batchSize !== undefined ? { batchSize } : {}),
    ...(values.actor !== undefined ? { actor: values.actor } : {}),
    json: values.json === true,
    timeout: values.timeout ?? '30s'
  }
}

function positiveInteger (value: string | undefined, option: string): number | undefined {
  if (value === undefined) return undefined
  const number = Number(value)
  if (!/^\d+$/.test(value) || number < 1 || !Number.isSafeInteger(number)) throw new UsageError(`${option} must be a positive integer (got '${value}')`)
  return number
}
