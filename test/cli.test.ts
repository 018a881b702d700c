/**
 * The `fastify-idempotency` command. Against a real Redis, PostgreSQL, MariaDB and SQLite, as a
 * child process loading a TypeScript config module with encryption on, beside an app that uses
 * the same store: `--json` output parsed, exit codes, and a forgotten key that runs afresh. Bad
 * input (an unknown command or option, a config that throws or has no storage, a key no client
 * could send, a store that is down) ends with a clear message on stderr, a non-zero exit, and the
 * store as it was.
 */
import { spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { createServer } from 'node:net'
import { join, resolve } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import Fastify, { type FastifyInstance } from 'fastify'
import { Redis } from 'ioredis'
import knexFactory, { type Knex } from 'knex'
import idempotency, { MemoryStorage, type IdempotencyStorage } from '../lib/index.js'
import { KnexStorage, dropIdempotencyTable } from '../lib/knex.js'
import { RedisStorage } from '../lib/redis.js'
import { runCommand, type CommandIO } from '../lib/cli/run.js'
import { MARIADB, POSTGRES, REDIS, deleteRedisPrefix, mysqlConnection, pgConnection, service } from './helpers/services.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'
import { postWithKey } from './helpers/http-client.js'
import { commandProcess, type CommandRun as Run } from './helpers/command.js'
import { scaled } from './helpers/pace.js'

/** Node 22.18 and later (and 23.6) load TypeScript modules themselves, without tsx. */
const stripsTypes = Boolean((process.features as { typescript?: unknown }).typescript)
const root = resolve(import.meta.dirname, '..')
const work = join(root, '.tmp', `cli-${process.pid}`)
mkdirSync(work, { recursive: true })
afterAll(() => rmSync(work, { recursive: true, force: true }))

const KEY = randomBytes(32).toString('base64')
const SECRET = randomBytes(32).toString('base64')
const encryption = { keys: [KEY], keyHashSecret: SECRET }

/** The config module the child loads: the store named by the environment, with encryption. */
const CONFIG = `import knex from 'knex'
import { Redis } from 'ioredis'
import { RedisStorage } from '../../lib/redis.js'
import { KnexStorage } from '../../lib/knex.js'

const env = process.env
const sql = (client: string, connection: object) => new KnexStorage({ knex: knex({ client, connection, useNullAsDefault: true }), tableName: env.CLI_TABLE })
const storage = () => {
  switch (env.CLI_STORE) {
    case 'redis': return new RedisStorage({ client: new Redis({ host: '127.0.0.1', port: Number(env.CLI_PORT), maxRetriesPerRequest: 1 }), prefix: env.CLI_PREFIX })
    case 'postgres': return sql('pg', { ...JSON.parse(env.CLI_CONNECTION!), port: Number(env.CLI_PORT) })
    case 'mariadb': return sql('mysql2', { ...JSON.parse(env.CLI_CONNECTION!), port: Number(env.CLI_PORT) })
    default: return sql('better-sqlite3', { filename: env.CLI_FILE })
  }
}
export default { storage: storage(), encryption: { keys: [env.CLI_KEY!], keyHashSecret: env.CLI_SECRET! } }
`
const configFile = join(work, 'config.ts')
writeFileSync(configFile, CONFIG)

/** The command as a child process, as its bin runs it. */
const command = commandProcess

/** A port nothing listens on. */
async function closedPort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as { port: number }
  await new Promise((resolve) => server.close(resolve))
  return port
}

interface Target {
  name: string
  port: number
  available: boolean
  reason: string
  env: Record<string, string>
  create: () => IdempotencyStorage
  /** Everything the store holds for this test, as text. */
  dump: () => Promise<string>
  cleanup: () => Promise<void>
}

const stamp = `${process.pid}_${Date.now()}`
const [redis, postgres, mariadb] = await Promise.all([service(REDIS), service(POSTGRES), service(MARIADB)])

function redisTarget (): Target {
  const prefix = `cli:${stamp}:`
  const client = new Redis({ host: REDIS.host, port: REDIS.port, lazyConnect: true })
  return {
    name: 'redis',
    port: REDIS.port,
    ...redis,
    env: { CLI_STORE: 'redis', CLI_PREFIX: prefix },
    create: () => new RedisStorage({ client, prefix }),
    dump: async () => {
      // Not a probe of the app's start-up check (RedisStorage.prove), which deletes it as it ends.
      const keys = (await client.keys(`${prefix}*`)).filter((key) => !key.includes('{%probe:')).sort()
      return JSON.stringify(await Promise.all(keys.map(async (key) => [key, (await client.getBuffer(key))?.toString('base64')])))
    },
    cleanup: async () => {
      await deleteRedisPrefix(client, prefix)
      client.disconnect()
    }
  }
}

