/**
 * KnexStorage proves at start that it can write, update and delete its rows, not only read them:
 * over PostgreSQL roles and MariaDB users of the test's own (granted SELECT only, or all but
 * DELETE, or without CREATE), a role whose transactions are read-only by default, a read-only
 * MariaDB session and a read-only SQLite file, `app.ready()` fails with one line naming what was
 * refused, the server's own words (never the statement knex puts in front of them) and the cure.
 */
import { spawnSync } from 'node:child_process'
import { chmodSync, mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { KnexStorage, createIdempotencyTable, dropIdempotencyTable } from '../lib/knex.js'
import { expiryIndexName } from '../lib/storage/knex/schema.js'
import { startError } from './helpers/start-error.js'
import { MARIADB, POSTGRES, mysqlConnection, pgConnection, service } from './helpers/services.js'

const [postgres, mariadb] = await Promise.all([service(POSTGRES), service(MARIADB)])
const stamp = `${process.pid}_${Date.now().toString(36)}`

describe.skipIf(!postgres.available)(`KnexStorage's start-up proof on PostgreSQL roles of the test's own${postgres.reason}`, () => {
  const admin = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 2 } })
  const table = `proof_${stamp}`
  const roles: string[] = []
  const instances: Knex[] = []
  const rlsTables: string[] = []
  beforeAll(async () => { await createIdempotencyTable(admin, table) })
  afterAll(async () => {
    for (const knex of instances) await knex.destroy()
    await dropIdempotencyTable(admin, table)
    for (const rlsTable of rlsTables) await dropIdempotencyTable(admin, rlsTable)
    for (const role of roles) await admin.raw('DROP OWNED BY ??; DROP ROLE ??', [role, role])
    await admin.destroy()
  })

  /** A login role of the test's own, granted `privileges` on the table, and a store connecting as it. */
  async function as (privileges: string, options: { tableName?: string, createTable?: boolean } = {}): Promise<KnexStorage> {
    const role = `idem_${stamp}_${roles.length}`
    roles.push(role)
    await admin.raw('CREATE ROLE ?? LOGIN', [role])
    if (privileges !== '') await admin.raw(`GRANT ${privileges} ON ?? TO ??`, [table, role])
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, user: role } })
    instances.push(knex)
    return new KnexStorage({ knex, tableName: options.tableName ?? table, createTable: options.createTable ?? false })
  }

  it('a role granted SELECT only fails the start at the INSERT, with the server\'s words and the GRANT to make', async () => {
    expect(await startError(await as('SELECT'))).toBe(`fastify-idempotency: the store cannot work: KnexStorage: INSERT on the table "${table}" was refused: permission denied for table ${table} (42501): ` +
      `grant the app's role SELECT, INSERT, UPDATE and DELETE on "${table}": every request writes its key there, and gives it back with a DELETE (and 2 more checks failed: UPDATE, DELETE) (checkStore: false starts the app anyway)`)
  })

  it('a role without DELETE fails the start at the DELETE', async () => {
    expect(await startError(await as('SELECT, INSERT, UPDATE'))).toMatch(/KnexStorage: DELETE on the table "proof_.*" was refused: permission denied for table proof_\S+ \(42501\): grant the app's role SELECT, INSERT, UPDATE and DELETE/)
  })

  it('a role whose transactions are read-only by default fails the start, saying so', async () => {
    const storage = await as('SELECT, INSERT, UPDATE, DELETE')
    await admin.raw('ALTER ROLE ?? SET default_transaction_read_only = on', [roles[roles.length - 1]!])
    expect(await startError(storage)).toMatch(new RegExp(`KnexStorage: INSERT on the table "${table}" was refused: cannot execute INSERT in a read-only transaction \\(25006\\) \\(default_transaction_read_only is on for this role or database\\): the database is read-only to this connection: give the app the primary's address`))
  })

  it('a role granted all it needs starts, and nothing of the proof is left in the table', async () => {
    expect(await startError(await as('SELECT, INSERT, UPDATE, DELETE'))).toBeNull()
    expect(await admin(table).count({ n: '*' })).toEqual([{ n: '0' }])
  })

  it('a connection given as a function (only knex\'s pool knows it) is proven through the pool', async () => {
    const knex = knexFactory({ client: 'pg', connection: async () => pgConnection })
    instances.push(knex)
    const checks = await new KnexStorage({ knex, tableName: table }).prove({ wait: false })
    expect(checks.map((check) => `${check.name} ${check.outcome}`)).toEqual(['connection passed', 'table passed', 'SELECT passed', 'INSERT passed', 'UPDATE passed', 'DELETE passed'])
  })

  /** A role granted all four on a table of its own with row-level security, and policies for `commands` only. */
  async function underRowSecurity (commands: string[]): Promise<{ storage: KnexStorage, tableName: string }> {
    const tableName = `proof_rls_${stamp}_${roles.length}`
    await createIdempotencyTable(admin, tableName)
    rlsTables.push(tableName)
    const storage = await as('', { tableName })
    const role = roles[roles.length - 1]!
    await admin.raw('GRANT SELECT, INSERT, UPDATE, DELETE ON ?? TO ??', [tableName, role])
    await admin.raw('ALTER TABLE ?? ENABLE ROW LEVEL SECURITY', [tableName])
    for (const command of commands) {
      await admin.raw(`CREATE POLICY ?? ON ?? FOR ${command} TO ?? ${command === 'INSERT' ? 'WITH CHECK (true)' : 'USING (true)'}`, [`p_${command.toLowerCase()}`, tableName, role])
    }
    return { storage, tableName }
  }

  it('row-level security without a policy for UPDATE (PostgreSQL updates no row, and says nothing) fails the start at the UPDATE', async () => {
    const { storage, tableName } = await underRowSecurity(['SELECT', 'INSERT', 'DELETE'])
    expect(await startError(storage)).toBe(`fastify-idempotency: the store cannot work: KnexStorage: UPDATE on the table "${tableName}" changed no row: the probe row inserted just before was not found (row-level security is on for the table: no policy lets this role update its rows?): ` +
      `give the app's role row-level security policies on "${tableName}" for SELECT, INSERT, UPDATE and DELETE of every row (USING (true)), or exempt it (BYPASSRLS): without it no response is stored, and each key stays locked (checkStore: false starts the app anyway)`)
  })

  it('row-level security without a policy for DELETE fails the start at the DELETE', async () => {
    const { storage, tableName } = await underRowSecurity(['SELECT', 'INSERT', 'UPDATE'])
    expect(await startError(storage)).toMatch(new RegExp(`KnexStorage: DELETE on the table "${tableName}" changed no row: the probe row inserted just before was not found \\(row-level security is on for the table: no policy lets this role delete its rows\\?\\)`))
  })

  it('row-level security with a policy for every command starts', async () => {
    const { storage } = await underRowSecurity(['SELECT', 'INSERT', 'UPDATE', 'DELETE'])
    expect(await startError(storage)).toBeNull()
  })

  it('createTable on a role without CREATE, whose table a migration made, starts: the table is there', async () => {
    expect(await startError(await as('SELECT, INSERT, UPDATE, DELETE', { createTable: true }))).toBeNull()
  })

  it('a role whose search_path misses the table\'s schema fails the start naming the search_path and where the table is', async () => {
    const storage = await as('SELECT, INSERT, UPDATE, DELETE')
    await admin.raw('ALTER ROLE ?? SET search_path = \'\'', [roles[roles.length - 1]!])
    expect(await startError(storage)).toBe(`fastify-idempotency: the store cannot work: KnexStorage: the table "${table}" is not in a schema on the connection's search_path ("") but in "public": ` +
      `give tableName its schema ("public.${table}"), or give the app's role a search_path that holds it (ALTER ROLE ... SET search_path) (checkStore: false starts the app anyway)`)
  })

  it('a role granted the table but not USAGE on its schema fails the start naming USAGE, with createTable or not', async () => {
    const schema = `proof_schema_${stamp}`
    await admin.raw('CREATE SCHEMA ??', [schema])
    try {
      await createIdempotencyTable(admin, `${schema}.keys`)
      for (const createTable of [false, true]) {
        const storage = await as('', { tableName: `${schema}.keys`, createTable })
        await admin.raw('GRANT SELECT, INSERT, UPDATE, DELETE ON ??.keys TO ??', [schema, roles[roles.length - 1]!])
        expect(await startError(storage)).toMatch(new RegExp(`^fastify-idempotency: the store cannot work: KnexStorage: SELECT on the table "${schema}\\.keys" was refused: permission denied for schema ${schema} \\(42501\\): ` +
          `grant the app's role USAGE on the schema "${schema}" \\(GRANT USAGE ON SCHEMA ${schema} TO \\.\\.\\.\\): it may not reach the tables in it`))
      }
    } finally {
      await admin.raw('DROP SCHEMA ?? CASCADE', [schema])
    }
  })

  it('a table a migration holds locked fails the start saying so, past storeTimeout or past statementTimeout, once', async () => {
    const locked = `proof_locked_${stamp}`
    rlsTables.push(locked)
    await createIdempotencyTable(admin, locked)
    const migration = await admin.transaction()
    try {
      await migration.raw('LOCK TABLE ?? IN ACCESS EXCLUSIVE MODE', [locked])
      const knex = knexFactory({ client: 'pg', connection: pgConnection })
      instances.push(knex)
      const pastStoreTimeout = await startError(new KnexStorage({ knex, tableName: locked }), { storeTimeout: 500 })
      expect(pastStoreTimeout).toBe(`fastify-idempotency: the store cannot work: KnexStorage: SELECT on the table "${locked}" got no answer: SELECT: no answer before the proof's time was up: ` +
        'the table is locked (a migration, a VACUUM FULL, a long transaction), or the database is too busy: start the app once what holds it is done (pg_locks, SHOW PROCESSLIST), or give the check more time (storeTimeout) (checkStore: false starts the app anyway)')
      const atLockTimeout = await startError(new KnexStorage({ knex, tableName: locked, statementTimeout: 200 }), { storeTimeout: 5000 })
      expect(atLockTimeout).toMatch(new RegExp(`^fastify-idempotency: the store cannot work: KnexStorage: SELECT on the table "${locked}" got no answer: Defined query timeout of 200ms exceeded when running query\\.: the table is locked`))
      expect(atLockTimeout).not.toContain('more check')
    } finally {
      await migration.rollback()
    }
  })

  it('createTable on a table that is there adds only the expiry index it lacks', async () => {
    const tableName = `proof_index_${stamp}`
    rlsTables.push(tableName)
    await createIdempotencyTable(admin, tableName)
    await admin.raw('DROP INDEX ??', [expiryIndexName(tableName)])
    await createIdempotencyTable(admin, tableName)
    const { rows } = await admin.raw('SELECT indexname FROM pg_indexes WHERE tablename = ? ORDER BY indexname', [tableName])
    expect(rows.map((row: { indexname: string }) => row.indexname)).toEqual([`${tableName}_expires_idx`, `${tableName}_in_flight_idx`, `${tableName}_pkey`])
  })

  it('createTable on a role without CREATE on the schema fails with the server\'s reason, not the statement\'s first line', async () => {
    const error = await startError(await as('', { tableName: `proof_new_${stamp}`, createTable: true }))
    expect(error).toBe(`fastify-idempotency: the store cannot work: KnexStorage: the table "proof_new_${stamp}" cannot be created: permission denied for schema public (42501): ` +
      'grant the app\'s role CREATE on the schema, or create the table beforehand with createIdempotencyTable in a migration run by a role that may, and set createTable: false (checkStore: false starts the app anyway)')
  })

  it('a schema-qualified tableName whose schema does not exist fails with the server\'s reason', async () => {
    const error = await startError(await as('', { tableName: `nowhere_${stamp}.keys`, createTable: true }))
    expect(error).toMatch(new RegExp(`KnexStorage: the table "nowhere_${stamp}\\.keys" cannot be created: schema "nowhere_${stamp}" does not exist \\(3F000\\): create the schema \\(or database\\) first`))
  })
})

