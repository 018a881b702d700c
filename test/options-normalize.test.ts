/**
 * The option table (lib/options/table.ts): every option is normalized the same way in the
 * plugin's options and in a route's `config.idempotency`, and the JSON Schema, the public option
 * types and the normalizer name the same options.
 */
import { isDeepStrictEqual } from 'node:util'
import { describe, expect, it } from 'vitest'
import { MemoryStorage, type IdempotencyOptions, type IdempotencyRouteOptions, type StorageTransaction, type StoredResponse } from '../lib/index.js'
import { closeTimeoutOption } from '../lib/http/shutdown.js'
import { normalizeOptions, optionsSchema, routeConfigSchema, routeSettings, type PluginSettings } from '../lib/options.js'
import { normalizedElsewhere, pluginFields, routeFields } from '../lib/options/table.js'

/** A store that supports transaction mode, so that `transaction: true` is an option it takes. */
class TransactionalMemoryStorage extends MemoryStorage {
  async transaction (): Promise<StorageTransaction> {
    throw new Error('no transaction is opened by these tests')
  }
}

const store = new TransactionalMemoryStorage()
const scope = () => 'tenant'
const redact = (response: StoredResponse) => response
const storeIf = () => true

function normalize (options: IdempotencyOptions): PluginSettings {
  return normalizeOptions(options, options.storage ?? store)
}

/** The names of the fields of `a` and `b` whose values differ. */
function changedFields (a: object, b: object): string[] {
  return Object.keys(a).filter((name) => !isDeepStrictEqual(a[name as keyof typeof a], b[name as keyof typeof b]))
}

interface Sample<O> {
  /** Options that set the option to something other than its default. */
  options: O
  /** The fields of the settings that this changes. */
  changes: string[]
}

/** One of every option a route may set: the type makes a new option fail to compile here until it has one. */
const routeSamples: { [K in keyof Required<IdempotencyRouteOptions>]: Sample<IdempotencyRouteOptions> } = {
  required: { options: { required: true }, changes: ['required'] },
  expiration: { options: { expiration: '1h' }, changes: ['expiration'] },
  lockTimeout: { options: { lockTimeout: '2m' }, changes: ['lockTimeout'] },
  maxLockHold: { options: { maxLockHold: '20m' }, changes: ['maxLockHold'] },
  storeTimeout: { options: { storeTimeout: 250 }, changes: ['storeTimeout'] },
  addCacheableStatusCodes: { options: { addCacheableStatusCodes: [409] }, changes: ['cacheable'] },
  removeCacheableStatusCodes: { options: { removeCacheableStatusCodes: [202] }, changes: ['cacheable'] },
  fingerprint: { options: { fingerprint: { query: true, headers: ['X-Tenant'] } }, changes: ['fingerprint'] },
  maxResponseBytes: { options: { maxResponseBytes: 10 }, changes: ['maxResponseBytes'] },
  unstorableResponse: { options: { unstorableResponse: 'release' }, changes: ['keepUnstorable'] },
  mismatchStatusCode: { options: { mismatchStatusCode: 422 }, changes: ['mismatchStatusCode'] },
  failOpen: { options: { failOpen: true }, changes: ['failOpen'] },
  wait: { options: { wait: true }, changes: ['waitTimeout'] },
  waitTimeout: { options: { wait: true, waitTimeout: '3s' }, changes: ['waitTimeout'] },
  transaction: { options: { transaction: true }, changes: ['transaction'] },
  scope: { options: { scope }, changes: ['scope'] },
  key: { options: { key: (request) => request.headers['webhook-id'] as string | undefined }, changes: ['key'] },
  redact: { options: { redact }, changes: ['redact'] },
  storeIf: { options: { storeIf }, changes: ['storeIf'] }
}

