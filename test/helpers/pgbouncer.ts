/**
 * A PgBouncer of the test file's own, on a free loopback port in front of the shared PostgreSQL
 * (whose configuration it never touches), with two databases: `test` in transaction pooling and
 * `test_session` in session pooling, both the shared server's `test` as user postgres. Started
 * once per test file that asks for it, stopped when the file's process exits.
 *
 * Debian's `pgbouncer` package provides it (.ci/run installs it). Without the binary the suites
 * that need it are skipped with the reason; under CI=true a missing PgBouncer is a failure.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { connect, createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { type Availability, POSTGRES, pgConnection, service } from './services.js'

/** Where Debian puts it (outside root's PATH on some images). */
const BINARIES = ['pgbouncer', '/usr/sbin/pgbouncer']

/** Server connections PgBouncer opens to the shared server, at most, per database. */
export const PGBOUNCER_POOL_SIZE = 10

export interface PgBouncer {
  availability: Availability
  /** knex connection settings through it, in transaction pooling. */
  transaction: typeof pgConnection
  /** The same in session pooling. */
  session: typeof pgConnection
}

function binary (): string | undefined {
  return BINARIES.find((candidate) => spawnSync(candidate, ['--version'], { stdio: 'ignore' }).status === 0)
}

async function freePort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as { port: number }
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return port
}

function skipped (reason: string): Availability {
  if (process.env.CI === 'true') throw new Error(`${reason}: under CI=true a missing service is a failure, not a skip`)
  return { available: false, reason: ` [skipped: ${reason}]` }
}

/** Whether something accepts connections on the loopback `port`. */
async function answers (port: number): Promise<boolean> {
  return await new Promise((resolve) => {
    const socket = connect({ host: '127.0.0.1', port })
    socket.once('connect', () => { socket.destroy(); resolve(true) })
    socket.once('error', () => { socket.destroy(); resolve(false) })
  })
}

let started: Promise<PgBouncer> | undefined

/** This test file's PgBouncer, started on first call. */
export function pgbouncer (): Promise<PgBouncer> {
  started ??= start()
  return started
}

async function start (): Promise<PgBouncer> {
  const unavailable = (availability: Availability): PgBouncer => ({ availability, transaction: pgConnection, session: pgConnection })
  const postgres = await service(POSTGRES)
  if (!postgres.available) return unavailable(postgres)
  const command = binary()
  if (command === undefined) return unavailable(skipped('PgBouncer not installed (Debian package pgbouncer)'))

  const dir = mkdtempSync(join(tmpdir(), 'idem-pgbouncer-'))
  // PgBouncer refuses to run as root; as root it is started as postgres, which must read its files.
  chmodSync(dir, 0o755)
  const asRoot = process.getuid?.() === 0
  const target = `host=${pgConnection.host} port=${pgConnection.port} dbname=${pgConnection.database} user=${pgConnection.user}`
  let child: ChildProcess | undefined
  let port = 0
  let output = ''
  for (let attempt = 0; attempt < 5 && child === undefined; attempt++) {
    port = await freePort()
    writeFileSync(join(dir, 'pgbouncer.ini'), [
      '[databases]',
      `${pgConnection.database} = ${target} pool_mode=transaction`,
      `${pgConnection.database}_session = ${target} pool_mode=session`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      'unix_socket_dir =',
      // The shared server trusts loopback: PgBouncer logs every client in as the database's user.
      'auth_type = any',
      'max_client_conn = 2000',
      `default_pool_size = ${PGBOUNCER_POOL_SIZE}`,
      `max_db_connections = ${PGBOUNCER_POOL_SIZE}`,
      'server_reset_query = DISCARD ALL',
      'ignore_startup_parameters = extra_float_digits',
      'log_connections = 0',
      'log_disconnections = 0',
      'logfile =',
      ''
    ].join('\n'), { mode: 0o644 })
    // Through a shell that ends PgBouncer when its standard input closes, which it does however
    // this process ends (a test worker is often killed rather than exited). A background job's
    // standard input is /dev/null, so the watcher reads a copy of it (3).
    const args = [command, ...(asRoot ? ['-u', 'postgres'] : []), join(dir, 'pgbouncer.ini')].map((arg) => `'${arg}'`).join(' ')
    const launched = spawn('sh', ['-c', `exec 3<&0; ${args} </dev/null & p=$!; (cat <&3 >/dev/null; kill $p 2>/dev/null) & wait $p`], { stdio: ['pipe', 'pipe', 'pipe'] })
    launched.stdout!.on('data', (chunk: Buffer) => { output += chunk.toString() })
    launched.stderr!.on('data', (chunk: Buffer) => { output += chunk.toString() })
    const ready = await new Promise<boolean>((resolve) => {
      const timer = setInterval(() => { void answers(port).then((up) => { if (up) done(true) }) }, 50)
      const done = (value: boolean): void => { clearInterval(timer); launched.off('exit', exited); resolve(value) }
      const exited = (): void => done(false)
      launched.once('exit', exited)
    })
    if (ready) child = launched
  }
  if (child === undefined) {
    rmSync(dir, { recursive: true, force: true })
    throw new Error(`PgBouncer did not start: ${output}`)
  }
  const running = child
  running.unref()
  for (const stream of [running.stdin, running.stdout, running.stderr]) (stream as { unref?: () => void } | null)?.unref?.()
  process.once('exit', () => {
    running.stdin!.destroy()
    rmSync(dir, { recursive: true, force: true })
  })
  const through = (database: string): typeof pgConnection => ({ ...pgConnection, host: '127.0.0.1', port, database })
  return {
    availability: { available: true, reason: '' },
    transaction: through(pgConnection.database),
    session: through(`${pgConnection.database}_session`)
  }
}