function sqlTarget (name: string, client: string, port: number, availability: { available: boolean, reason: string }, connection: object): Target {
  const table = `cli_${stamp}_${name}`
  let knex: Knex | undefined
  const db = () => (knex ??= knexFactory({ client, connection, useNullAsDefault: true }))
  return {
    name,
    port,
    ...availability,
    env: { CLI_STORE: name, CLI_TABLE: table, CLI_CONNECTION: JSON.stringify(connection), CLI_FILE: (connection as { filename?: string }).filename ?? '' },
    create: () => new KnexStorage({ knex: db(), tableName: table, createTable: true }),
    dump: async () => JSON.stringify(await db()(table).select('*').orderBy('idempotency_key')),
    cleanup: async () => {
      if (knex === undefined) return
      await dropIdempotencyTable(knex, table)
      await knex.destroy()
    }
  }
}

const targets: Target[] = [
  redisTarget(),
  sqlTarget('postgres', 'pg', POSTGRES.port, postgres, pgConnection),
  sqlTarget('mariadb', 'mysql2', MARIADB.port, mariadb, mysqlConnection),
  sqlTarget('sqlite', 'better-sqlite3', 0, { available: true, reason: '' }, { filename: join(work, 'cli.db') })
]

for (const target of targets) {
  describe.skipIf(!target.available)(`the command on ${target.name}${target.reason}`, () => {
    let app: FastifyInstance
    let url = ''
    let runs = 0
    let release: () => void = () => {}
    let enter: () => void = () => {}
    const entered = new Promise<void>((resolve) => { enter = resolve })
    const env = { ...target.env, CLI_PORT: String(target.port), CLI_KEY: KEY, CLI_SECRET: SECRET }
    const run = async (...args: string[]) => await command([...args, '--config', configFile], env)
    const post = (key: string, headers: Record<string, string> = {}) => postWithKey(`${url}/orders`, key, '{"sku":"A1"}', headers)

    beforeAll(async () => {
      app = Fastify()
      await app.register(idempotency, { storage: target.create(), encryption, scope: (request) => String(request.headers['x-tenant'] ?? 'none') })
      app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
        runs++
        if (request.headers['x-hold'] === '1') {
          await new Promise<void>((resolve) => {
            release = resolve
            enter()
          })
        }
        reply.code(201)
        return { run: runs, tenant: request.headers['x-tenant'] }
      })
      url = await app.listen({ host: '127.0.0.1', port: 0 })
    })
    afterAll(async () => {
      release()
      await app.close()
      await target.cleanup()
    })

    it('inspects, lists, refuses and forgets with --json, with the exit codes scripts use, then purges where the store needs it', async () => {
      const first = await post('order-1', { 'x-tenant': 'acme' })
      expect(first.status).toBe(201)
      const held = post('order-2', { 'x-tenant': 'acme', 'x-hold': '1' })
      await entered

      const [stored, body, absent, listed, refused] = await Promise.all([
        run('inspect', 'order-1', '--scope', 'acme', '--json'),
        run('inspect', '"order-1"', '-s', 'acme', '--body', '--json'),
        run('inspect', 'order-1', '--json'),
        run('in-flight', '--json', '--actor', 'support:alice'),
        run('forget', 'order-2', '--scope', 'acme', '--json')
      ])
      expect(stored.code, stored.stderr).toBe(0)
      expect(JSON.parse(stored.stdout)).toMatchObject({ key: 'order-1', scope: 'acme', state: 'stored', statusCode: 201, bodyBytes: Buffer.byteLength(first.body), bodyOmitted: false })
      expect(JSON.parse(stored.stdout)).not.toHaveProperty('body')
      expect(Buffer.from(JSON.parse(body.stdout).body, 'base64').toString()).toBe(first.body)
      expect([absent.code, JSON.parse(absent.stdout).state]).toEqual([3, 'absent'])
      expect(listed.code, listed.stderr).toBe(0)
      const leases = JSON.parse(listed.stdout).leases as Array<{ key: string | null, storageKey: string, heldMs: number }>
      // With encryption the store holds a keyed hash: the listing cannot say whose key it is.
      expect(leases).toHaveLength(1)
      expect(leases[0]).toMatchObject({ key: null, scope: null })
      expect(leases[0]!.storageKey.startsWith('\u0000hmac:')).toBe(true)
      expect(leases[0]!.heldMs).toBeGreaterThanOrEqual(0)
      expect(JSON.parse(listed.stderr.trim().split('\n').at(-1)!)).toMatchObject({ level: 'info', idempotencyOperation: { operation: 'in-flight', actor: 'support:alice', via: 'command', listed: 1 } })
      expect([refused.code, JSON.parse(refused.stdout).outcome]).toEqual([4, 'refused'])

      const inFlight = await run('inspect', 'order-2', '--scope', 'acme')
      expect(inFlight.code).toBe(0)
      expect(inFlight.stdout).toMatch(/^state +in flight/m)
      release()
      expect((await held).status).toBe(201)

      const forgotten = await run('forget', 'order-1', '--scope', 'acme', '--actor', 'support:bob')
      expect(forgotten.code, forgotten.stderr).toBe(0)
      expect(forgotten.stdout).toMatch(/^forgotten: key "order-1" \(scope "acme"\) \(it was stored/)
      expect(forgotten.stderr).toContain('idempotency forget of key \\"order-1\\" (scope \\"acme\\") by support:bob: forgotten')
      const retry = await post('order-1', { 'x-tenant': 'acme' })
      expect([retry.replayed, JSON.parse(retry.body).run]).toEqual([false, 3])
      expect((await run('forget', 'order-none')).code).toBe(3)

      const purge = await run('purge', '--json')
      if (target.name === 'redis') {
        expect(purge.code).toBe(5)
        expect(purge.stderr).toMatch(/RedisStorage does not support purge/)
      } else {
        expect(purge.code, purge.stderr).toBe(0)
        expect(JSON.parse(purge.stdout)).toEqual({ purged: 0 })
      }
    })

    it('refuses bad input with a clear message and a non-zero exit, leaving the store as it was', async () => {
      await post('kept', { 'x-tenant': 'acme' })
      const before = await target.dump()
      const throwing = join(work, `throws-${target.name}.mjs`)
      writeFileSync(throwing, 'throw new Error("no credentials in this environment")\n')
      const empty = join(work, `empty-${target.name}.mjs`)
      writeFileSync(empty, 'export default { encryption: undefined }\n')
      const cases: Array<[string[], number, RegExp]> = [
        [['frobnicate', 'kept'], 2, /unknown command 'frobnicate'/],
        [['inspect', 'kept', '--verbose'], 2, /Unknown option '--verbose'/],
        [['inspect', 'kept', '--force'], 2, /--force does not apply to inspect/],
        [['forget', 'kept', '--config', throwing], 2, /config module .*throws-.*failed: no credentials in this environment/],
        [['forget', 'kept', '--config', empty], 2, /exports no storage/],
        [['forget', 'two words', '--force'], 2, /the key is not one a client could send/],
        [['forget', 'x'.repeat(256), '--force'], 2, /longer than 255/]
      ]
      // These are refused before any store is opened, the same whichever store the config names:
      // they run once, on SQLite (which needs no service), and each store gets its outage below.
      const checked = target.name === 'sqlite' ? cases : []
      const results = await Promise.all(checked.map(async ([args]) => await command([...args, ...(args.includes('--config') ? [] : ['--config', configFile])], env)))
      for (const [index, [args, code, message]] of checked.entries()) {
        expect(results[index]!.code, args.join(' ')).toBe(code)
        expect(results[index]!.stderr, args.join(' ')).toMatch(message)
        expect(results[index]!.stdout).toBe('')
      }
      // A server that does not answer; for SQLite, a database file that cannot be opened.
      const unreachable = { ...env, CLI_PORT: String(await closedPort()), CLI_FILE: join(work, 'no-such-directory', 'cli.db') }
      const sql = target.name !== 'redis'
      const [down, noTable, denied] = await Promise.all([
        // --timeout counts loading the config module too (knex, ioredis, the sources through tsx):
        // 5 s on a quiet machine, scaled on a loaded one, where that alone can take longer.
        command(['forget', 'kept', '--scope', 'acme', '--force', '--config', configFile, '--timeout', String(scaled(5000))], unreachable),
        // A table the database does not have; credentials the server refuses (MariaDB's root has no password here).
        sql ? command(['inspect', 'kept', '--config', configFile], { ...env, CLI_TABLE: `missing_${stamp}` }) : undefined,
        target.name === 'mariadb' ? command(['inspect', 'kept', '--config', configFile], { ...env, CLI_CONNECTION: JSON.stringify({ ...mysqlConnection, password: 'not-the-password' }) }) : undefined
      ])
      expect(down.code, down.stderr).toBe(1)
      const cause = target.name === 'sqlite' ? /forget failed: Cannot open database because the directory does not exist/ : /^fastify-idempotency: forget failed: cannot connect to the store at 127\.0\.0\.1:\d+: connection refused \(is it running, and are the host and port in the config module right\?\)$/m
      expect(down.stderr).toMatch(cause)
      // No stack trace, from the client library or the command: stderr is not a terminal here, so
      // the audit line (JSON) comes first, then the one line that says why.
      expect(down.stderr).not.toMatch(/^\s+at /m)
      expect(down.stderr.trim().split('\n').map((line) => line.startsWith('{') ? 'audit' : 'message')).toEqual(['audit', 'message'])
      expect(down.stdout).toBe('')
      if (noTable !== undefined) {
        expect(noTable.code, noTable.stderr).toBe(1)
        expect(noTable.stderr).toMatch(new RegExp(`^fastify-idempotency: inspect failed: the table (test\\.)?missing_${stamp} does not exist: create it \\(createIdempotencyTable in a migration, or createTable: true in the app\\)`, 'm'))
      }
      if (denied !== undefined) {
        expect(denied.code, denied.stderr).toBe(1)
        expect(denied.stderr).toMatch(/^fastify-idempotency: inspect failed: the store refused the credentials \(Access denied for user 'root'@.*\): check the user and password the config module gives$/m)
      }
      expect(await target.dump()).toBe(before)
    })
  })
}