/** One of every option only the plugin takes, and the fields of PluginSettings it changes. */
const pluginSamples: { [K in Exclude<keyof IdempotencyOptions, keyof IdempotencyRouteOptions>]-?: Sample<IdempotencyOptions> } = {
  storage: { options: { storage: new MemoryStorage() }, changes: ['storage'] },
  headerName: { options: { headerName: 'X-Key' }, changes: ['headerName', 'headerLabel'] },
  maxKeyLength: { options: { maxKeyLength: 64 }, changes: ['maxKeyLength'] },
  replayHeader: { options: { replayHeader: false }, changes: ['replayHeader', 'excludedHeaders'] },
  replaySetCookie: { options: { replaySetCookie: true }, changes: ['excludedHeaders'] },
  excludeHeaders: { options: { excludeHeaders: ['X-Trace'] }, changes: ['excludedHeaders'] },
  encryption: { options: { encryption: { keys: [Buffer.alloc(32, 1)], keyHashSecret: Buffer.alloc(32, 2) } }, changes: ['cipher'] },
  checkStore: { options: { checkStore: false }, changes: ['checkStore'] },
  // Normalized by http/shutdown.ts, which knows the server's pluginTimeout: no field here.
  closeTimeout: { options: { closeTimeout: '2s' }, changes: [] }
}

const sorted = (names: Iterable<string>) => [...names].sort()

describe('the schema, the public types and the normalizer name the same options', () => {
  it('has a JSON Schema entry for every public option, and no other', () => {
    expect(sorted(Object.keys(routeConfigSchema.properties))).toEqual(sorted(Object.keys(routeSamples)))
    expect(sorted(Object.keys(optionsSchema.properties))).toEqual(sorted([...Object.keys(routeSamples), ...Object.keys(pluginSamples)]))
  })

  it('makes every option of the schema into a field in exactly one place, and reads no option outside it', () => {
    const tables = [routeFields, pluginFields].flatMap((fields) => Object.values(fields))
    const declared = [...tables.flatMap((field) => Object.keys(field.options)), ...Object.keys(normalizedElsewhere)]
    expect(sorted(declared)).toEqual(sorted(Object.keys(optionsSchema.properties)))
    for (const field of tables) expect(Object.keys(optionsSchema.properties)).toEqual(expect.arrayContaining([...field.uses]))
  })

  it('keeps in the settings the fields of the table and nothing else: no option as it was written', () => {
    const settings = normalize({ maxLockHold: '20m', fingerprint: { query: true } })
    expect(sorted(Object.keys(settings))).toEqual(sorted([...Object.keys(pluginFields), 'defaults']))
    expect(sorted(Object.keys(settings.defaults))).toEqual(sorted(Object.keys(routeFields)))
    const route = routeSettings(settings, { lockTimeout: '15m' }, 'POST /pay')!
    expect(sorted(Object.keys(route))).toEqual(sorted(Object.keys(routeFields)))
  })

  it('changes the settings for every option it takes, each in the fields it makes', () => {
    const defaults = normalize({})
    for (const [name, sample] of Object.entries(routeSamples)) {
      expect({ name, changes: changedFields(normalize(sample.options).defaults, defaults.defaults) }).toEqual({ name, changes: sample.changes })
    }
    for (const [name, sample] of Object.entries(pluginSamples)) {
      const { defaults: _, ...settings } = normalize(sample.options)
      const { defaults: __, ...base } = defaults
      expect({ name, changes: changedFields(settings, base) }).toEqual({ name, changes: sample.changes })
    }
    expect(closeTimeoutOption(pluginSamples.closeTimeout.options.closeTimeout, 0)).not.toBe(closeTimeoutOption(undefined, 0))
  })
})

describe('a route option is normalized as the same option of the plugin', () => {
  for (const [name, sample] of Object.entries(routeSamples)) {
    it(name, () => {
      const plugin = normalize(sample.options)
      expect(routeSettings(normalize({}), sample.options, 'POST /pay')).toEqual(plugin.defaults)
      // A route that sets nothing keeps what the plugin's options made.
      expect(routeSettings(plugin, {}, 'POST /pay')).toEqual(plugin.defaults)
    })
  }
})

