/**
 * The `store` that events, the audit log and errors name: the store's own name, also in an app a
 * bundler or minifier has renamed the classes of (esbuild names a class `_MemoryStorage` when it
 * lowers its fields, and `--minify` gives it one letter), and a subclass's own name.
 */
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'
import { build } from 'esbuild'
import knexFactory from 'knex'
import { Redis } from 'ioredis'
import { afterAll, describe, expect, it } from 'vitest'
import { MemoryStorage } from '../lib/index.js'
import { KnexStorage } from '../lib/knex.js'
import { RedisStorage } from '../lib/redis.js'
import { storeNameOf } from '../lib/storage/types.js'

const root = join(import.meta.dirname, '..')
const work = join(root, '.tmp', `store-name-${process.pid}`)
afterAll(() => { rmSync(work, { recursive: true, force: true }) })

describe('the name a store goes by', () => {
  it('is MemoryStorage in an app bundled and minified, in the events it publishes', async () => {
    mkdirSync(work, { recursive: true })
    const entry = join(work, 'app.ts')
    writeFileSync(entry, `
      import diagnostics from 'node:diagnostics_channel'
      import Fastify from 'fastify'
      import idempotency, { CHANNEL_PREFIX, MemoryStorage } from ${JSON.stringify(join(root, 'lib/index.js'))}
      export async function run () {
        const stores = []
        const listener = (event) => { stores.push(event.store) }
        diagnostics.subscribe(CHANNEL_PREFIX + 'execute', listener)
        const app = Fastify()
        await app.register(idempotency, { storage: new MemoryStorage() })
        app.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }))
        await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'k-1' }, payload: {} })
        await app.close()
        diagnostics.unsubscribe(CHANNEL_PREFIX + 'execute', listener)
        return { stores, className: MemoryStorage.name }
      }
    `)
    const outfile = join(work, 'app.mjs')
    await build({ entryPoints: [entry], outfile, bundle: true, minify: true, platform: 'node', format: 'esm', target: 'node20', packages: 'external', logLevel: 'silent' })
    const { run } = await import(pathToFileURL(outfile).href) as { run: () => Promise<{ stores: string[], className: string }> }
    const { stores, className } = await run()
    // The bundle did rename the class: what it is called no longer says what it is.
    expect(className).not.toBe('MemoryStorage')
    expect(stores).toEqual(['MemoryStorage'])
  })

  it('is the class name of each built-in store, and a subclass goes by its own', async () => {
    const knex = knexFactory({ client: 'better-sqlite3', connection: { filename: ':memory:' }, useNullAsDefault: true })
    const redis = new Redis({ lazyConnect: true })
    try {
      expect(storeNameOf(new MemoryStorage())).toBe('MemoryStorage')
      expect(storeNameOf(new KnexStorage({ knex }))).toBe('KnexStorage')
      expect(storeNameOf(new RedisStorage({ client: redis }))).toBe('RedisStorage')
      class CountingStorage extends MemoryStorage {}
      expect(storeNameOf(new CountingStorage())).toBe('CountingStorage')
      expect(Object.prototype.toString.call(new MemoryStorage())).toBe('[object MemoryStorage]')
      const custom = { begin: async () => ({ status: 'in-flight' }) }
      expect(storeNameOf(custom)).toBe('Object')
    } finally {
      redis.disconnect()
      await knex.destroy()
    }
  })
})
