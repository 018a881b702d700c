import knexFactory, { type Knex } from 'knex'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { afterAll, describe, expect, it } from 'vitest'
import { KnexStorage } from '../lib/knex.js'
import { createIdempotencyTable, dropIdempotencyTable, notificationChannel } from '../lib/storage/knex/schema.js'
import { buildApp, newKey } from './helpers/app.js'
import { EXPIRY, LEASE, type PgClient, pgDriver, postgres, postgresConnections, response, uniqueTable } from './helpers/knex-targets.js'
import { pgConnection } from './helpers/services.js'
import { Gate } from './helpers/gate.js'

/**
 * Wait mode on PostgreSQL: LISTEN/NOTIFY between storages on separate knex instances (as between
 * processes), the listening connection's failures, close(), and the plugin waiting on it.
 */
describe.skipIf(!postgres.available)(`KnexStorage waitFor on PostgreSQL (LISTEN/NOTIFY)${postgres.reason}`, () => {
  const instances: Knex[] = []
  const created: string[] = []
  const listeners: PgClient[] = []
  const connect = (): Knex => {
    const knex = knexFactory({ client: 'pg', connection: pgConnection })
    instances.push(knex)
    return knex
  }
  const db = connect()
  const table = (): string => {
    const name = uniqueTable()
    created.push(name)
    return name
  }
  /** Two storages on one table, each on its own knex (own pool, own connections). */
  const pair = async (): Promise<{ name: string, waiting: KnexStorage, holding: KnexStorage }> => {
    const name = table()
    await createIdempotencyTable(db, name)
    return { name, waiting: new KnexStorage({ knex: connect(), tableName: name }), holding: new KnexStorage({ knex: connect(), tableName: name }) }
  }
  const token = async (store: KnexStorage, key: string, lease = LEASE): Promise<string> => {
    const result = await store.begin(key, 'fp', lease)
    if (result.state !== 'acquired') throw new Error(`expected the lease on ${key}, got ${result.state}`)
    return result.token
  }
  /** Until `keys` are all marked by a waiter: from then on their end must notify. */
  const marked = async (name: string, keys: string[]): Promise<void> => {
    const ids = keys.map((key) => Buffer.from(key, 'utf8'))
    for (let i = 0; i < 400; i++) {
      const rows = await db(name).select('idempotency_key').whereIn('idempotency_key', ids).andWhere('waiting', true)
      if (rows.length === keys.length) return
      await sleep(5)
    }
    throw new Error(`the waiters never marked ${keys.join(', ')}`)
  }
  /** A plain pg client listening on the table's channel, as a witness of what is sent. */
  const witness = async (name: string): Promise<string[]> => {
    const client = new (pgDriver(db).Client)(pgConnection)
    listeners.push(client)
    const payloads: string[] = []
    client.on('notification', (message) => { payloads.push(message.payload ?? '') })
    await client.connect()
    await client.query(`LISTEN "${notificationChannel(name)}"`)
    await client.query('SELECT 1') // so that `listening` does not count it
    return payloads
  }
  /** Backends listening on the table's channel (their last statement was the LISTEN). */
  const listening = async (name: string): Promise<number[]> => {
    const { rows } = await db.raw('SELECT pid FROM pg_stat_activity WHERE query = ? AND pid <> pg_backend_pid()', [`LISTEN "${notificationChannel(name)}"`])
    return rows.map((row: { pid: number }) => row.pid)
  }
  const base64 = (key: string): string => Buffer.from(key, 'utf8').toString('base64')
  /** Completes the lease `held` on `key`, and expects `waited` to end within 200 ms of it. */
  const expectWokenByComplete = async (holding: KnexStorage, key: string, held: string, waited: Promise<void>): Promise<void> => {
    const ending = performance.now()
    expect(await holding.complete(key, held, response(), EXPIRY)).toBe(true)
    await waited
    expect(performance.now() - ending).toBeLessThan(200)
  }

  afterAll(async () => {
    for (const client of listeners) await client.end()
    for (const name of created) await dropIdempotencyTable(db, name)
    for (const instance of instances) await instance.destroy()
  })

  it('wakes a waiter within 200 ms when another storage, on another connection, completes or releases the lease', async () => {
    const { name, waiting, holding } = await pair()
    for (const end of ['complete', 'release'] as const) {
      const key = `wake-${end}`
      const held = await token(holding, key)
      let woke = 0
      const waited = waiting.waitFor!(key, 20_000).then(() => { woke = performance.now() })
      await marked(name, [key])
      expect(woke).toBe(0)
      const ending = performance.now()
      if (end === 'complete') expect(await holding.complete(key, held, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(key, held)).toBe(true)
      await waited
      expect(woke - ending, `woken ${Math.round(woke - ending)} ms after ${end}`).toBeLessThan(200)
      expect((await waiting.begin(key, 'fp', LEASE)).state).toBe(end === 'complete' ? 'completed' : 'acquired')
    }
    await waiting.close()
  })

  it('sends a NOTIFY only when somebody waits, with the key\'s bytes in base64', async () => {
    const { name, waiting, holding } = await pair()
    const payloads = await witness(name)
    const key = 'tenant-\u0000-scope:caf\u00e9 \u{1F4B8}'
    for (const [i, end] of (['complete', 'release'] as const).entries()) {
      const alone = `${key}-alone-${end}`
      const held = await token(holding, alone)
      if (end === 'complete') expect(await holding.complete(alone, held, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(alone, held)).toBe(true)

      const awaited = `${key}-awaited-${end}`
      const again = await token(holding, awaited)
      const waited = waiting.waitFor!(awaited, 20_000)
      await marked(name, [awaited])
      if (end === 'complete') expect(await holding.complete(awaited, again, response(), EXPIRY)).toBe(true)
      else expect(await holding.release(awaited, again)).toBe(true)
      await waited
      // Notifications arrive in commit order: the one sent shows that none was sent before it.
      for (let wait = 0; payloads.length < i + 1 && wait < 200; wait++) await sleep(5)
      expect(payloads).toEqual([...(end === 'release' ? [base64(`${key}-awaited-complete`)] : []), base64(awaited)])
    }
    // A refused complete or release (wrong token) sends nothing, even with a waiter: the real
    // release after them sends the only notification.
    const refused = 'refused'
    const held = await token(holding, refused)
    const waited = waiting.waitFor!(refused, 20_000)
    await marked(name, [refused])
    expect(await holding.release(refused, 'not-the-token')).toBe(false)
    expect(await holding.complete(refused, 'not-the-token', response(), EXPIRY)).toBe(false)
    expect(await holding.release(refused, held)).toBe(true)
    await waited
    for (let wait = 0; payloads.length < 3 && wait < 200; wait++) await sleep(5)
    expect(payloads.slice(2)).toEqual([base64(refused)])
    await waiting.close()
  })

  it('wakes 50 waiters on 10 keys, over one listening connection', async () => {
    const { name, waiting, holding } = await pair()
    const keys = Array.from({ length: 10 }, (_, i) => `herd-${i}`)
    const tokens = await Promise.all(keys.map((key) => token(holding, key)))
    const woken: number[] = []
    const waits = Array.from({ length: 50 }, (_, i) => waiting.waitFor!(keys[i % 10]!, 20_000).then(() => { woken.push(performance.now()) }))
    await marked(name, keys)
    expect(woken).toHaveLength(0)
    expect(await listening(name)).toHaveLength(1)
    const ending = performance.now()
    const ended = await Promise.all(keys.map((key, i) => i % 2 === 0
      ? holding.complete(key, tokens[i]!, response(), EXPIRY)
      : holding.release(key, tokens[i]!)))
    expect(ended.every(Boolean)).toBe(true)
    await Promise.all(waits)
    expect(woken).toHaveLength(50)
    expect(Math.max(...woken) - ending).toBeLessThan(1000)
    await waiting.close()
  })

  it('wakes a waiter at the lease end when the lease lapses, without a notification', async () => {
    const { waiting, holding } = await pair()
    await token(holding, 'lapses', 300)
    const started = performance.now()
    await waiting.waitFor!('lapses', 20_000)
    const waited = performance.now() - started
    expect(waited).toBeGreaterThanOrEqual(250)
    expect(waited).toBeLessThan(2000)
    await waiting.close()
  })

  it('rejects pending waits when the listening connection is killed, and listens again on the next waitFor', async () => {
    const { name, waiting, holding } = await pair()
    const held = await token(holding, 'victim')
    const waits = [waiting.waitFor!('victim', 20_000), waiting.waitFor!('victim', 20_000)]
    const outcomes = Promise.allSettled(waits)
    await marked(name, ['victim'])
    const pids = await listening(name)
    expect(pids).toHaveLength(1)
    const pid = pids[0]!
    const killed = performance.now()
    await db.raw('SELECT pg_terminate_backend(?)', [pid])
    for (const outcome of await outcomes) {
      expect(outcome.status).toBe('rejected')
      expect((outcome as PromiseRejectedResult).reason.message).toMatch(/listening connection failed/)
    }
    expect(performance.now() - killed).toBeLessThan(2000)

    // Unmarked, so that the next mark shows the new waiter is listening.
    await db(name).update({ waiting: false })
    const again = waiting.waitFor!('victim', 20_000)
    await marked(name, ['victim'])
    // The killed connection's second waiter may still have had its mark on the way (seen on a
    // loaded machine): the new listener is there when pg_stat_activity shows it.
    let now = await listening(name)
    for (let i = 0; i < 400 && now.length === 0; i++) {
      await sleep(5)
      now = await listening(name)
    }
    expect(now).toHaveLength(1)
    expect(now[0]).not.toBe(pid)
    await expectWokenByComplete(holding, 'victim', held, again)
    await waiting.close()
  })

  it('rejects (and does not hang or crash) when the listening connection cannot be opened', async () => {
    const name = table()
    await createIdempotencyTable(db, name)
    // A port nobody listens on: every connection is refused.
    const knex = knexFactory({ client: 'pg', connection: { ...pgConnection, port: 1 } })
    instances.push(knex)
    const store = new KnexStorage({ knex, tableName: name })
    await expect(store.waitFor!('k', 5000)).rejects.toThrow()
    await expect(store.waitFor!('k', 5000)).rejects.toThrow()
    await store.close()
  })

  it('close() ends the listening connection and resolves pending waits, leaves no handle, and leaves the knex usable', async () => {
    const name = table()
    await createIdempotencyTable(db, name)
    const knex = connect()
    const store = new KnexStorage({ knex, tableName: name })
    const holder = new KnexStorage({ knex: connect(), tableName: name })
    const handles = (): Record<string, number> => {
      const counts: Record<string, number> = {}
      for (const resource of process.getActiveResourcesInfo()) counts[resource] = (counts[resource] ?? 0) + 1
      return counts
    }
    // A first round warms the pools, so that they hold the same connections before and after.
    await token(holder, 'held')
    await store.waitFor!('free', 1000)
    await store.close()
    const before = handles()

    const pending = store.waitFor!('held', 20_000)
    await marked(name, ['held'])
    const during = handles()
    expect(await listening(name)).toHaveLength(1)
    await store.close()
    await pending
    // Nothing of the storage's is left: no socket, no timer (the pools' own timers come and go,
    // so the counts may only have dropped).
    const after = handles()
    for (const [type, count] of Object.entries(after)) expect(count, type).toBeLessThanOrEqual(before[type] ?? 0)
    expect(after.Timeout ?? 0).toBeLessThan(during.Timeout ?? 0)
    for (let i = 0; i < 100 && (await listening(name)).length > 0; i++) await sleep(10)
    expect(await listening(name)).toHaveLength(0)

    // The knex instance is the caller's: it still works, and so does the storage.
    await knex.raw('SELECT 1')
    expect((await store.begin('held', 'fp', LEASE)).state).toBe('in-flight')
    await db(name).update({ waiting: false })
    const again = store.waitFor!('held', 20_000)
    await marked(name, ['held'])
    await store.close()
    await again
    for (const [type, count] of Object.entries(handles())) expect(count, type).toBeLessThanOrEqual(before[type] ?? 0)
  })

  it('createIdempotencyTable adds `waiting` to a table made before it existed, and then leaves the table alone', async () => {
    // Schema-qualified and mixed case: the catalog lookup must quote the name as knex does.
    const name = `public.${uniqueTable()}_Old`
    created.push(name)
    await db.raw(`CREATE TABLE ?? (idempotency_key bytea NOT NULL PRIMARY KEY, fingerprint text NOT NULL,
      state varchar(16) NOT NULL, token varchar(64), lease_end bigint, status_code integer, content_type text,
      headers text, body bytea, expires_at bigint NOT NULL)`, [name])
    await db(name).insert({ idempotency_key: Buffer.from('old'), fingerprint: 'fp', state: 'in_flight', token: 't', lease_end: 1, expires_at: 1 })
    const knex = connect()
    const ddl: string[] = []
    knex.on('query', (query: { sql: string }) => { if (/^(alter|create) table/i.test(query.sql)) ddl.push(query.sql) })
    await createIdempotencyTable(knex, name)
    expect(ddl.filter((sql) => /^alter/i.test(sql))).toHaveLength(1)
    expect((await db(name).first('waiting')).waiting).toBe(false)
    await createIdempotencyTable(knex, name)
    expect(ddl.filter((sql) => /^alter/i.test(sql))).toHaveLength(1)

    const waiting = new KnexStorage({ knex, tableName: name })
    const holding = new KnexStorage({ knex: connect(), tableName: name })
    const held = await token(holding, 'k')
    const waited = waiting.waitFor!('k', 20_000)
    await marked(name, ['k'])
    await expectWokenByComplete(holding, 'k', held, waited)
    await waiting.close()
  })

  it('is what the plugin waits on in wait mode: one waitFor, woken by the NOTIFY, no polling', async () => {
    const name = table()
    const store = new KnexStorage({ knex: connect(), tableName: name, createTable: true })
    const payloads = await witness(name)
    const waitFor = store.waitFor!
    const waits: Array<{ timeout: number, resolvedAt: number }> = []
    Object.assign(store, {
      waitFor: async (key: string, timeout: number) => {
        const wait = { timeout, resolvedAt: 0 }
        waits.push(wait)
        await waitFor(key, timeout)
        wait.resolvedAt = performance.now()
      }
    })
    const begin = store.begin.bind(store)
    let begins = 0
    store.begin = (...args) => { begins++; return begin(...args) }

    const gate = new Gate()
    const { app, runs } = await buildApp({ storage: store, wait: true, waitTimeout: '20s' }, {
      '/slow': async (_request, reply) => { await gate.hold(); reply.code(201); return { done: true } }
    })
    try {
      const key = newKey('plugin')
      const post = () => app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: { a: 1 } })
      const first = post()
      await gate.entered
      const duplicate = post()
      // The duplicate is parked in waitFor, its mark on the row, before the first one finishes.
      const storageKey = `${(await db(name).first('idempotency_key')).idempotency_key.toString('utf8')}`
      await marked(name, [storageKey])
      expect(waits).toHaveLength(1)
      expect(waits[0]!.timeout).toBeGreaterThan(10_000)
      const opened = performance.now()
      gate.open()
      const [original, replayed] = await Promise.all([first, duplicate])
      expect(original.statusCode).toBe(201)
      expect(replayed.statusCode).toBe(201)
      expect(replayed.headers['idempotent-replayed']).toBe('true')
      expect(replayed.body).toBe(original.body)
      expect(runs.get('/slow')).toBe(1)
      // One wait, ended by the notification well before its 20 s timeout; the duplicate asked
      // `begin` twice (before and after the wait), where polling would have asked again and again.
      expect(waits).toHaveLength(1)
      expect(waits[0]!.resolvedAt - opened).toBeLessThan(200)
      expect(begins).toBe(3)
      for (let i = 0; i < 100 && payloads.length === 0; i++) await sleep(10)
      expect(payloads).toEqual([base64(storageKey)])
    } finally {
      await app.close()
      await store.close() // the plugin closes only a storage it created
    }
    for (let i = 0; i < 100 && (await listening(name)).length > 0; i++) await sleep(10)
    expect(await listening(name)).toHaveLength(0)
  })
})