describe('a route\'s options over the plugin\'s', () => {
  it('keeps the plugin\'s isolation level for a route that turns transaction mode on, and a route\'s own level over it', () => {
    const plugin = normalize({ transaction: { isolationLevel: 'serializable' } })
    expect(plugin.defaults.transaction).toEqual({ isolationLevel: 'serializable' })
    expect(routeSettings(plugin, { transaction: true }, 'POST /pay')!.transaction).toEqual({ isolationLevel: 'serializable' })
    expect(routeSettings(plugin, { transaction: { isolationLevel: 'read committed' } }, 'POST /pay')!.transaction).toEqual({ isolationLevel: 'read committed' })
    expect(routeSettings(plugin, { transaction: {} }, 'POST /pay')!.transaction).toEqual({ isolationLevel: 'serializable' })
    expect(routeSettings(plugin, { transaction: false }, 'POST /pay')!.transaction).toBeNull()
    expect(normalize({ transaction: true }).defaults.transaction).toEqual({})
    expect(routeSettings(normalize({}), { transaction: { isolationLevel: 'repeatable read' } }, 'POST /pay')!.transaction).toEqual({ isolationLevel: 'repeatable read' })
  })

  it('refuses an isolation level it does not set, and one without a transactional store', () => {
    expect(() => normalize({ transaction: { isolationLevel: 'snapshot' as 'serializable' } })).toThrow(/transaction\.isolationLevel must be equal to one of the allowed values/)
    expect(() => normalize({ transaction: { readOnly: true } as object })).toThrow(/transaction has an unknown property 'readOnly'/)
    expect(() => normalize({ storage: new MemoryStorage(), transaction: { isolationLevel: 'serializable' } })).toThrow(/transaction mode needs a storage that supports transactions/)
  })

  it('merges fingerprint options, and adds and removes status codes after the plugin did', () => {
    const plugin = normalize({ fingerprint: { query: true, headers: ['x-a'] }, addCacheableStatusCodes: [500], removeCacheableStatusCodes: [202] })
    const route = routeSettings(plugin, { fingerprint: { method: true, headers: ['x-b'] }, addCacheableStatusCodes: [202], removeCacheableStatusCodes: [500] }, 'POST /pay')!
    expect(route.fingerprint).toEqual(normalize({ fingerprint: { query: true, method: true, headers: ['x-b'] } }).defaults.fingerprint)
    expect([...route.cacheable].sort((a, b) => a - b)).toEqual([200, 201, 202, 204, 302, 303])
  })

  it('holds a route\'s lockTimeout to the plugin\'s maxLockHold, and the default maxLockHold to the route\'s lockTimeout', () => {
    expect(() => routeSettings(normalize({ maxLockHold: '15m' }), { lockTimeout: '20m' }, 'POST /pay'))
      .toThrow(/config\.idempotency of route POST \/pay: maxLockHold \(900000 ms\) must not be shorter than lockTimeout \(1200000 ms\)/)
    expect(routeSettings(normalize({}), { lockTimeout: '20m' }, 'POST /pay')!.maxLockHold).toBe(20 * 60_000)
  })

  it('keeps the wait of the plugin\'s options when a route stops waiting, and its waitTimeout when a route sets none', () => {
    const plugin = normalize({ wait: true, waitTimeout: '3s' })
    expect(routeSettings(plugin, { wait: false }, 'POST /pay')!.waitTimeout).toBe(0)
    expect(routeSettings(plugin, { required: true }, 'POST /pay')!.waitTimeout).toBe(3000)
    expect(routeSettings(normalize({ wait: true }), { waitTimeout: 50 }, 'POST /pay')!.waitTimeout).toBe(50)
  })

  it('is not changed by changing the plugin\'s options object after registering', () => {
    const options = { fingerprint: { query: true }, addCacheableStatusCodes: [500] }
    const plugin = normalize(options)
    options.fingerprint.query = false
    options.addCacheableStatusCodes.push(501)
    const route = routeSettings(plugin, { fingerprint: { method: true }, removeCacheableStatusCodes: [200], lockTimeout: '2m' }, 'POST /pay')!
    expect(route.fingerprint).toEqual(normalize({ fingerprint: { query: true, method: true } }).defaults.fingerprint)
    expect(route.cacheable.has(500) && !route.cacheable.has(501)).toBe(true)
  })
})
