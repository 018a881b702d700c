/**
 * `npm run example:transaction`: exactly-once effects. `POST /orders` inserts an order and its
 * ledger row through the request's transaction (transaction mode), so the two rows and the stored
 * response commit together or not at all. `--self-test` drives it over HTTP and exits.
 */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import Fastify from 'fastify'
import knexFactory from 'knex'
// In an application of your own: from 'fastify-idempotency' and 'fastify-idempotency/knex'.
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'
import { KnexStorage, transactionOf } from '../lib/knex.js'

const selfTest = process.argv.includes('--self-test')
const dir = mkdtempSync(join(tmpdir(), 'orders-transaction-'))
const knex = knexFactory({ client: 'better-sqlite3', connection: { filename: join(dir, 'orders.sqlite') }, useNullAsDefault: true })
await knex.schema.createTable('orders', (t) => { t.increments('id'); t.string('sku').notNullable(); t.integer('cents').notNullable() })
await knex.schema.createTable('ledger', (t) => { t.increments('id'); t.integer('order_id').notNullable(); t.integer('cents').notNullable() })

const app = Fastify()
await app.register(idempotency, { storage: new KnexStorage({ knex, createTable: true }), required: true, transaction: true })
app.setErrorHandler(idempotencyErrorHandler())
app.addHook('onClose', async () => {
  await knex.destroy()
  rmSync(dir, { recursive: true, force: true })
})

const PRICES: Record<string, number> = { book: 2500, mug: 900 }

app.post('/orders', { config: { idempotency: true } }, async (request, reply) => {
  const trx = transactionOf(request)
  const { sku, failAfterWrites } = request.body as { sku: string, failAfterWrites?: boolean }
  const cents = PRICES[sku]
  if (cents === undefined) { reply.code(404); return { error: `no product ${sku}` } }
  const [id] = await trx('orders').insert({ sku, cents })
  await trx('ledger').insert({ order_id: id, cents })
  // A failure after the writes: the transaction rolls both rows back, and a retry runs again.
  if (failAfterWrites === true) throw new Error('the payment provider timed out')
  reply.code(201).header('location', `/orders/${id}`)
  return { id, sku, cents }
})

const counts = async () => ({
  orders: Number((await knex('orders').count({ n: '*' }))[0]!.n),
  ledger: Number((await knex('ledger').count({ n: '*' }))[0]!.n)
})

if (!selfTest) {
  const address = await app.listen({ host: '127.0.0.1', port: Number(process.env.PORT ?? 3000) })
  console.log(`Orders with exactly-once effects on ${address}. Try:`)
  console.log(`  curl -i -X POST ${address}/orders -H 'content-type: application/json' -H 'idempotency-key: o-1' -d '{"sku":"book"}'`)
} else {
  const address = await app.listen({ host: '127.0.0.1', port: 0 })
  const post = async (key: string, body: object) => {
    const res = await fetch(`${address}/orders`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(body) })
    return { status: res.status, replayed: res.headers.get('idempotent-replayed') === 'true', body: await res.text() }
  }
  const check = (ok: boolean, line: string) => {
    console.log(`  ${ok ? 'ok' : 'FAIL'}  ${line}`)
    if (!ok) process.exitCode = 1
  }
  console.log(`Orders with exactly-once effects, transaction mode on SQLite (${dir})`)
  const first = await post('order-1', { sku: 'book' })
  check(first.status === 201 && (await counts()).orders === 1, `first request   -> ${first.status}, 1 order and 1 ledger row committed with the stored response`)
  const replay = await post('order-1', { sku: 'book' })
  const afterReplay = await counts()
  check(replay.replayed && replay.body === first.body && afterReplay.orders === 1 && afterReplay.ledger === 1, `replay          -> ${replay.status}, idempotent-replayed: true, still 1 order and 1 ledger row`)
  const failed = await post('order-2', { sku: 'mug', failAfterWrites: true })
  const afterFailure = await counts()
  check(failed.status === 500 && afterFailure.orders === 1 && afterFailure.ledger === 1, `failure         -> ${failed.status}, the order and ledger rows it wrote were rolled back`)
  const retry = await post('order-2', { sku: 'mug' })
  const afterRetry = await counts()
  check(retry.status === 201 && !retry.replayed && afterRetry.orders === 2 && afterRetry.ledger === 2, `retry           -> ${retry.status}, ran again: 2 orders and 2 ledger rows in all`)
  console.log(process.exitCode === 1 ? 'self-test FAILED' : 'self-test passed: 4 requests, every write committed exactly once')
  await app.close()
}