describe.skipIf(!mariadb.available)(`KnexStorage's start-up proof on MariaDB users of the test's own${mariadb.reason}`, () => {
  const admin = knexFactory({ client: 'mysql2', connection: mysqlConnection, pool: { min: 0, max: 2 } })
  const table = `proof_${stamp}`
  const users: string[] = []
  const instances: Knex[] = []
  beforeAll(async () => { await createIdempotencyTable(admin, table) })
  afterAll(async () => {
    for (const knex of instances) await knex.destroy()
    await dropIdempotencyTable(admin, table)
    for (const user of users) await admin.raw('DROP USER ?@?', [user, '%'])
    await admin.destroy()
  })

  async function as (privileges: string, options: { tableName?: string, createTable?: boolean, config?: Partial<Knex.Config> } = {}): Promise<KnexStorage> {
    const user = `idem_${stamp}_${users.length}`.slice(0, 32)
    users.push(user)
    await admin.raw('CREATE USER ?@? IDENTIFIED BY ?', [user, '%', 'secret'])
    if (privileges !== '') await admin.raw(`GRANT ${privileges} ON ??.?? TO ?@?`, [mysqlConnection.database, table, user, '%'])
    const knex = knexFactory({ client: 'mysql2', connection: { ...mysqlConnection, user, password: 'secret' }, ...options.config })
    instances.push(knex)
    return new KnexStorage({ knex, tableName: options.tableName ?? table, createTable: options.createTable ?? false })
  }

  it('a user granted SELECT only fails the start at the INSERT', async () => {
    expect(await startError(await as('SELECT'))).toMatch(/KnexStorage: INSERT on the table "proof_.*" was refused: INSERT command denied to user 'idem_[^']*'@'[^']*' for table `test`\.`proof_[^`]*` \(ER_TABLEACCESS_DENIED_ERROR\): grant the app's role SELECT, INSERT, UPDATE and DELETE/)
  })

  it('a user granted all it needs starts: its UPDATE and DELETE each found the probe row', async () => {
    const checks = await (await as('SELECT, INSERT, UPDATE, DELETE')).prove({ wait: false })
    expect(checks.map((check) => `${check.name} ${check.outcome}`)).toEqual(['connection passed', 'table passed', 'SELECT passed', 'INSERT passed', 'UPDATE passed', 'DELETE passed'])
  })

  it('a user without DELETE fails the start at the DELETE', async () => {
    expect(await startError(await as('SELECT, INSERT, UPDATE'))).toMatch(/KnexStorage: DELETE on the table "proof_.*" was refused: DELETE command denied to user /)
  })

  it('a session whose transactions are read-only fails the start, saying so', async () => {
    const readOnly = { pool: { afterCreate: (connection: { query: (sql: string, done: (error: Error | null) => void) => void }, done: (error: Error | null, connection: unknown) => void) => { connection.query('SET SESSION TRANSACTION READ ONLY', (error) => { done(error, connection) }) } } }
    expect(await startError(await as('SELECT, INSERT, UPDATE, DELETE', { config: readOnly }))).toMatch(/KnexStorage: INSERT on the table "proof_.*" was refused: Cannot execute statement in a READ ONLY transaction.*: the database is read-only to this connection: give the app the primary's address \(not a reader endpoint or a replica\), and no read-only default for its user or session \(transaction_read_only, read_only\)/)
  })

  it('sessions with autocommit off (init_connect or a pool hook) fail the start: no write of the store would ever be committed', async () => {
    const autocommitOff = { pool: { afterCreate: (connection: { query: (sql: string, done: (error: Error | null) => void) => void }, done: (error: Error | null, connection: unknown) => void) => { connection.query('SET autocommit = 0', (error) => { done(error, connection) }) } } }
    expect(await startError(await as('SELECT, INSERT, UPDATE, DELETE', { config: autocommitOff }))).toBe('fastify-idempotency: the store cannot work: KnexStorage: autocommit is off on the store\'s connections (@@autocommit = 0): ' +
      'no lease or response it writes would be committed, and a duplicate on another connection would wait on its row until storeTimeout: turn it on for the app\'s connections (the server\'s autocommit or init_connect, or the pool\'s afterCreate) (checkStore: false starts the app anyway)')
  })

  it('createTable for a user without CREATE, whose table a migration made, starts: the table is there', async () => {
    expect(await startError(await as('SELECT, INSERT, UPDATE, DELETE', { createTable: true }))).toBeNull()
  })

  it('createTable for a user without CREATE fails with the server\'s reason', async () => {
    // Granted something in the database, so that it may connect to it.
    expect(await startError(await as('SELECT', { tableName: `proof_new_${stamp}`, createTable: true }))).toMatch(/KnexStorage: the table "proof_new_.*" cannot be created: CREATE command denied to user .*: grant the app's role CREATE/)
  })
})

describe('KnexStorage\'s start-up proof on a SQLite file opened read-only', () => {
  const dir = mkdtempSync(join(tmpdir(), 'idem-proof-'))
  const filename = join(dir, 'store.sqlite')
  const instances: Knex[] = []
  afterAll(async () => {
    for (const knex of instances) await knex.destroy()
    rmSync(dir, { recursive: true, force: true })
  })

  it('a writable file passes every check: its UPDATE and DELETE each found the probe row', async () => {
    const writer = knexFactory({ client: 'better-sqlite3', connection: { filename: join(dir, 'writable.sqlite') }, useNullAsDefault: true })
    instances.push(writer)
    const checks = await new KnexStorage({ knex: writer, tableName: 'keys', createTable: true }).prove({ wait: false })
    expect(checks.map((check) => `${check.name} ${check.outcome}`)).toEqual(['connection passed', 'table passed', 'SELECT passed', 'INSERT passed', 'UPDATE passed', 'DELETE passed'])
  })

  it('a trigger that silently skips deletes (RAISE(IGNORE)) fails the start at the DELETE', async () => {
    const writer = knexFactory({ client: 'better-sqlite3', connection: { filename: join(dir, 'ignoring.sqlite') }, useNullAsDefault: true })
    instances.push(writer)
    await createIdempotencyTable(writer, 'keys')
    await writer.raw('CREATE TRIGGER keep_keys BEFORE DELETE ON keys BEGIN SELECT RAISE(IGNORE); END')
    expect(await startError(new KnexStorage({ knex: writer, tableName: 'keys' }))).toBe('fastify-idempotency: the store cannot work: KnexStorage: DELETE on the table "keys" changed no row: ' +
      'the probe row inserted just before was not found (a trigger or a policy that hides rows from this role?): let the app\'s role delete every row of "keys": without it a failed request\'s key stays locked until lockTimeout (checkStore: false starts the app anyway)')
  })

  it('a file whose directory the process may not write (SQLite makes its journal there) fails the start naming the directory', async (context) => {
    const locked = mkdtempSync(join(tmpdir(), 'idem-proof-dir-'))
    const file = join(locked, 'store.sqlite')
    const writer = knexFactory({ client: 'better-sqlite3', connection: { filename: file }, useNullAsDefault: true })
    await createIdempotencyTable(writer, 'keys')
    await writer.destroy()
    // root writes any directory: an immutable one (chattr +i) stands for a read-only one there.
    const asRoot = process.getuid?.() === 0
    const lock = (on: boolean): boolean => asRoot
      ? spawnSync('chattr', [on ? '+i' : '-i', locked]).status === 0
      : (chmodSync(locked, on ? 0o555 : 0o755), true)
    if (!lock(true)) {
      rmSync(locked, { recursive: true, force: true })
      context.skip('chattr cannot make a directory immutable here, and root writes any other')
    }
    const knex = knexFactory({ client: 'better-sqlite3', connection: { filename: file }, useNullAsDefault: true })
    try {
      const error = await startError(new KnexStorage({ knex, tableName: 'keys' }))
      expect(error).toMatch(/^fastify-idempotency: the store cannot work: KnexStorage: INSERT on the table "keys" was refused: .*\(SQLITE_(CANTOPEN|READONLY_DIRECTORY)\): the SQLite file or its directory is read-only to this process: let the process write the directory that holds the file \(SQLite makes its journal there\), and the file/)
      expect(error).not.toContain('upgrading')
    } finally {
      await knex.destroy()
      lock(false)
      rmSync(locked, { recursive: true, force: true })
    }
  })

  it('fails the start at the INSERT', async () => {
    const writer = knexFactory({ client: 'better-sqlite3', connection: { filename }, useNullAsDefault: true })
    instances.push(writer)
    await createIdempotencyTable(writer, 'keys')
    const reader = knexFactory({ client: 'better-sqlite3', connection: { filename, options: { readonly: true } }, useNullAsDefault: true })
    instances.push(reader)
    const error = await startError(new KnexStorage({ knex: reader, tableName: 'keys' }))
    expect(error).toMatch(/KnexStorage: INSERT on the table "keys" was refused: attempt to write a readonly database \(SQLITE_READONLY\): the SQLite file is read-only to this process: open it without readonly: true, and let the process write the file and its directory/)
    // SQLite's cure, not a server's.
    expect(error).not.toMatch(/standby|primary|default_transaction_read_only/)
  })
})
