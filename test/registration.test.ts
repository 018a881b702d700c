/**
 * A route that asks to be guarded and that no registration of the plugin guards: the app fails to
 * start, naming the route and the fix, instead of running the route unguarded (retries running the
 * handler again, with no error and no warning).
 */
import { afterEach, describe, expect, it } from 'vitest'
import diagnostics from 'node:diagnostics_channel'
import Fastify, { type FastifyInstance } from 'fastify'
import fp from 'fastify-plugin'
import idempotency, { idempotencyErrorHandler, MemoryStorage } from '../lib/index.js'
import { watchNewApp } from '../lib/http/registration.js'
import { newKey } from './helpers/app.js'

const apps: FastifyInstance[] = []
afterEach(async () => {
  for (const app of apps.splice(0)) await app.close().catch(() => {})
})

function fastify (): FastifyInstance {
  const app = Fastify()
  apps.push(app)
  return app
}

const handler = async () => ({ ok: true })
const UNGUARDED = /fastify-idempotency: 1 route\(s\) would run unguarded:\n- route POST \/orders sets config\.idempotency, but no registration of the plugin is in its context or above it: register the plugin on the root instance, or in a context that holds the route \(a file of @fastify\/autoload's plugins folder that registers it needs fastify-plugin: export default fp\(\.\.\.\)\)$/
const BEFORE = /route POST \/orders was added before the plugin was registered in its context, so that registration does not guard it: register the plugin \(with await\) before the routes/

describe('a route that no registration guards fails the start', () => {
  it('when the plugin is registered inside an encapsulated plugin and the route sits beside it, even with required: true', async () => {
    const app = fastify()
    await app.register(async (child) => { await child.register(idempotency) })
    app.post('/orders', { config: { idempotency: { required: true } } }, handler)
    await expect(app.listen({ host: '127.0.0.1', port: 0 })).rejects.toThrow(UNGUARDED)
  })

  it('when the route is in a sibling context of the registration (as @fastify/autoload loads a routes folder)', async () => {
    const app = fastify()
    await app.register(async function plugins (child) { await child.register(idempotency) })
    await app.register(async function routes (child) { child.post('/orders', { config: { idempotency: true } }, handler) })
    await expect(app.ready()).rejects.toThrow(UNGUARDED)
  })

  it('names every such route', async () => {
    const app = fastify()
    await app.register(async (child) => { await child.register(idempotency) })
    app.post('/orders', { config: { idempotency: true } }, handler)
    app.route({ method: ['POST', 'PUT'], url: '/payments/:id', config: { idempotency: { expiration: '1h' } }, handler })
    await expect(app.ready()).rejects.toThrow(/2 route\(s\) would run unguarded:\n- route POST \/orders .*\n- route POST,PUT \/payments\/:id /)
  })

  it('when the route was added before the plugin was registered in its context', async () => {
    const app = fastify()
    app.post('/orders', { config: { idempotency: true } }, handler)
    await app.register(idempotency)
    await expect(app.ready()).rejects.toThrow(BEFORE)
  })

  it('when register was not awaited, so the route was added before the plugin loaded', async () => {
    const app = fastify()
    void app.register(idempotency)
    app.post('/orders', { config: { idempotency: true } }, handler)
    await expect(app.ready()).rejects.toThrow(BEFORE)
  })

  it('when a child registers the plugin again after its route: the child\'s options would silently not apply', async () => {
    const app = fastify()
    await app.register(idempotency)
    await app.register(async (child) => {
      child.post('/orders', { config: { idempotency: true } }, handler)
      await child.register(idempotency, { expiration: '1h' })
    })
    await expect(app.ready()).rejects.toThrow(BEFORE)
  })
})

describe('registrations that start', () => {
  it('a route guarded by a registration on the root, in any context below it', async () => {
    const app = fastify()
    await app.register(idempotency)
    app.setErrorHandler(idempotencyErrorHandler())
    let runs = 0
    await app.register(async (child) => { child.post('/orders', { config: { idempotency: true } }, async () => ({ run: ++runs })) }, { prefix: '/v1' })
    await app.listen({ host: '127.0.0.1', port: 0 })
    const origin = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`
    const key = newKey()
    const send = () => fetch(`${origin}/v1/orders`, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{}' })
    await send()
    expect((await send()).headers.get('idempotent-replayed')).toBe('true')
    expect(runs).toBe(1)
  })

  it('a plugin file wrapped with fastify-plugin: its registration lands in the parent context', async () => {
    const app = fastify()
    await app.register(fp(async (instance) => { await instance.register(idempotency) }))
    await app.register(async (child) => { child.post('/orders', { config: { idempotency: true } }, handler) })
    await expect(app.ready()).resolves.toBeDefined()
  })

  it('an app that never registers the plugin (the flag alone does nothing, as with any Fastify plugin)', async () => {
    const app = fastify()
    app.post('/orders', { config: { idempotency: true } }, handler)
    await expect(app.ready()).resolves.toBeDefined()
  })

  it('routes beside the registration that are never guarded anyway: config.idempotency: false, or only safe methods', async () => {
    const app = fastify()
    await app.register(async (child) => { await child.register(idempotency) })
    app.post('/orders', { config: { idempotency: false } }, handler)
    app.get('/orders', { config: { idempotency: true } }, handler)
    await expect(app.ready()).resolves.toBeDefined()
  })

  it('two registrations, nested: the innermost guards the routes of its context, the outer one every other route', async () => {
    const app = fastify()
    app.setErrorHandler(idempotencyErrorHandler())
    const storage = new MemoryStorage()
    await app.register(idempotency, { storage, replayHeader: 'X-Outer' })
    await app.register(async (child) => {
      await child.register(idempotency, { storage, replayHeader: 'X-Inner' })
      child.post('/inner', { config: { idempotency: true } }, handler)
    })
    app.post('/outer', { config: { idempotency: true } }, handler)
    for (const [url, header] of [['/inner', 'x-inner'], ['/outer', 'x-outer']] as const) {
      const key = newKey()
      const send = () => app.inject({ method: 'POST', url, headers: { 'idempotency-key': key }, payload: {} })
      await send()
      const replay = await send()
      expect(Object.keys(replay.headers).filter((name) => name.startsWith('x-'))).toEqual([header])
    }
  })
})

describe('config set by an onRoute hook after the plugin', () => {
  it('a bad one fails the start with what is wrong, as one in the route options fails app.post()', async () => {
    const app = fastify()
    await app.register(idempotency)
    app.addHook('onRoute', (route) => { route.config = { ...route.config, idempotency: { expiration: 'soon' } } })
    app.post('/orders', handler)
    await expect(app.ready()).rejects.toThrow(/fastify-idempotency: invalid config\.idempotency of route POST \/orders/)
  })

  it('with two registrations, nested, set on the inner one\'s route: the innermost guards it, once', async () => {
    const app = fastify()
    app.setErrorHandler(idempotencyErrorHandler())
    const storage = new MemoryStorage()
    await app.register(idempotency, { storage, replayHeader: 'X-Outer' })
    let runs = 0
    await app.register(async (child) => {
      await child.register(idempotency, { storage, replayHeader: 'X-Inner' })
      child.addHook('onRoute', (route) => { route.config = { ...route.config, idempotency: true } })
      child.post('/inner', async () => ({ run: ++runs }))
    })
    const key = newKey()
    const send = () => app.inject({ method: 'POST', url: '/inner', headers: { 'idempotency-key': key }, payload: {} })
    await send()
    const replay = await send()
    expect(Object.keys(replay.headers).filter((name) => name.startsWith('x-'))).toEqual(['x-inner'])
    expect(runs).toBe(1)
  })
})

describe('two registrations in one context', () => {
  it('are refused when the second is registered, as both would guard the same routes', async () => {
    const app = fastify()
    await app.register(idempotency)
    await expect(app.register(idempotency, { expiration: '1h' })).rejects.toThrow(/the plugin is registered twice in the same context; both would guard the same routes/)
  })

  it('also through fastify-plugin, which registers in the parent context', async () => {
    const app = fastify()
    await app.register(idempotency)
    await expect(app.register(fp(async (instance) => { await instance.register(idempotency) }))).rejects.toThrow(/registered twice in the same context/)
  })
})

describe('an app made before the plugin\'s module was loaded (a plugin file that imports it, loaded by @fastify/autoload)', () => {
  /** An app made while nothing listens to Fastify's creations, as when this module loads after it. */
  function madeBefore (): FastifyInstance {
    diagnostics.unsubscribe('fastify.initialization', watchNewApp)
    try {
      return fastify()
    } finally {
      diagnostics.subscribe('fastify.initialization', watchNewApp)
    }
  }

  it('still fails the start for a route in a context made after the registration', async () => {
    const app = madeBefore()
    await app.register(async (child) => { await child.register(idempotency) })
    await app.register(async (child) => { child.post('/orders', { config: { idempotency: true } }, handler) })
    await expect(app.ready()).rejects.toThrow(UNGUARDED)
  })

  it('still fails it for a route added later in a context that existed before the registration', async () => {
    const app = madeBefore()
    await app.register(async (outer) => {
      await outer.register(async (child) => { await child.register(idempotency) })
      outer.post('/orders', { config: { idempotency: true } }, handler)
    })
    await expect(app.ready()).rejects.toThrow(UNGUARDED)
  })
})
