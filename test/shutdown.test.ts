/**
 * Closing the app while a guarded handler runs, over real HTTP, on every store: the store's client
 * is closed in the app's own onClose hook (as the docs show), and a retry goes to a new app on the
 * same store (a restarted server). The operation runs once, whatever `forceCloseConnections` says
 * and whether the client is still there.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { request, type IncomingHttpHeaders } from 'node:http'
import { Writable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyServerOptions } from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyOptions, type IdempotencyStorage } from '../lib/index.js'
import { newKey, withMethods } from './helpers/app.js'
import { storeCases } from './helpers/stores.js'

const stores = await storeCases()

/** Log lines of an app, and a way to wait for one. */
class LogLines extends Writable {
  readonly lines: Array<Record<string, unknown>> = []
  readonly #watchers: Array<{ pattern: RegExp, resolve: () => void }> = []

  override _write (chunk: Buffer, _encoding: string, callback: () => void): void {
    for (const text of chunk.toString().split('\n')) {
      if (text === '') continue
      const line = JSON.parse(text) as Record<string, unknown>
      this.lines.push(line)
      for (const watcher of this.#watchers) if (watcher.pattern.test(String(line.msg))) watcher.resolve()
    }
    callback()
  }

  /** Resolves at the first line (from now on) whose message matches. */
  next (pattern: RegExp): Promise<void> {
    return new Promise((resolve) => this.#watchers.push({ pattern, resolve }))
  }

  messages (level: number): string[] {
    return this.lines.filter((line) => line.level === level).map((line) => String(line.msg))
  }
}

const ERROR = 50

/** A promise opened by hand, once. */
function gate (): { promise: Promise<void>, open: () => void } {
  let open!: () => void
  const promise = new Promise<void>((resolve) => { open = resolve })
  return { promise, open }
}

interface Served {
  app: FastifyInstance
  origin: string
  log: LogLines
  /** The handler began, and (once the client left) the server saw its connection close. */
  started: Promise<void>
  clientLeft: Promise<void>
}

/**
 * An app on `storage` whose `/orders` handler counts its runs in `runs`, then waits for `hold`;
 * `onClose` opens `hold` (a store's client must never be closed under a handler: by then it must
 * have finished) and closes the store's client.
 */
async function serve (storage: IdempotencyStorage, closeStore: () => Promise<void>, runs: { count: number }, hold: Promise<void>, onClose: () => void,
  server: FastifyServerOptions = {}, options: IdempotencyOptions = {}): Promise<Served> {
  const log = new LogLines()
  const app = Fastify({ ...server, logger: { level: 'info', stream: log } })
  await app.register(idempotency, { storage, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  app.addHook('onClose', async () => {
    onClose()
    await closeStore()
  })
  const started = gate()
  const left = gate()
  app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
    const run = ++runs.count
    reply.raw.once('close', () => { if (!reply.sent) left.open() })
    started.open()
    await hold
    reply.code(201)
    return { order: run, sku: (request.body as { sku: string }).sku }
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, origin: `http://127.0.0.1:${(app.server.address() as { port: number }).port}`, log, started: started.promise, clientLeft: left.promise }
}

interface Answer { status: number, headers: IncomingHttpHeaders, body: string }

/**
 * POST /orders with `key`, on a connection of its own that closes after the answer: how long
 * Fastify waits for an idle keep-alive connection at close is not what these tests are about.
 */
function post (origin: string, key: string, signal?: AbortSignal): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const body = JSON.stringify({ sku: 'A1' })
    const req = request(`${origin}/orders`, {
      method: 'POST',
      agent: false,
      signal,
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body), 'idempotency-key': key }
    }, (res) => {
      const chunks: Buffer[] = []
      res.on('data', (chunk: Buffer) => chunks.push(chunk))
      res.on('error', reject)
      res.on('end', () => { resolve({ status: res.statusCode!, headers: res.headers, body: Buffer.concat(chunks).toString() }) })
    })
    req.on('error', reject)
    req.end(body)
  })
}