/**
 * Wait mode through PgBouncer. In transaction pooling a LISTEN holds on a server connection the
 * pooler hands to other clients, so its notifications never reach the waiter, which used to sleep
 * until its timeout: the store finds out (a probe notification that never arrives) and the plugin
 * polls, as on MySQL. In session pooling the listening connection keeps its server connection,
 * and NOTIFY wakes waiters as on a direct connection.
 */
for (const connection of (await postgresConnections()).filter((candidate) => candidate.pooled)) {
  const session = connection.name.includes('session')
  describe.skipIf(!connection.availability.available)(`wait mode on PostgreSQL ${connection.name}${connection.availability.reason}`, () => {
    const knex = knexFactory({ client: 'pg', connection: connection.settings, pool: { min: 0, max: 4 } })
    const direct = knexFactory({ client: 'pg', connection: pgConnection, pool: { min: 0, max: 1 } })
    const name = uniqueTable()
    const store = new KnexStorage({ knex, tableName: name, createTable: true })
    afterAll(async () => {
      await store.close()
      await dropIdempotencyTable(direct, name)
      await knex.destroy()
      await direct.destroy()
    })

    it(session ? 'waitFor is woken by NOTIFY' : 'waitFor gives up listening at once, so that the plugin polls', async () => {
      const lease = await store.begin('k', 'fp', LEASE)
      if (lease.state !== 'acquired') throw new Error('expected a lease')
      const waited = store.waitFor!('k', 20_000).then(() => 'woken', () => 'refused')
      if (session) {
        // Marked, so listening: its end notifies.
        for (let i = 0; i < 400 && (await direct(name).first('waiting')).waiting !== true; i++) await sleep(5)
        const ending = performance.now()
        expect(await store.complete('k', lease.token, response(), EXPIRY)).toBe(true)
        expect(await waited).toBe('woken')
        expect(performance.now() - ending).toBeLessThan(1000)
      } else {
        expect(await waited).toBe('refused')
        expect(await store.waitFor!('k', 20_000).then(() => 'woken', () => 'refused')).toBe('refused')
        expect(await store.complete('k', lease.token, response(), EXPIRY)).toBe(true)
      }
    })

    it('a duplicate gets the first request\'s response soon after it ends, not at its timeout', async () => {
      const gate = new Gate()
      const { app, runs } = await buildApp({ storage: store, wait: true, waitTimeout: '20s' }, {
        '/slow': async (_request, reply) => { await gate.hold(); reply.code(201); return { done: true } }
      })
      try {
        const key = newKey('pooled')
        const post = () => app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: { a: 1 } })
        const first = post()
        await gate.entered
        const duplicate = post()
        // The duplicate is waiting: its mark is on the row (session) or it asked twice (polling).
        const begin = store.begin.bind(store)
        let begins = 0
        const polled = new Promise<void>((resolve) => { store.begin = async (...args) => { if (++begins === 2) resolve(); return await begin(...args) } })
        const marked = async (): Promise<void> => { for (let i = 0; i < 400 && (await direct(name).where('waiting', true).first('state')) === undefined; i++) await sleep(5) }
        await (session ? marked() : polled)
        const opened = performance.now()
        gate.open()
        const [original, replayed] = await Promise.all([first, duplicate])
        expect(original.statusCode).toBe(201)
        expect(replayed.headers['idempotent-replayed']).toBe('true')
        expect(runs.get('/slow')).toBe(1)
        // Polling asks every 400 ms at most.
        expect(performance.now() - opened).toBeLessThan(3000)
      } finally {
        delete (store as { begin?: unknown }).begin
        await app.close()
      }
    })
  })
}
