import { it } from 'vitest'
import knexFactory, { type Knex } from 'knex'
import { KnexStorage } from '../lib/knex.js'
import { pgConnection, mysqlConnection } from './helpers/services.js'

const camel = (s: string) => s.replace(/_([a-z])/g, (_m, c: string) => c.toUpperCase())
const snake = (s: string) => s.replace(/([A-Z])/g, (c) => '_' + c.toLowerCase())
const mapKeys = (o: any) => { if (o === null || typeof o !== 'object' || Buffer.isBuffer(o)) return o; const r: any = {}; for (const k of Object.keys(o)) r[camel(k)] = o[k]; return r }
const mappers = {
  wrapIdentifier: (value: string, orig: (v: string) => string) => orig(snake(value)),
  postProcessResponse: (result: any) => Array.isArray(result) ? result.map(mapKeys) : mapKeys(result)
}
const configs: Record<string, Knex.Config> = {
  pg: { client: 'pg', connection: pgConnection, ...mappers },
  mysql: { client: 'mysql2', connection: mysqlConnection, ...mappers },
  sqlite: { client: 'better-sqlite3', connection: { filename: ':memory:' }, useNullAsDefault: true, ...mappers }
}
for (const [name, config] of Object.entries(configs)) {
  it(`snake case mappers on ${name}`, async () => {
    const knex = knexFactory(config)
    const table = `snake_${Date.now()}`
    const storage = new KnexStorage({ knex, tableName: table, createTable: true })
    const out: unknown[] = []
    try {
      const b = await storage.begin('k1', 'fp', 30000) as any; out.push(b.state)
      out.push((await storage.begin('k1', 'fp', 30000)).state)
      out.push(await storage.renew('k1', b.token, 30000))
      out.push(await storage.complete('k1', b.token, { statusCode: 201, contentType: 'application/json', headers: { a: '1' }, body: Buffer.from('{}') }, 60000))
      const r = await storage.begin('k1', 'fp', 30000) as any; out.push(r.state, r.response?.statusCode, JSON.stringify(r.response?.headers))
      const c = await storage.begin('k2', 'fp', 30000) as any; out.push(await storage.release('k2', c.token))
      out.push(JSON.stringify(await storage.purgeExpired()))
    } catch (e) { out.push('ERROR ' + (e as Error).message.slice(0, 150)) }
    console.log(name, out)
    await knex.schema.dropTableIfExists(table); await knex.destroy()
  })
}
