/**
 * `fastify-idempotency doctor`: the start-up proof the app makes, from the command's config module,
 * printed check by check with what it found and the cure; exit code 1 when a check failed, 0 when
 * the store can work (warnings included). Against a healthy Redis of the test's own and ones that
 * break the promise (a user without EVALSHA, an evicting policy), the shared PostgreSQL and a role
 * granted SELECT only, and MariaDB; as the bin runs it, and in process.
 */
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import knexFactory from 'knex'
import { Redis } from 'ioredis'
import { runCommand } from '../lib/cli/run.js'
import { KnexStorage, createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { RedisStorage } from '../lib/redis.js'
import { MemoryStorage } from '../lib/index.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service } from './helpers/services.js'
import { redisClusterAvailability, startRedisServer } from './helpers/redis-cluster.js'
import { scaled } from './helpers/pace.js'
import { commandProcess, type CommandRun } from './helpers/command.js'

const root = resolve(import.meta.dirname, '..')
const work = join(root, '.tmp', `doctor-${process.pid}`)
mkdirSync(work, { recursive: true })
afterAll(() => rmSync(work, { recursive: true, force: true }))

/** The config module: the store the environment names; its clients kept to be closed after. */
// In process, the test hands the config its own modules (globalThis.doctorModules): loaded again
// through tsx, the library would be a second copy that coverage counts apart from the first.
const CONFIG = `export default async () => {
  const given = (globalThis as { doctorModules?: Record<string, any> }).doctorModules
  const { knex, Redis, RedisStorage, KnexStorage, MemoryStorage } = given ?? {
    knex: (await import('knex')).default,
    Redis: (await import('ioredis')).Redis,
    RedisStorage: (await import('../../lib/redis.js')).RedisStorage,
    KnexStorage: (await import('../../lib/knex.js')).KnexStorage,
    MemoryStorage: (await import('../../lib/index.js')).MemoryStorage
  }
  const env = process.env
  if (env.DOCTOR_STORE === 'memory') return { storage: new MemoryStorage() }
  const opened = ((globalThis as { doctorClients?: Array<{ disconnect?: () => void, destroy?: () => Promise<void> }> }).doctorClients ??= [])
  if (env.DOCTOR_STORE === 'redis') {
    const client = new Redis({ port: Number(env.DOCTOR_PORT), username: env.DOCTOR_USER, password: env.DOCTOR_PASSWORD, maxRetriesPerRequest: 1 })
    opened.push(client)
    return { storage: new RedisStorage({ client, prefix: 'doctor:', allowEviction: env.DOCTOR_ALLOW_EVICTION === '1' }) }
  }
  const db = knex({ client: env.DOCTOR_STORE!, connection: JSON.parse(env.DOCTOR_CONNECTION!) })
  opened.push(db)
  return { storage: new KnexStorage({ knex: db, tableName: env.DOCTOR_TABLE, createTable: env.DOCTOR_CREATE_TABLE === '1' }) }
}
`
const configFile = join(work, 'doctor.config.ts')
;(globalThis as { doctorModules?: unknown }).doctorModules = { knex: knexFactory, Redis, RedisStorage, KnexStorage, MemoryStorage }
writeFileSync(configFile, CONFIG)

type Run = CommandRun

/** The command in this process, with `env` as the config module reads it. */
async function inProcess (args: string[], env: Record<string, string>): Promise<Run> {
  let stdout = ''
  let stderr = ''
  const saved = { ...process.env }
  Object.assign(process.env, env)
  try {
    const code = await runCommand([...args, '--config', configFile], { stdout: (text) => { stdout += text }, stderr: (text) => { stderr += text }, cwd: root, env: process.env, terminal: true })
    return { code, stdout, stderr }
  } finally {
    for (const name of Object.keys(env)) if (saved[name] === undefined) delete process.env[name]
    Object.assign(process.env, saved)
    const opened = (globalThis as { doctorClients?: Array<{ disconnect?: () => void, destroy?: () => Promise<void> }> }).doctorClients?.splice(0) ?? []
    for (const client of opened) { client.disconnect?.(); await client.destroy?.() }
  }
}

const own = redisClusterAvailability()
const [postgres, mariadb] = await Promise.all([service(POSTGRES), service(MARIADB)])
const stamp = `${process.pid}_${Date.now().toString(36)}`

describe.skipIf(!own.available)(`doctor on a Redis of the test's own${own.reason}`, () => {
  let server: Awaited<ReturnType<typeof startRedisServer>>
  let admin: Redis
  beforeAll(async () => {
    server = await startRedisServer([])
    admin = new Redis({ port: server.port })
    // Persistence on: a healthy server.
    await admin.call('CONFIG', 'SET', 'appendonly', 'yes')
    await admin.call('ACL', 'SETUSER', 'app', 'on', '>secret', '~*', '&*', '+@all')
    await admin.call('ACL', 'SETUSER', 'scripted', 'on', '>secret', '~*', '&*', '+@all', '-evalsha', '-publish')
  }, scaled(60_000))
  afterAll(async () => {
    await admin?.quit()
    await server?.stop()
  })
  const env = (user: string): Record<string, string> => ({ DOCTOR_STORE: 'redis', DOCTOR_PORT: String(server.port), DOCTOR_USER: user, DOCTOR_PASSWORD: 'secret' })

  it('a healthy Redis: every check passed, exit 0', async () => {
    const run = await inProcess(['doctor'], env('app'))
    expect(run.code).toBe(0)
    const lines = run.stdout.split('\n')
    expect(lines[0]).toBe('RedisStorage: start-up proof')
    for (const check of ['SET … PX … NX GET', 'GET', 'renew script', 'PEXPIRE', 'wait-mark script', 'complete and release script', 'PUBLISH and SUBSCRIBE', 'eviction policy', 'persistence']) {
      expect(lines).toContainEqual(expect.stringMatching(new RegExp(`^ok {8}${check.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')} +\\S`)))
    }
    expect(run.stdout).toMatch(/\nRedisStorage can work \(0 failed, 0 warnings, 9 passed\)\n$/)
    expect(run.stderr).toBe('')
  })

  it('a user without EVALSHA nor PUBLISH, on an evicting Redis: each failure and warning with its cure, exit 1; --json for scripts', async () => {
    await admin.call('CONFIG', 'SET', 'maxmemory', '100mb', 'maxmemory-policy', 'allkeys-lru')
    try {
      const run = await inProcess(['doctor'], env('scripted'))
      expect(run.code).toBe(1)
      expect(run.stdout).toMatch(/^FAILED {4}renew script +EVALSHA of the renew script was refused: NOPERM .*\n +cure: allow EVAL and EVALSHA/m)
      expect(run.stdout).toMatch(/^warning {3}PUBLISH and SUBSCRIBE +PUBLISH was refused to the scripts .*\n +cure: to have them woken at once/m)
      expect(run.stdout).toMatch(/^FAILED {4}eviction policy +maxmemory-policy allkeys-lru with maxmemory 104857600 bytes/m)
      expect(run.stdout).toMatch(/\nRedisStorage cannot keep the plugin's promise \(4 failed, 1 warning, \d+ passed\): an app on it does not start \(checkStore\)\n$/)
      const json = await inProcess(['doctor', '--json'], env('scripted'))
      expect(json.code).toBe(1)
      const proof = JSON.parse(json.stdout) as { store: string, failure: string, checks: Array<{ name: string, outcome: string }> }
      expect(proof.store).toBe('RedisStorage')
      expect(proof.failure).toMatch(/^RedisStorage: EVALSHA of the renew script was refused/)
      expect(proof.checks).toContainEqual(expect.objectContaining({ name: 'eviction policy', outcome: 'failed' }))
      // allowEviction: the same policy is a warning.
      const allowed = await inProcess(['doctor'], { ...env('app'), DOCTOR_ALLOW_EVICTION: '1' })
      expect(allowed.code).toBe(0)
      expect(allowed.stdout).toMatch(/^warning {3}eviction policy +maxmemory-policy allkeys-lru .*\n +cure: allowEviction: true accepts this risk/m)
    } finally {
      await admin.call('CONFIG', 'SET', 'maxmemory', '0', 'maxmemory-policy', 'noeviction')
    }
  })

  it('as the bin runs it: a Redis that cannot be reached is one failed check, exit 1', async () => {
    const run = await commandProcess(['doctor', '--config', configFile, '--timeout', '10s'], { ...env('app'), DOCTOR_PORT: '1' })
    expect(run.code).toBe(1)
    expect(run.stdout).toMatch(/^FAILED {4}connection +Redis cannot be reached through the ioredis client: .*\n +cure: check that Redis runs/m)
  }, scaled(30_000))
})

it('doctor on a store without a start-up check says there is nothing to prove, exit 0', async () => {
  const run = await inProcess(['doctor'], { DOCTOR_STORE: 'memory' })
  expect(run).toEqual({ code: 0, stdout: 'MemoryStorage has no start-up check (neither prove() nor ready()): nothing to prove\n', stderr: '' })
})

describe.skipIf(!postgres.available)(`doctor on PostgreSQL${postgres.reason}`, () => {
  const admin = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } })
  const table = `doctor_${stamp}`
  const role = `doctor_${stamp}`
  beforeAll(async () => {
    await createIdempotencyTable(admin, table)
    await admin.raw('CREATE ROLE ?? LOGIN', [role])
    await admin.raw('GRANT SELECT ON ?? TO ??', [table, role])
  })
  afterAll(async () => {
    await dropIdempotencyTable(admin, table)
    await admin.raw('DROP OWNED BY ??; DROP ROLE ??', [role, role])
    await admin.destroy()
  })
  const env = (user: string): Record<string, string> => ({ DOCTOR_STORE: 'pg', DOCTOR_CONNECTION: JSON.stringify({ ...pgConnection, user }), DOCTOR_TABLE: table })

  it('the table usable: every check passed; a role granted SELECT only: INSERT, UPDATE and DELETE failed, with the GRANT to make', async () => {
    const healthy = await inProcess(['doctor'], env(pgConnection.user))
    expect(healthy.code).toBe(0)
    expect(healthy.stdout).toMatch(/^ok {8}DELETE +a lease can be given back \(rolled back\)$/m)
    const denied = await inProcess(['doctor'], env(role))
    expect(denied.code).toBe(1)
    for (const statement of ['INSERT', 'UPDATE', 'DELETE']) {
      expect(denied.stdout).toMatch(new RegExp(`^FAILED {4}${statement} +${statement} on the table "${table}" was refused: permission denied for table ${table} \\(42501\\)\\n +cure: grant the app's role SELECT, INSERT, UPDATE and DELETE`, 'm'))
    }
  })

  it('a table missing, with createTable: the check says it created the table (what the app does at its start), not that it was there', async () => {
    const created = `${table}_created`
    try {
      const run = await inProcess(['doctor'], { ...env(pgConnection.user), DOCTOR_TABLE: created, DOCTOR_CREATE_TABLE: '1' })
      expect(run.code).toBe(0)
      expect(run.stdout).toMatch(new RegExp(`^ok {8}table +"${created}" was missing: created now \\(createTable: true\\), as the app does at its start$`, 'm'))
      const again = await inProcess(['doctor'], { ...env(pgConnection.user), DOCTOR_TABLE: created, DOCTOR_CREATE_TABLE: '1' })
      expect(again.stdout).toMatch(new RegExp(`^ok {8}table +"${created}" is there$`, 'm'))
    } finally {
      await dropIdempotencyTable(admin, created)
    }
  })
})

describe.skipIf(!mariadb.available)(`doctor on MariaDB${mariadb.reason}`, () => {
  const table = `doctor_${stamp}`
  const admin = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 1 } })
  beforeAll(async () => { await createIdempotencyTable(admin, table) })
  afterAll(async () => {
    await dropIdempotencyTable(admin, table)
    await admin.destroy()
  })

  it('a table missing: the cure says how to make it', async () => {
    const run = await inProcess(['doctor'], { DOCTOR_STORE: 'mysql2', DOCTOR_CONNECTION: JSON.stringify(mysqlConnection), DOCTOR_TABLE: `${table}_missing` })
    expect(run.code).toBe(1)
    expect(run.stdout).toMatch(/^FAILED {4}table +the table "doctor_.*_missing" does not exist\n +cure: create it with createTable: true/m)
    const healthy = await inProcess(['doctor'], { DOCTOR_STORE: 'mysql2', DOCTOR_CONNECTION: JSON.stringify(mysqlConnection), DOCTOR_TABLE: table })
    expect(healthy.code).toBe(0)
  })
})
