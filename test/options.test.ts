import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import { readFileSync } from 'node:fs'
import idempotency, { MemoryStorage, optionsSchema, routeConfigSchema, type IdempotencyOptions } from '../lib/index.js'

async function register (options: unknown): Promise<void> {
  const app = Fastify()
  try {
    await app.register(idempotency, options as IdempotencyOptions)
    await app.ready()
  } finally {
    await app.close()
  }
}

async function addRoute (config: unknown): Promise<void> {
  const app = Fastify()
  try {
    await app.register(idempotency)
    app.post('/pay', { config: { idempotency: config as true } }, async () => ({}))
    await app.ready()
  } finally {
    await app.close()
  }
}

describe('options are validated when the plugin is registered', () => {
  it('accepts the documented options', async () => {
    await expect(register({
      storage: new MemoryStorage(),
      expiration: '24h',
      lockTimeout: 30_000,
      addCacheableStatusCodes: [409],
      removeCacheableStatusCodes: [202],
      required: false,
      headerName: 'X-Idempotency-Key',
      maxKeyLength: 64,
      maxResponseBytes: 2048,
      replayHeader: false,
      replaySetCookie: true,
      excludeHeaders: ['x-request-id'],
      mismatchStatusCode: 422,
      failOpen: true,
      scope: () => 'tenant',
      closeTimeout: '9s',
      fingerprint: { body: { include: ['/amount'] }, method: true, path: true, query: true, contentType: true, headers: ['x-tenant'] }
    })).resolves.toBeUndefined()
  })

  const bad: Array<[string, unknown, RegExp]> = [
    ['an unknown option', { expirations: '1h' }, /options has an unknown property 'expirations'/],
    ['a typo in fingerprint', { fingerprint: { bdy: true } }, /fingerprint has an unknown property 'bdy'/],
    ['a bad duration string', { expiration: '24 hourz' }, /expiration must be a positive number of milliseconds or a duration/],
    ['a zero duration', { lockTimeout: 0 }, /lockTimeout must be >= 1/],
    ['a status code out of range', { addCacheableStatusCodes: [999] }, /addCacheableStatusCodes\.0 must be <= 599/],
    ['a mismatch status other than 409/422', { mismatchStatusCode: 400 }, /mismatchStatusCode must be equal to one of the allowed values/],
    ['a header name that is not a token', { headerName: 'bad header' }, /headerName must match pattern/],
    ['a pointer without a slash', { fingerprint: { body: { include: ['amount'] } } }, /fingerprint\.body\.include\.0 must match pattern "\^\/"/],
    ['include and exclude together', { fingerprint: { body: { include: ['/a'], exclude: ['/b'] } } }, /fingerprint\.body/],
    ['a storage missing methods', { storage: { begin () {} } }, /storage must implement IdempotencyStorage \(missing complete, release, renew\)/],
    ['a scope that is not a function', { scope: 'tenant' }, /scope must be a function/],
    ['a storeIf that is not a function', { storeIf: true }, /storeIf must be a function/],
    ['a waitTimeout without wait', { waitTimeout: '5s' }, /waitTimeout is set but wait is not true/],
    ['a maxLockHold shorter than lockTimeout', { lockTimeout: '2m', maxLockHold: '1m' }, /maxLockHold \(60000 ms\) must not be shorter than lockTimeout \(120000 ms\)/],
    ['a closeTimeout of zero', { closeTimeout: 0 }, /invalid options: closeTimeout must be >= 1/],
    ['a closeTimeout of zero seconds', { closeTimeout: '0s' }, /invalid options: closeTimeout must be a positive number of milliseconds or a duration such as '24h' \(got "0s"\)/],
    ['a negative closeTimeout', { closeTimeout: -5 }, /closeTimeout must be >= 1/],
    ['a closeTimeout that is not a duration', { closeTimeout: 'when done' }, /closeTimeout must be a positive number of milliseconds/],
    ['a closeTimeout that is not a number', { closeTimeout: true }, /closeTimeout must be integer,string/],
    ['a closeTimeout longer than a timer can wait', { closeTimeout: '30d' }, /closeTimeout must be at most 2147483647 ms, about 24 days \(got 2592000000 ms\)/],
    ['a closeTimeout past Fastify\'s pluginTimeout', { closeTimeout: '10s' }, /closeTimeout \(10000 ms\) must be at most 90 % of Fastify's pluginTimeout \(10000 ms\), which fails a close hook that runs longer: raise it with Fastify\(\{ pluginTimeout \}\)/]
  ]
  for (const [name, options, message] of bad) {
    it(`refuses ${name}`, async () => {
      await expect(register(options)).rejects.toThrow(message)
    })
  }
})

describe('route config is validated when the route is added', () => {
  it('accepts true, false and overrides', async () => {
    await expect(addRoute(true)).resolves.toBeUndefined()
    await expect(addRoute(false)).resolves.toBeUndefined()
    await expect(addRoute({ required: true, expiration: '1h', fingerprint: { query: true, headers: ['x-tenant'] } })).resolves.toBeUndefined()
  })

  it('names the route and the problem', async () => {
    await expect(addRoute({ requird: true })).rejects.toThrow(/config\.idempotency of route POST \/pay: config\.idempotency has an unknown property 'requird'/)
    await expect(addRoute({ expiration: 'soon' })).rejects.toThrow(/route POST \/pay: expiration must be/)
    await expect(addRoute('yes')).rejects.toThrow(/route POST \/pay: it must be true, false or an object/)
  })

  it('checks maxLockHold against the route\'s own lockTimeout, and defaults it to the longer of 10 minutes and lockTimeout', async () => {
    await expect(addRoute({ lockTimeout: '20m' })).resolves.toBeUndefined()
    await expect(addRoute({ lockTimeout: '20m', maxLockHold: '15m' })).rejects.toThrow(/route POST \/pay: maxLockHold \(900000 ms\) must not be shorter than lockTimeout/)
  })

  it('refuses a waitTimeout on a route that does not wait', async () => {
    await expect(addRoute({ waitTimeout: 100 })).rejects.toThrow(/route POST \/pay: waitTimeout is set but wait is not true/)
    await expect(addRoute({ wait: true, waitTimeout: 100 })).resolves.toBeUndefined()
  })

  it('refuses plugin-wide options that make no sense per route', async () => {
    await expect(addRoute({ storage: new MemoryStorage() })).rejects.toThrow(/unknown property 'storage'/)
    await expect(addRoute({ closeTimeout: '5s' })).rejects.toThrow(/unknown property 'closeTimeout'/)
  })
})

describe('closeTimeout and Fastify\'s pluginTimeout', () => {
  async function registerOn (server: { pluginTimeout: number }, options: IdempotencyOptions): Promise<void> {
    const app = Fastify(server)
    try {
      await app.register(idempotency, options)
    } finally {
      await app.close()
    }
  }

  it('accepts a closeTimeout up to 90 % of pluginTimeout, and any with pluginTimeout: 0', async () => {
    await expect(registerOn({ pluginTimeout: 30_000 }, { closeTimeout: '27s' })).resolves.toBeUndefined()
    await expect(registerOn({ pluginTimeout: 0 }, { closeTimeout: '1h' })).resolves.toBeUndefined()
    await expect(registerOn({ pluginTimeout: 30_000 }, { closeTimeout: '28s' })).rejects.toThrow(/closeTimeout \(28000 ms\) must be at most 90 % of Fastify's pluginTimeout \(30000 ms\)/)
  })
})

describe('docs/options.md', () => {
  // The option tables are what a user reads: each option the plugin accepts has its row, in the
  // table that says where it may be set.
  const text = readFileSync(new URL('../docs/options.md', import.meta.url), 'utf8')
  const rowsOf = (heading: string): string[] => {
    const section = text.split(`\n## ${heading}\n`)[1]!.split('\n## ')[0]!
    return [...section.matchAll(/^\| `(\w+)` \|/gm)].map((match) => match[1]!)
  }

  it('has a row for each route option in "Plugin and route options", and for each plugin-only option in "Plugin-only options"', () => {
    const routeOptions = Object.keys(routeConfigSchema.properties)
    const pluginOnly = Object.keys(optionsSchema.properties).filter((name) => !routeOptions.includes(name))
    expect(rowsOf('Plugin and route options').sort()).toEqual([...routeOptions].sort())
    expect(rowsOf('Plugin-only options').sort()).toEqual([...pluginOnly].sort())
  })
})
