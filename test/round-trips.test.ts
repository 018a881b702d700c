/**
 * The round-trip promise at the plugin level: a replay costs one store round trip, a first
 * request two (begin, then complete), on Redis and on PostgreSQL.
 */
import { afterAll, describe, expect, it } from 'vitest'
import { Redis } from 'ioredis'
import knexFactory from 'knex'
import { KnexStorage } from '../lib/knex.js'
import { dropIdempotencyTable } from '../lib/knex.js'
import { RedisStorage } from '../lib/redis.js'
import { buildApp, newKey } from './helpers/app.js'
import { POSTGRES, REDIS, deleteRedisPrefix, pgConnection, service } from './helpers/services.js'

const redis = await service(REDIS)
const postgres = await service(POSTGRES)

async function rounds (app: Awaited<ReturnType<typeof buildApp>>['app'], count: () => number) {
  const key = newKey('rt')
  const send = () => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload: { a: 1 } })
  // Warm up (script loading, table creation) on another key first.
  await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': newKey('warm') }, payload: { a: 1 } })
  const before = count()
  expect((await send()).statusCode).toBe(201)
  const first = count() - before
  const replay = await send()
  expect(replay.headers['idempotent-replayed']).toBe('true')
  return { first, replay: count() - before - first }
}

describe.skipIf(!redis.available)(`round trips on Redis${redis.reason}`, () => {
  const client = new Redis({ host: REDIS.host, port: REDIS.port, enableAutoPipelining: true })
  const prefix = `rt:${process.pid}:${Date.now()}:`
  afterAll(async () => {
    await deleteRedisPrefix(client, prefix)
    await client.quit()
  })

  it('costs two commands for a first request and one for a replay', async () => {
    let commands = 0
    const send = client.sendCommand.bind(client)
    client.sendCommand = ((command: Parameters<typeof send>[0], stream?: Parameters<typeof send>[1]) => { commands++; return send(command, stream) }) as typeof client.sendCommand
    const { app } = await buildApp({ storage: new RedisStorage({ client, prefix }) })
    expect(await rounds(app, () => commands)).toEqual({ first: 2, replay: 1 })
    await app.close()
  })
})

describe.skipIf(!postgres.available)(`round trips on PostgreSQL${postgres.reason}`, () => {
  const knex = knexFactory({ client: 'pg', connection: pgConnection })
  const table = `rt_${process.pid}_${Date.now()}`
  afterAll(async () => {
    await dropIdempotencyTable(knex, table)
    await knex.destroy()
  })

  it('costs two statements for a first request and one for a replay', async () => {
    // Every statement reaches node-postgres's Client#query: knex's, and the ones the store sends on
    // a pooled connection directly.
    let statements = 0
    const prototype = (knex.client.driver as { Client: { prototype: { query: (...args: unknown[]) => unknown } } }).Client.prototype
    const query = prototype.query
    prototype.query = function (this: unknown, ...args: unknown[]) { statements++; return query.apply(this, args) }
    try {
      const { app } = await buildApp({ storage: new KnexStorage({ knex, tableName: table, createTable: true }) })
      expect(await rounds(app, () => statements)).toEqual({ first: 2, replay: 1 })
      await app.close()
    } finally {
      prototype.query = query
    }
  })
})
