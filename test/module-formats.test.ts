/**
 * The package loaded with require(), with import(), and with both at once (an app and one of its
 * dependencies), from the packed tarball: what crosses its entry points keeps one meaning. The
 * plugin (dist/index.*) and each store (dist/knex.*, dist/redis.*) share the errors they throw
 * (one CommonJS build, which the ES entries re-export); an entry a store cannot read must be a 409
 * to the plugin of any format, never a store outage (503, or with failOpen a second run).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { join } from 'node:path'
import { cpSync, mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { exec, packedConsumer, root, type PackedConsumer } from './helpers/packed.js'
import { REDIS, service } from './helpers/services.js'
import { scaled } from './helpers/pace.js'

let packed: PackedConsumer
/**
 * The fixtures, copied into the consumer project: run from test/fixtures, `require('fastify-idempotency')`
 * would resolve to this repository itself (a package may import itself by its own name), so to its
 * dist/ rather than the tarball's, and fail where no build is there.
 */
let fixtures: string
const databases = mkdtempSync(join(tmpdir(), 'module-formats-'))

beforeAll(async () => {
  packed = await packedConsumer('module-formats')
  fixtures = join(packed.consumer, 'fixtures')
  cpSync(join(root, 'test', 'fixtures', 'module-formats'), fixtures, { recursive: true })
}, scaled(180_000))
afterAll(() => {
  packed?.remove()
  rmSync(databases, { recursive: true, force: true })
})

let databaseCount = 0
/** A fresh SQLite file: each child starts on an empty table. */
const database = (): string => join(databases, `${++databaseCount}.sqlite`)

const redis = await service(REDIS)
const stores = [
  { kind: 'knex', available: true, reason: '', target: database },
  { kind: 'redis', ...redis, target: () => `redis://${REDIS.host}:${REDIS.port}` }
]

for (const { kind, available, reason, target } of stores) {
  describe(`an entry the ${kind} store cannot read, through every module format${reason}`, () => {
    const formats = [['require', 'require'], ['require', 'import'], ['import', 'require'], ['import', 'import']] as const
    for (const [plugin, store] of formats) {
      it.skipIf(!available)(`is refused with 409 and the handler not run again, plugin by ${plugin}(), store by ${store}(), with and without failOpen`, async () => {
        const finished = await exec(process.execPath, [join(fixtures, 'unreadable.cjs'), target()], packed.consumer, { PLUGIN: plugin, STORE: store, KIND: kind })
        expect(finished.code, finished.output).toBe(0)
        const results = JSON.parse(finished.output.trim().split('\n').at(-1)!) as Record<string, { first: number, retry: number, type: string, runs: number, inspected: string }>
        for (const failOpen of ['failOpen=false', 'failOpen=true']) {
          expect(results[failOpen], failOpen).toEqual({
            first: 200,
            retry: 409,
            type: expect.stringMatching(/#stored-response-unreadable$/),
            runs: 1,
            inspected: 'unreadable'
          })
        }
      }, scaled(60_000))
    }
  })
}

it('runs the conformance kit under require(), with node:test, against the CommonJS memory and knex stores', async () => {
  const finished = await exec(process.execPath, [join(fixtures, 'conformance.cjs'), database()], packed.consumer)
  // The tap reporter (Node 20 and 22) says "# fail 0", the spec reporter (Node 24's default) "ℹ fail 0".
  expect(finished.output).toMatch(/^[#ℹ] fail 0$/m)
  expect(finished.output).toMatch(/^[#ℹ] pass [1-9]\d+$/m)
  expect(finished.code, finished.output).toBe(0)
}, scaled(60_000))