describe('the command, in process', () => {
  const memory = new MemoryStorage()
  const configs = {
    memory: join(work, 'memory.mjs'),
    bare: join(work, 'bare.mjs'),
    invalid: join(work, 'invalid.mjs'),
    factory: join(work, 'factory.cjs')
  }
  beforeAll(() => {
    const store = globalThis as { cliTestStorage?: IdempotencyStorage, cliBareStorage?: IdempotencyStorage }
    const bare = { begin: memory.begin.bind(memory), complete: memory.complete.bind(memory), release: memory.release.bind(memory), renew: memory.renew.bind(memory) }
    // Without `close`: the command closes the store it loaded, and this one is shared with the test's app.
    store.cliTestStorage = { ...bare, inspect: memory.inspect.bind(memory), forget: memory.forget.bind(memory), listInFlight: memory.listInFlight.bind(memory) }
    store.cliBareStorage = bare
    writeFileSync(configs.memory, 'export const storage = globalThis.cliTestStorage\n')
    writeFileSync(configs.bare, 'export default { storage: globalThis.cliBareStorage }\n')
    writeFileSync(configs.invalid, 'export default { storage: globalThis.cliTestStorage, encryption: { keys: [] } }\n')
    writeFileSync(configs.factory, 'module.exports = async () => ({ storage: globalThis.cliTestStorage, maxKeyLength: 8 })\n')
  })

  async function inProcess (...args: string[]): Promise<Run> {
    return await inDirectory(work, ...args)
  }

  async function inDirectory (cwd: string, ...args: string[]): Promise<Run> {
    return await run(cwd, false, args)
  }

  /** As a person at a terminal runs it: stderr is a TTY. */
  async function inTerminal (...args: string[]): Promise<Run> {
    return await run(work, true, args)
  }

  async function run (cwd: string, terminal: boolean, args: string[]): Promise<Run> {
    let stdout = ''
    let stderr = ''
    const io: CommandIO = { stdout: (text) => { stdout += text }, stderr: (text) => { stderr += text }, cwd, env: {}, terminal }
    return { code: await runCommand(args, io), stdout, stderr }
  }

  /** A config module whose store is `storage`, under `name`. */
  function configWith (name: string, storage: Partial<IdempotencyStorage>): string {
    const stores = globalThis as { cliStores?: Record<string, unknown> }
    stores.cliStores = { ...stores.cliStores, [name]: { begin: memory.begin.bind(memory), complete: memory.complete.bind(memory), release: memory.release.bind(memory), renew: memory.renew.bind(memory), ...storage } }
    writeFileSync(join(work, `${name}.mjs`), `export default { storage: globalThis.cliStores[${JSON.stringify(name)}] }\n`)
    return `${name}.mjs`
  }

  it.skipIf(spawnSync('script', ['--version']).status !== 0)('tells a terminal from a pipe by stderr, as its bin runs', async () => {
    writeFileSync(join(work, 'own-memory.mjs'), 'import { MemoryStorage } from \'../../lib/index.ts\'\nexport default { storage: new MemoryStorage() }\n')
    const args = ['in-flight', '-c', join(work, 'own-memory.mjs')]
    const piped = await command(args, {})
    expect(piped.code, piped.stderr).toBe(0)
    expect(JSON.parse(piped.stderr)).toMatchObject({ msg: expect.stringMatching(/^idempotency in-flight/) })
    // util-linux's script gives the command a pseudo-terminal, on which stdout and stderr meet.
    const line = [process.execPath, '--import', 'tsx', join(root, 'lib/cli/main.ts'), ...args].map((arg) => `'${arg}'`).join(' ')
    const terminal = spawnSync('script', ['-qec', line, '/dev/null'], { cwd: root, encoding: 'utf8' })
    expect([terminal.status, terminal.stdout.replace(/\r/g, '')]).toEqual([0, 'no keys in flight\n'])
  })

  it('prints its version with --version and -v', async () => {
    const { version } = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { version: string }
    for (const flag of ['--version', '-v']) expect(await inProcess(flag)).toEqual({ code: 0, stdout: `${version}\n`, stderr: '' })
  })

  it('answers a usage error with its reason and one line of hint, not the whole usage', async () => {
    for (const result of [await inProcess('frobnicate', 'k'), await inTerminal('frobnicate', 'k')]) {
      expect(result).toEqual({ code: 2, stdout: '', stderr: "fastify-idempotency: unknown command 'frobnicate'\nrun fastify-idempotency --help for the commands and options\n" })
    }
    for (const [args, message] of [
      [['inspect', 'k', '--batch-size', '10', '-c', 'memory.mjs'], '--batch-size does not apply to inspect'],
      [['purge', '--batch-size', '0', '-c', 'memory.mjs'], "--batch-size must be a positive integer (got '0')"]
    ] as Array<[string[], string]>) {
      expect((await inProcess(...args)).stderr).toBe(`fastify-idempotency: ${message}\nrun fastify-idempotency --help for the commands and options\n`)
    }
  })

  it('writes the audit line as JSON with --json or when stderr is not a terminal, and leaves it out for a person at one', async () => {
    const audit = (stderr: string): unknown => JSON.parse(stderr.trim()).idempotencyOperation
    const person = await inTerminal('in-flight', '-c', 'memory.mjs')
    expect([person.code, person.stdout, person.stderr]).toEqual([0, 'no keys in flight\n', ''])
    expect(audit((await inProcess('in-flight', '-c', 'memory.mjs')).stderr)).toMatchObject({ operation: 'in-flight', via: 'command', listed: 0 })
    const scripted = await inTerminal('in-flight', '--json', '-c', 'memory.mjs')
    expect(JSON.parse(scripted.stdout)).toEqual({ leases: [], complete: true })
    expect(audit(scripted.stderr)).toMatchObject({ operation: 'in-flight', listed: 0 })
  })

  it('names the cause of a store failure in one line: a missing table, refused credentials, a refused connection, no stack trace', async () => {
    const failing = (error: unknown) => async () => { throw error }
    const pg = (code: string, message: string): Error => Object.assign(new Error(message), { code })
    const refused = Object.assign(new AggregateError([
      Object.assign(new Error('connect ECONNREFUSED ::1:5499'), { code: 'ECONNREFUSED' }),
      Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5499'), { code: 'ECONNREFUSED' })
    ]), { code: 'ECONNREFUSED' })
    // ioredis says why it cannot connect only in an 'error' event, which it prints with its stack.
    const ioredis = async (): Promise<never> => {
      console.error('[ioredis] Unhandled error event: Error: connect ECONNREFUSED 127.0.0.1:6390\n    at TCPConnectWrap.afterConnect [as oncomplete] (node:net:1611:16)')
      throw new Error('Reached the max retries per request limit (which is 1). Refer to "maxRetriesPerRequest" option for details.')
    }
    const cases: Array<[Partial<IdempotencyStorage>, string]> = [
      [{ inspect: failing(pg('42P01', 'select "fingerprint", "state" from "orders_keys" where "idempotency_key" = $1 - relation "orders_keys" does not exist')) },
        'the table orders_keys does not exist: create it (createIdempotencyTable in a migration, or createTable: true in the app), or give the config module the app\'s tableName'],
      [{ inspect: failing(pg('28P01', 'password authentication failed for user "app"')) },
        'the store refused the credentials (password authentication failed for user "app"): check the user and password the config module gives'],
      [{ inspect: failing(refused) }, 'cannot connect to the store at ::1:5499: connection refused (is it running, and are the host and port in the config module right?)'],
      [{ inspect: ioredis }, 'cannot connect to the store at 127.0.0.1:6390: connection refused (is it running, and are the host and port in the config module right?)'],
      [{ inspect: failing(new Error('select 1 from "t" - canceling statement due to statement timeout')) }, 'canceling statement due to statement timeout']
    ]
    for (const [index, [storage, cause]] of cases.entries()) {
      const config = configWith(`broken-${index}`, storage)
      const person = await inTerminal('inspect', 'k', '-c', config)
      expect([person.code, person.stdout, person.stderr], cause).toEqual([1, '', `fastify-idempotency: inspect failed: ${cause}\n`])
      // Not a terminal: the audit line first, then the same line.
      const logged = await inProcess('inspect', 'k', '-c', config)
      const lines = logged.stderr.trim().split('\n')
      expect(JSON.parse(lines[0]!)).toMatchObject({ level: 'error', idempotencyOperation: { operation: 'inspect' } })
      expect(lines.slice(1)).toEqual([`fastify-idempotency: inspect failed: ${cause}`])
    }
    // What a client library prints while the command succeeds reaches stderr once, its first line only.
    const chatty = configWith('chatty', {
      listInFlight: async () => {
        console.warn('[WARN] Redis server does not require a password, but a password was supplied.\n    at somewhere')
        console.warn('[WARN] Redis server does not require a password, but a password was supplied.')
        return { leases: [], complete: true }
      }
    })
    expect(await inTerminal('in-flight', '-c', chatty)).toEqual({ code: 0, stdout: 'no keys in flight\n', stderr: '[WARN] Redis server does not require a password, but a password was supplied.\n' })
  })

  it('purges in batches of --batch-size, with its progress on a terminal', async () => {
    const sizes: Array<number | undefined> = []
    const config = configWith('purging', {
      purgeExpired: async (options) => {
        sizes.push(options?.batchSize)
        for (const done of [2, 4]) options?.onProgress?.(done)
        return 5
      }
    })
    const person = await inTerminal('purge', '--batch-size', '2', '-c', config)
    expect(person).toEqual({ code: 0, stdout: 'purged 5 expired entries\n', stderr: '\rpurging: 2 expired entries deleted\rpurging: 4 expired entries deleted\r\u001b[K' })
    const logged = await inProcess('purge', '-c', config)
    expect([logged.code, logged.stdout]).toEqual([0, 'purged 5 expired entries\n'])
    expect(JSON.parse(logged.stderr)).toMatchObject({ level: 'info', idempotencyOperation: { operation: 'purge', purged: 5 } })
    expect(sizes).toEqual([2, undefined])
  })

  it('says how much a purge deleted when it stops at --timeout or fails midway, and why', async () => {
    let stopped: unknown
    const stalls = configWith('purge-stalls', {
      purgeExpired: async (options) => {
        options?.onProgress?.(1000)
        options?.onProgress?.(2000)
        // The third batch never ends: the command's timeout aborts the signal.
        return await new Promise<number>((resolve, reject) => options?.signal?.addEventListener('abort', () => {
          stopped = options.signal!.reason
          reject(options.signal!.reason)
        }))
      }
    })
    const person = await inTerminal('purge', '--timeout', '200', '-c', stalls)
    expect([person.code, person.stdout]).toEqual([1, ''])
    const [progress, said] = person.stderr.split('\r\u001b[K')
    expect(progress).toBe('\rpurging: 1,000 expired entries deleted\rpurging: 2,000 expired entries deleted')
    expect(said).toMatch(/^fastify-idempotency: purge stopped after 200 \(--timeout\) with 2,000 expired entries deleted, in 2 batches; the last ended \S+ before: the store was still deleting\. What is left is deleted by the next purge: run it again, or with a longer --timeout\n$/)
    expect(stopped).toBeInstanceOf(Error)
    const scripted = await inProcess('purge', '--json', '--timeout', '200', '-c', stalls)
    expect(JSON.parse(scripted.stdout)).toEqual({ purged: 2000, complete: false })
    const [auditLine, message] = scripted.stderr.trim().split('\n')
    expect(JSON.parse(auditLine!)).toMatchObject({ level: 'error', msg: expect.stringMatching(/^idempotency purge by .* failed after 2000 expired entries deleted: gave up after 200 \(--timeout\)$/), idempotencyOperation: { operation: 'purge', purged: 2000 } })
    expect(message).toMatch(/^fastify-idempotency: purge stopped after 200 \(--timeout\) with 2,000 expired entries deleted/)

    const fails = configWith('purge-fails', {
      purgeExpired: async (options) => {
        options?.onProgress?.(1000)
        throw new Error('delete from "idempotency_keys" where ctid in (select ctid from "idempotency_keys" limit 1000) - canceling statement due to statement timeout')
      }
    })
    expect((await inTerminal('purge', '-c', fails)).stderr).toBe('\rpurging: 1,000 expired entries deleted\r\u001b[Kfastify-idempotency: purge failed with 1,000 expired entries deleted: canceling statement due to statement timeout\n')
  })

  it.skipIf(!redisClusterAvailability().available)('names credentials a Redis server refuses', async () => {
    const server = await startRedisServer(['--requirepass', 'the-password'])
    try {
      // The client is the test's to end: the command leaves it to the process exit, and this test process goes on.
      writeFileSync(join(work, 'redis-password.mjs'), `import { Redis } from 'ioredis'\nimport { RedisStorage } from '../../lib/redis.ts'\nconst client = globalThis.cliRedisClient = new Redis({ port: ${server.port}, password: 'not-the-password', maxRetriesPerRequest: 1, lazyConnect: true })\nexport default { storage: new RedisStorage({ client }) }\n`)
      const person = await inTerminal('inspect', 'k', '-c', 'redis-password.mjs')
      expect([person.code, person.stdout, person.stderr]).toEqual([1, '', 'fastify-idempotency: inspect failed: the store refused the credentials (WRONGPASS invalid username-password pair or user is disabled.): check the user and password the config module gives\n'])
    } finally {
      (globalThis as { cliRedisClient?: Redis }).cliRedisClient?.disconnect()
      await server.stop()
    }
  })

  it('prints its usage with --help, and for a command line it cannot use', async () => {
    const help = await inProcess('--help')
    expect(help.code).toBe(0)
    expect(help.stdout).toMatch(/^Usage: fastify-idempotency <command>/)
    for (const [args, message] of [
      [[], /no command given/],
      [['inspect', '-c', 'memory.mjs'], /inspect needs the key/],
      [['in-flight', 'extra', '-c', 'memory.mjs'], /unexpected argument 'extra'/],
      [['forget', 'k', 'extra', '-c', 'memory.mjs'], /unexpected argument 'extra'/],
      [['inspect', 'k'], /--config is required/],
      [['in-flight', '--limit', '0', '-c', 'memory.mjs'], /--limit must be a positive integer/],
      [['in-flight', '--older-than', 'soon', '-c', 'memory.mjs'], /--older-than must be/],
      [['in-flight', '--timeout', 'never', '-c', 'memory.mjs'], /--timeout must be/],
      [['inspect', 'k', '-c', 'missing.mjs'], /missing\.mjs does not exist/],
      [['inspect', 'k', '-c', 'invalid.mjs'], /exports invalid options: .*encryption\.keys/]
    ] as Array<[string[], RegExp]>) {
      const result = await inProcess(...args)
      expect(result.code, args.join(' ')).toBe(2)
      expect(result.stderr, args.join(' ')).toMatch(message)
    }
  })

  it('reads named exports, CommonJS and factories, and prints tables for people', async () => {
    const app = Fastify()
    await app.register(idempotency, { storage: memory })
    let release = () => {}
    app.post('/orders', { config: { idempotency: true } }, async (request) => {
      if (request.headers['x-hold'] === '1') await new Promise<void>((resolve) => { release = resolve })
      return { ok: true }
    })
    await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'done' } })
    const held = app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'held', 'x-hold': '1' } })
    await expect.poll(async () => (await app.idempotency.inspect('held')).state).toBe('in-flight')

    const stored = await inProcess('inspect', 'done', '--body', '-c', 'memory.mjs')
    expect(stored.code).toBe(0)
    expect(stored.stdout).toMatch(/^status +200$/m)
    expect(stored.stdout).toMatch(/^body +11 bytes$/m)
    expect(stored.stdout).toContain('\n{"ok":true}\n')
    const listing = await inProcess('in-flight', '--limit', '5', '-c', 'factory.cjs')
    expect(listing.stdout).toMatch(/^KEY +SCOPE +HELD +SINCE +LEASE ENDS\nheld +- +\S+/)
    expect(listing.stdout).toMatch(/^1 key in flight$/m)
    expect((await inProcess('in-flight', '--older-than', '1h', '-c', 'memory.mjs')).stdout).toBe('no keys in flight\n')
    const all = await inProcess('in-flight', '--older-than', '0', '-c', 'memory.mjs')
    expect(all.stdout, all.stderr).toMatch(/^1 key in flight$/m)
    // The factory's maxKeyLength: the key is checked as the app would check it.
    expect((await inProcess('inspect', 'longer-than-8', '-c', 'factory.cjs')).stderr).toMatch(/longer than 8/)
    const refused = await inProcess('forget', 'held', '-c', 'memory.mjs')
    expect([refused.code, refused.stdout]).toEqual([4, expect.stringMatching(/^refused: key "held" is in flight, its lease ends .*--force removes it/)])
    const forced = await inProcess('forget', 'held', '--force', '-c', 'memory.mjs')
    expect([forced.code, forced.stdout]).toEqual([0, 'forgotten: key "held" (it was in flight; 0 recovery-point records removed). The next request with it runs afresh.\n'])
    expect((await inProcess('forget', 'held', '-c', 'memory.mjs')).stdout).toBe('nothing to forget: nothing is held under key "held"\n')
    expect((await inProcess('in-flight', '-c', 'memory.mjs')).stdout).toBe('no keys in flight\n')
    release()
    await held
    await app.close()
  })

  it('refuses an unknown option, a config module that throws, one without storage, and TypeScript without tsx, before any store is used', async () => {
    writeFileSync(join(work, 'throws.mjs'), 'throw new Error("vault sealed")\n')
    writeFileSync(join(work, 'nothing.mjs'), 'export default 42\n')
    const elsewhere = mkdtempSync(join(tmpdir(), 'idem-cli-'))
    try {
      writeFileSync(join(elsewhere, 'config.ts'), 'export default {}\n')
      for (const [args, message] of [
        [['inspect', 'k', '--verbose', '-c', 'memory.mjs'], /Unknown option '--verbose'/],
        [['inspect', 'k', '-c', 'throws.mjs'], /throws\.mjs failed: vault sealed/],
        [['inspect', 'k', '-c', 'nothing.mjs'], /nothing\.mjs exports no storage/],
        // Only where Node cannot strip types itself: there a TypeScript module needs tsx.
        ...(stripsTypes ? [] : [[['inspect', 'k', '-c', 'config.ts'], /is TypeScript, which this Node\.js does not load by itself: install tsx/]])
      ] as Array<[string[], RegExp]>) {
        // The TypeScript module in a project without tsx; the others in this file's directory.
        const result = args.includes('config.ts') ? await inDirectory(elsewhere, ...args) : await inProcess(...args)
        expect(result.code, args.join(' ')).toBe(2)
        expect(result.stderr).toMatch(message)
        expect(result.stdout).toBe('')
      }
    } finally {
      rmSync(elsewhere, { recursive: true, force: true })
    }
  })

  it.skipIf(stripsTypes)(`loads a TypeScript config module through the project's tsx where Node does not strip types${stripsTypes ? ' [skipped: this Node strips types itself]' : ''}`, async () => {
    writeFileSync(join(work, 'typed.cts'), 'const options: { storage: unknown } = { storage: (globalThis as { cliTestStorage?: unknown }).cliTestStorage }\nexport default options\n')
    const result = await inProcess('in-flight', '--json', '-c', 'typed.cts')
    expect(result.code, result.stderr).toBe(0)
    expect(JSON.parse(result.stdout)).toMatchObject({ complete: true })
  })

  it('ends with exit code 1 when the store fails or does not answer within --timeout', async () => {
    const failing = globalThis as { cliFailingStorage?: IdempotencyStorage }
    failing.cliFailingStorage = {
      begin: memory.begin.bind(memory),
      complete: memory.complete.bind(memory),
      release: memory.release.bind(memory),
      renew: memory.renew.bind(memory),
      inspect: async () => { throw new Error('connection reset') },
      listInFlight: async () => await new Promise(() => {})
    }
    writeFileSync(join(work, 'failing.mjs'), 'export default { storage: globalThis.cliFailingStorage }\n')
    const failed = await inProcess('inspect', 'k', '-c', 'failing.mjs')
    expect([failed.code, failed.stdout]).toEqual([1, ''])
    expect(failed.stderr).toMatch(/fastify-idempotency: inspect failed: connection reset/)
    expect(failed.stderr).toMatch(/"level":"error".*inspect of key \\"k\\" by .* failed: connection reset/)
    const hung = await inProcess('in-flight', '--timeout', '50', '-c', 'failing.mjs')
    expect([hung.code, hung.stdout]).toEqual([1, ''])
    expect(hung.stderr, hung.stderr).toMatch(/in-flight failed: gave up after 50 \(--timeout\): the store did not answer/)
  })

  it('shows what encryption hides, a binary body, scopes, and a sealed entry it cannot open', async () => {
    const sealing = { keys: [randomBytes(32)], keyHashSecret: randomBytes(32) }
    const app = Fastify()
    await app.register(idempotency, { storage: memory, encryption: sealing, scope: (request) => String(request.headers['x-tenant']) })
    let release = () => {}
    app.post('/files', { config: { idempotency: true } }, async (request, reply) => {
      if (request.headers['x-hold'] === '1') await new Promise<void>((resolve) => { release = resolve })
      reply.type('application/octet-stream')
      return Buffer.from([0xff, 0xfe, 0x00, 0x01])
    })
    await app.inject({ method: 'POST', url: '/files', headers: { 'idempotency-key': 'bin', 'x-tenant': 'acme' } })
    const held = app.inject({ method: 'POST', url: '/files', headers: { 'idempotency-key': 'held', 'x-tenant': 'acme', 'x-hold': '1' } })
    await expect.poll(async () => (await app.idempotency.inspect('held', { scope: 'acme' })).state).toBe('in-flight')
    const store = globalThis as { cliSealing?: unknown, cliOtherKey?: unknown }
    store.cliSealing = sealing
    store.cliOtherKey = { keys: [randomBytes(32)], keyHashSecret: sealing.keyHashSecret }
    writeFileSync(join(work, 'sealed.mjs'), 'export default { storage: globalThis.cliTestStorage, encryption: globalThis.cliSealing }\n')
    writeFileSync(join(work, 'rotated.mjs'), 'export default { storage: globalThis.cliTestStorage, encryption: globalThis.cliOtherKey }\n')

    const binary = await inProcess('inspect', 'bin', '-s', 'acme', '--body', '-c', 'sealed.mjs')
    expect(binary.stdout).toMatch(/^scope +acme$/m)
    expect(binary.stdout).toContain('body (base64): //4AAQ==')
    const json = JSON.parse((await inProcess('inspect', 'bin', '-s', 'acme', '--body', '--json', '-c', 'sealed.mjs')).stdout)
    expect(json).toMatchObject({ state: 'stored', contentType: 'application/octet-stream', bodyBytes: 4, body: '//4AAQ==' })
    const inFlight = await inProcess('inspect', 'held', '-s', 'acme', '-c', 'sealed.mjs')
    expect(inFlight.stdout).toMatch(/^state +in flight: a request holds the key\nsince +\S+Z \(\S+ ago\)\nlease ends +\S+Z \(in \S+\)$/m)
    const listing = await inProcess('in-flight', '-c', 'sealed.mjs')
    expect(listing.stdout).toMatch(/^"\\u0000hmac:[\w-]{43}" \(hashed\) +- /m)
    const unreadable = await inProcess('inspect', 'bin', '-s', 'acme', '-c', 'rotated.mjs')
    expect(unreadable.code).toBe(0)
    expect(unreadable.stdout).toMatch(/^sealed +cannot be opened: the entry was sealed with a key that is no longer configured$/m)
    release()
    await held
    await app.close()
  })

  it('addresses the requests a scoped route got without a caller with --no-caller', async () => {
    const app = Fastify()
    await app.register(idempotency, { storage: memory, scope: (request) => request.headers['x-tenant'] as string | undefined })
    app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
    await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'anon-1' }, payload: {} })
    const inspected = await inProcess('inspect', 'anon-1', '--no-caller', '-c', 'memory.mjs')
    expect(inspected.stdout).toMatch(/^scope +\(no caller\)$/m)
    expect(inspected.stdout).toMatch(/^state +stored$/m)
    expect((await inProcess('inspect', 'anon-1', '-s', 'none', '-c', 'memory.mjs')).code).toBe(3)
    const both = await inProcess('inspect', 'anon-1', '--no-caller', '-s', 'none', '-c', 'memory.mjs')
    expect([both.code, both.stderr]).toEqual([2, expect.stringContaining('--scope and --no-caller are two scopes')])
    const forgot = await inProcess('forget', 'anon-1', '--no-caller', '-c', 'memory.mjs')
    expect(forgot.stdout).toContain('forgotten: key "anon-1" (no caller)')
    await app.close()
  })

  it('says what the store does not support, with exit code 5', async () => {
    for (const name of ['inspect k', 'forget k', 'in-flight', 'purge']) {
      const result = await inProcess(...name.split(' '), '-c', 'bare.mjs')
      expect(result.code, name).toBe(5)
      expect(result.stderr).toMatch(/does not support/)
    }
  })
})