/** A close while a handler runs. `waits`: Fastify itself waits for the request (its client is still connected). */
const closings: Array<{ name: string, server: FastifyServerOptions, clientLeaves: boolean, waits: boolean }> = [
  { name: 'forceCloseConnections: true', server: { forceCloseConnections: true }, clientLeaves: false, waits: false },
  { name: "forceCloseConnections: 'idle' (the default)", server: { forceCloseConnections: 'idle' }, clientLeaves: false, waits: true },
  { name: 'forceCloseConnections: false', server: { forceCloseConnections: false }, clientLeaves: false, waits: true },
  { name: 'a client that left, by default', server: {}, clientLeaves: true, waits: false },
  { name: 'a client that left, with forceCloseConnections: false', server: { forceCloseConnections: false }, clientLeaves: true, waits: false }
]

for (const store of stores) {
  describe.skipIf(!store.available)(`closing the app with a guarded handler in flight: ${store.name}${store.reason}`, () => {
    beforeAll(async () => { await store.create() })
    afterAll(async () => { await store.cleanup() })

    for (const closing of closings) {
      it(`${closing.name}: the handler finishes and its response is stored before the store closes; a retry against a new app replays it`, async () => {
        const runs = { count: 0 }
        const hold = gate()
        const first = await store.open()
        const served = await serve(first.storage, first.close, runs, hold.promise, hold.open, closing.server)
        const key = newKey('close')
        const controller = new AbortController()
        const answer = post(served.origin, key, controller.signal).then(({ status, body }) => ({ status, body }), (error: Error) => error)
        await served.started
        if (closing.clientLeaves) {
          controller.abort()
          await served.clientLeft
        }
        // The handler goes on when the plugin waits for it, or else when onClose is about to close
        // the store. Where Fastify itself waits for the request, it goes on at once.
        const draining = served.log.next(/waiting .* guarded request/)
        const closed = served.app.close()
        if (closing.waits) hold.open()
        else void draining.then(hold.open)
        await closed

        if (!closing.clientLeaves) {
          const received = await answer
          expect(received).toEqual({ status: 201, body: JSON.stringify({ order: 1, sku: 'A1' }) })
        }
        expect(served.log.messages(ERROR)).toEqual([])

        const second = await store.open()
        const restarted = await serve(second.storage, second.close, runs, Promise.resolve(), () => {})
        try {
          const retry = await post(restarted.origin, key)
          expect(retry.status).toBe(201)
          expect(retry.headers['idempotent-replayed']).toBe('true')
          expect(JSON.parse(retry.body)).toEqual({ order: 1, sku: 'A1' })
          expect(runs.count).toBe(1)
        } finally {
          await restarted.app.close()
        }
      })
    }

    it('at closeTimeout, close goes on without the handler still running: its lease is kept (a retry gets 409, never a second run alongside) and the log names it', async () => {
      const runs = { count: 0 }
      const hold = gate()
      const first = await store.open()
      const served = await serve(first.storage, first.close, runs, hold.promise, () => {}, { forceCloseConnections: true }, { closeTimeout: 200 })
      const key = newKey('bound')
      const answer = post(served.origin, key).catch((error: Error) => error)
      await served.started
      const before = Date.now()
      await served.app.close()
      expect(Date.now() - before).toBeGreaterThanOrEqual(190)
      expect(await answer).toBeInstanceOf(Error)
      const errors = served.log.lines.filter((line) => line.level === ERROR)
      expect(errors).toHaveLength(1)
      expect(errors[0]).toMatchObject({ idempotencyKey: key })
      expect(String(errors[0]!.msg)).toMatch(/closeTimeout.*handler is still running.*lockTimeout/)

      const second = await store.open()
      const restarted = await serve(second.storage, second.close, runs, Promise.resolve(), () => {})
      try {
        const retry = await post(restarted.origin, key)
        expect(retry.status).toBe(409)
        expect(JSON.parse(retry.body).type).toMatch(/#request-in-progress$/)
        expect(runs.count).toBe(1)
      } finally {
        hold.open()
        await restarted.app.close()
      }
    })
  })
}

/** An app with the plugin on `storage`, its error handler, and its log. */
async function plain (storage: IdempotencyStorage, server: FastifyServerOptions = {}, options: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, log: LogLines }> {
  const log = new LogLines()
  const app = Fastify({ ...server, logger: { level: 'info', stream: log } })
  await app.register(idempotency, { storage, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  return { app, log }
}

async function listen (app: FastifyInstance): Promise<string> {
  await app.listen({ host: '127.0.0.1', port: 0 })
  return `http://127.0.0.1:${(app.server.address() as { port: number }).port}`
}

describe('closing the app: requests that arrive, wait or store meanwhile', () => {
  for (const return503OnClosing of [false, true]) {
    it(`refuses a keyed request that reaches a guarded route once close has begun (return503OnClosing: ${String(return503OnClosing)}), and still settles the one in flight`, async () => {
      const storage = new MemoryStorage()
      const { app, log } = await plain(storage, { return503OnClosing })
      const hold = gate()
      const started = gate()
      let runs = 0
      app.post('/orders', { config: { idempotency: true } }, async () => { runs++; started.open(); await hold.promise; return { run: runs } })
      const origin = await listen(app)
      const first = post(origin, newKey('first'))
      await started.promise
      const draining = log.next(/waiting .* guarded request/)
      const closed = app.close()
      await draining
      const late = await post(origin, newKey('late'))
      hold.open()
      await closed
      expect(late.status).toBe(503)
      if (return503OnClosing) {
        // Fastify's own answer, before any hook.
        expect(JSON.parse(late.body)).toMatchObject({ statusCode: 503 })
      } else {
        expect(late.headers['content-type']).toMatch(/^application\/problem\+json/)
        expect(JSON.parse(late.body)).toMatchObject({ type: expect.stringMatching(/#server-closing$/), status: 503 })
        expect(late.headers['retry-after']).toBe('1')
      }
      expect(runs).toBe(1)
      expect((await first).status).toBe(200)
    })
  }

  /**
   * An app on `refusing` whose store refuses to store the first response (logged), closed then;
   * and the retry of that request against a new app on the store behind it.
   */
  async function closedWhileStoring (refusing: IdempotencyStorage, storage: IdempotencyStorage, options: IdempotencyOptions = {}) {
    const { app, log } = await plain(refusing, {}, options)
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs }))
    const origin = await listen(app)
    const key = newKey('storing')
    const refused = log.next(/failed to store the response/)
    expect((await post(origin, key)).status).toBe(200)
    await refused
    await app.close()
    const again = await plain(storage)
    again.app.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs }))
    const retry = await again.app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, payload: { sku: 'A1' } })
    await again.app.close()
    return { log, retry, runs }
  }

  it('waits for a response whose storing is being retried, and the retry replays it', async () => {
    const storage = new MemoryStorage()
    let refusals = 1
    const flaky = withMethods(storage, {
      complete: async (...args: Parameters<MemoryStorage['complete']>) => {
        if (refusals-- > 0) throw new Error('store hiccup')
        return await storage.complete(...args)
      }
    })
    const { retry, runs } = await closedWhileStoring(flaky, storage)
    expect(retry.headers['idempotent-replayed']).toBe('true')
    expect(runs).toBe(1)
  })

  it('gives up a response the store keeps refusing at closeTimeout, says so once, and keeps its lease', async () => {
    const storage = new MemoryStorage()
    const refusing = withMethods(storage, { complete: async () => { throw new Error('store down') } })
    const { log, retry, runs } = await closedWhileStoring(refusing, storage, { closeTimeout: 100 })
    const messages = log.messages(ERROR)
    expect(messages).toHaveLength(2)
    expect(messages[1]).toMatch(/closeTimeout.*response is still being stored/)
    expect(retry.statusCode).toBe(409)
    expect(runs).toBe(1)
  })

  /**
   * An app with `wait: true` whose handler waits for `hold` (then answers, or fails with `fails`),
   * a first request in it and a duplicate of it waiting for it.
   */
  async function withWaitingDuplicate (options: IdempotencyOptions, fails: boolean) {
    const storage = new MemoryStorage()
    const waiting = gate()
    const watched = withMethods(storage, {
      waitFor: async (...args: Parameters<MemoryStorage['waitFor']>) => {
        waiting.open()
        await storage.waitFor(...args)
      }
    })
    const { app, log } = await plain(watched, {}, { wait: true, ...options })
    const hold = gate()
    const started = gate()
    let runs = 0
    app.post('/orders', { config: { idempotency: true } }, async () => {
      runs++
      started.open()
      await hold.promise
      if (fails) throw new Error('failed')
      return { run: runs }
    })
    const origin = await listen(app)
    const key = newKey('waited')
    const first = post(origin, key)
    await started.promise
    const duplicate = post(origin, key)
    await waiting.promise
    return { app, log, hold, first, duplicate, runs: () => runs }
  }

  it('answers a duplicate that waited (wait: true) with the response stored during close', async () => {
    const { app, log, hold, first, duplicate, runs } = await withWaitingDuplicate({}, false)
    const draining = log.next(/waiting up to .* for 2 guarded request/)
    const closed = app.close()
    await draining
    hold.open()
    await closed
    expect((await first).status).toBe(200)
    const waited = await duplicate
    expect(waited.headers['idempotent-replayed']).toBe('true')
    expect(runs()).toBe(1)
  })

  it('refuses a duplicate that waited past closeTimeout instead of running it once the first gave its key back', async () => {
    const { app, log, hold, first, duplicate, runs } = await withWaitingDuplicate({ waitTimeout: '1m', closeTimeout: 100 }, true)
    // The bound passes with both in flight; then the first fails and gives its key back.
    const bound = log.next(/stopped waiting for it/)
    const closed = app.close()
    await bound
    hold.open()
    expect((await first).status).toBe(500)
    const refused = await duplicate
    expect(refused.status).toBe(503)
    expect(JSON.parse(refused.body).type).toMatch(/#server-closing$/)
    expect(runs()).toBe(1)
    await closed
  })

  it('waits at most 90 % of a short pluginTimeout by default, so Fastify never fails the close', async () => {
    const { app, log } = await plain(new MemoryStorage(), { pluginTimeout: 1000, forceCloseConnections: true })
    const started = gate()
    app.post('/orders', { config: { idempotency: true } }, async () => { started.open(); await new Promise(() => {}) })
    const origin = await listen(app)
    const hung = post(origin, newKey('hung')).catch((error: Error) => error)
    await started.promise
    const before = Date.now()
    await app.close()
    expect(Date.now() - before).toBeGreaterThanOrEqual(850)
    expect(log.messages(ERROR)).toEqual([expect.stringMatching(/closeTimeout.*handler is still running/)])
    expect(await hung).toBeInstanceOf(Error)
  })

  /** A store whose begin waits until the test answers it, and that says when a lease is given back. */
  function slowBegin (storage: MemoryStorage) {
    const begun = gate()
    let answer!: (how: 'grant' | 'fail') => void
    const answered = new Promise<'grant' | 'fail'>((resolve) => { answer = resolve })
    const released = gate()
    const slow = withMethods(storage, {
      begin: async (...args: Parameters<MemoryStorage['begin']>) => {
        begun.open()
        if (await answered === 'fail') throw new Error('connection closed')
        return await storage.begin(...args)
      },
      release: async (...args: Parameters<MemoryStorage['release']>) => {
        const done = await storage.release(...args)
        released.open()
        return done
      }
    })
    return { slow, begun: begun.promise, answer, released: released.promise }
  }

  it('gives back a lease the store grants after close stopped waiting, and never runs the handler', async () => {
    const storage = new MemoryStorage()
    const { slow, begun, answer, released } = slowBegin(storage)
    const { app, log } = await plain(slow, { forceCloseConnections: true }, { closeTimeout: 100 })
    let runs = 0
    const ran = gate()
    app.post('/orders', { config: { idempotency: true } }, async () => { ran.open(); return { run: ++runs } })
    const origin = await listen(app)
    const key = newKey('late-lease')
    const cut = post(origin, key).catch((error: Error) => error)
    await begun
    await app.close()
    answer('grant')
    await Promise.race([released, ran.promise])
    expect(await cut).toBeInstanceOf(Error)
    expect(runs).toBe(0)
    expect((await storage.begin(key, 'any', 1000)).state).toBe('acquired')
    // It held no lease when close stopped waiting: nothing to report.
    expect(log.messages(ERROR)).toEqual([])
  })

  it('never runs a request unprotected (failOpen) when its store call fails after close stopped waiting', async () => {
    const { slow, begun, answer } = slowBegin(new MemoryStorage())
    const { app, log } = await plain(slow, { forceCloseConnections: true }, { closeTimeout: 100, failOpen: true })
    let runs = 0
    const ran = gate()
    app.post('/orders', { config: { idempotency: true } }, async () => { ran.open(); return { run: ++runs } })
    const origin = await listen(app)
    const cut = post(origin, newKey('fail-open')).catch((error: Error) => error)
    await begun
    await app.close()
    answer('fail')
    await Promise.race([cut, ran.promise])
    expect(await cut).toBeInstanceOf(Error)
    expect(runs).toBe(0)
    // Refused as closing: the store is not reported down for a call close cut.
    expect(log.messages(ERROR)).toEqual([])
  })
})
