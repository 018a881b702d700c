/**
 * The orders-and-payments app of `npm run example:sqlite` and `npm run example:redis`: its tables
 * (in SQLite, through knex), its routes, and the command line both share: serve on 127.0.0.1, or
 * drive itself over real HTTP with `--self-test`. Only the idempotency store differs between the two.
 */
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import Fastify, { type FastifyInstance } from 'fastify'
import knexFactory, { type Knex } from 'knex'
// In an application of your own: from 'fastify-idempotency'.
import idempotency, { idempotencyErrorHandler, type IdempotencyStorage } from '../lib/index.js'

/** Prices in cents: the client names a product, the server decides what it costs. */
const PRICES: Record<string, number> = { book: 1250, mug: 900, pen: 300 }

export interface Database {
  knex: Knex
  file: string
  /** Delete the file, when it is the self-test's own. */
  remove: () => void
}

/**
 * The app's SQLite database. The self-test gets a fresh file of its own, so that its checks do not
 * depend on earlier runs and it leaves nothing behind. Otherwise SQLITE_FILE, or a file in the
 * system's temporary directory that keeps its orders from one run to the next.
 */
export function openDatabase (selfTest: boolean): Database {
  let file = process.env.SQLITE_FILE ?? join(tmpdir(), 'fastify-idempotency-orders.sqlite')
  let remove = () => {}
  if (selfTest) {
    const dir = mkdtempSync(join(tmpdir(), 'orders-example-'))
    file = join(dir, 'orders.sqlite')
    remove = () => rmSync(dir, { recursive: true, force: true })
  }
  const knex = knexFactory({ client: 'better-sqlite3', connection: { filename: file }, useNullAsDefault: true })
  return { knex, file, remove }
}

async function createTables (knex: Knex): Promise<void> {
  if (!await knex.schema.hasTable('orders')) {
    await knex.schema.createTable('orders', (table) => {
      table.increments('id')
      table.string('sku').notNullable()
      table.integer('quantity').notNullable()
      table.integer('amount').notNullable()
      table.string('status').notNullable()
      table.string('created_at').notNullable()
    })
  }
  if (!await knex.schema.hasTable('payments')) {
    await knex.schema.createTable('payments', (table) => {
      table.increments('id')
      table.integer('order_id').notNullable().references('orders.id')
      table.integer('amount').notNullable()
      table.string('created_at').notNullable()
    })
  }
}

interface OrderRow { id: number, sku: string, quantity: number, amount: number, status: string, created_at: string }

const orderJson = (row: OrderRow) => ({ id: row.id, sku: row.sku, quantity: row.quantity, amount: row.amount, currency: 'eur', status: row.status, createdAt: row.created_at })

/** The app: the plugin on `storage`, and the routes on `knex`. `logRequests` prints one line per answer. */
export async function buildApp (knex: Knex, storage: IdempotencyStorage, logRequests = false): Promise<FastifyInstance> {
  await createTables(knex)
  const app = Fastify()
  // Registered (with await) before the routes it guards.
  await app.register(idempotency, { storage, expiration: '24h' })
  app.setErrorHandler(idempotencyErrorHandler())
  if (logRequests) {
    app.addHook('onResponse', async (request, reply) => {
      const replayed = reply.getHeader('idempotent-replayed') === 'true' ? ' (replayed)' : ''
      console.log(`${request.method} ${request.url} -> ${reply.statusCode}${replayed}`)
    })
  }

  // Creating an order twice would be a duplicate order: a key is required, and a retry with it
  // gets the first answer back.
  app.post('/orders', {
    config: { idempotency: { required: true } },
    schema: {
      body: {
        type: 'object',
        additionalProperties: false,
        required: ['sku', 'quantity'],
        properties: { sku: { enum: Object.keys(PRICES) }, quantity: { type: 'integer', minimum: 1, maximum: 100 } }
      }
    }
  }, async (request, reply) => {
    const { sku, quantity } = request.body as { sku: string, quantity: number }
    const [id] = await knex('orders').insert({ sku, quantity, amount: PRICES[sku]! * quantity, status: 'open', created_at: new Date().toISOString() })
    const row = await knex<OrderRow>('orders').where({ id }).first()
    reply.code(201).header('location', `/orders/${id}`)
    return orderJson(row!)
  })

  // A charge must never run twice. The path is in the fingerprint, so a key already used for
  // another route is refused here instead of replaying that route's answer.
  app.post('/payments', {
    config: { idempotency: { required: true, fingerprint: { path: true } } },
    schema: {
      body: { type: 'object', additionalProperties: false, required: ['orderId'], properties: { orderId: { type: 'integer', minimum: 1 } } }
    }
  }, async (request, reply) => {
    const { orderId } = request.body as { orderId: number }
    const outcome = await knex.transaction(async (trx) => {
      const order = await trx<OrderRow>('orders').where({ id: orderId }).first()
      if (order === undefined) return { status: 404, body: { error: `no order ${orderId}` } }
      if (order.status === 'paid') return { status: 409, body: { error: `order ${orderId} is already paid` } }
      const [id] = await trx('payments').insert({ order_id: orderId, amount: order.amount, created_at: new Date().toISOString() })
      await trx('orders').where({ id: orderId }).update({ status: 'paid' })
      reply.header('location', `/payments/${id}`)
      return { status: 201, body: { id, orderId, amount: order.amount, currency: 'eur', status: 'captured' } }
    })
    // 404 and 409 are not cacheable statuses: they are not stored, and a retry runs again.
    return reply.code(outcome.status).send(outcome.body)
  })

  app.get('/orders/:id', async (request, reply) => {
    const { id } = request.params as { id: string }
    const row = await knex<OrderRow>('orders').where({ id: Number(id) }).first()
    if (row === undefined) return reply.code(404).send({ error: `no order ${id}` })
    return orderJson(row)
  })

  return app
}

export interface ExampleOptions {
  /** One line on where the orders and the idempotency keys live. */
  title: string
  db: Database
  storage: IdempotencyStorage
  /** Delete the idempotency keys the self-test used, so that it leaves nothing behind. */
  forget: (keys: string[]) => Promise<void>
  /** Close what the example opened for its store (the app closes the database itself). */
  close: () => Promise<void>
}

/** Serve the app, or with `--self-test` drive it over HTTP and exit 0 when every check holds. */
export async function runExample (options: ExampleOptions): Promise<void> {
  const selfTest = process.argv.includes('--self-test')
  const app = await buildApp(options.db.knex, options.storage, !selfTest)
  app.addHook('onClose', async () => {
    await options.close()
    await options.db.knex.destroy()
    options.db.remove()
  })

  if (selfTest) {
    const address = await app.listen({ host: '127.0.0.1', port: 0 })
    console.log(`${options.title}\nself-test on ${address}`)
    const keys = { order: `order-${randomUUID()}`, payment: `payment-${randomUUID()}` }
    try {
      await drive(address, options.db.knex, keys)
    } finally {
      await options.forget(Object.values(keys))
      await app.close()
    }
    return
  }

  const port = Number(process.env.PORT ?? 3000)
  const address = await app.listen({ host: '127.0.0.1', port })
  const json = "-H 'content-type: application/json'"
  console.log(`${options.title}
Listening on ${address}. Try it (each POST twice: the second answer is replayed):

  curl -i -X POST ${address}/orders ${json} -H 'idempotency-key: order-1' -d '{"sku":"book","quantity":2}'
  curl -i -X POST ${address}/payments ${json} -H 'idempotency-key: pay-1' -d '{"orderId":1}'
  curl -i ${address}/orders/1

The same key with another body gets 409; a POST without a key gets 400. Stop with Ctrl+C.`)
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.once(signal, () => { void app.close().then(() => console.log('closed')) })
  }
}

interface Answer { status: number, replayed: boolean, location: string | null, text: string, json: Record<string, unknown> }

async function send (address: string, method: string, path: string, key: string | null, body?: object): Promise<Answer> {
  const headers: Record<string, string> = {}
  if (body !== undefined) headers['content-type'] = 'application/json'
  if (key !== null) headers['idempotency-key'] = key
  const response = await fetch(`${address}${path}`, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) })
  const text = await response.text()
  return {
    status: response.status,
    replayed: response.headers.get('idempotent-replayed') === 'true',
    location: response.headers.get('location'),
    text,
    json: JSON.parse(text) as Record<string, unknown>
  }
}

const count = async (knex: Knex, table: string) => Number((await knex(table).count({ n: '*' }))[0]!.n)

/** A few real HTTP exchanges, each checked, each printed as one line. */
async function drive (address: string, knex: Knex, keys: { order: string, payment: string }): Promise<void> {
  const step = (line: string) => console.log(`  ok  ${line}`)
  const problem = (answer: Answer) => String(answer.json.type).split('#')[1]

  const first = await send(address, 'POST', '/orders', keys.order, { sku: 'book', quantity: 2 })
  assert.equal(first.status, 201, first.text)
  assert.equal(first.replayed, false)
  const orderId = Number(first.json.id)
  step(`first request   POST /orders   -> 201, order ${orderId} created (${first.location})`)

  const retry = await send(address, 'POST', '/orders', keys.order, { sku: 'book', quantity: 2 })
  assert.equal(retry.status, 201, retry.text)
  assert.equal(retry.replayed, true)
  assert.equal(retry.text, first.text)
  assert.equal(await count(knex, 'orders'), 1)
  step('replay          POST /orders   -> 201, idempotent-replayed: true, same body, still 1 order')

  const changed = await send(address, 'POST', '/orders', keys.order, { sku: 'book', quantity: 3 })
  assert.equal(changed.status, 409, changed.text)
  assert.equal(problem(changed), 'fingerprint-mismatch')
  assert.equal(await count(knex, 'orders'), 1)
  step('mismatch        POST /orders   -> 409 fingerprint-mismatch (same key, other body)')

  const unkeyed = await send(address, 'POST', '/orders', null, { sku: 'pen', quantity: 1 })
  assert.equal(unkeyed.status, 400, unkeyed.text)
  assert.equal(problem(unkeyed), 'key-missing')
  step('no key          POST /orders   -> 400 key-missing')

  const paid = await send(address, 'POST', '/payments', keys.payment, { orderId })
  assert.equal(paid.status, 201, paid.text)
  assert.equal(paid.json.status, 'captured')
  step(`first request   POST /payments -> 201, payment ${String(paid.json.id)} captured, ${String(paid.json.amount)} cents`)

  const paidAgain = await send(address, 'POST', '/payments', keys.payment, { orderId })
  assert.equal(paidAgain.status, 201, paidAgain.text)
  assert.equal(paidAgain.replayed, true)
  assert.equal(paidAgain.text, paid.text)
  assert.equal(await count(knex, 'payments'), 1)
  step('replay          POST /payments -> 201, idempotent-replayed: true, still 1 payment')

  // The order's key on the payments route: the fingerprints differ (the path is in this route's),
  // so it is refused instead of answering with the order.
  const crossed = await send(address, 'POST', '/payments', keys.order, { orderId })
  assert.equal(crossed.status, 409, crossed.text)
  assert.equal(problem(crossed), 'fingerprint-mismatch')
  assert.equal(await count(knex, 'payments'), 1)
  step('mismatch        POST /payments -> 409 fingerprint-mismatch (the order\'s key on another route)')

  const order = await send(address, 'GET', `/orders/${orderId}`, null)
  assert.equal(order.status, 200, order.text)
  assert.equal(order.json.status, 'paid')
  step(`read            GET  /orders/${orderId} -> 200, status paid`)

  console.log('self-test passed: 8 requests, 1 order and 1 payment written')
}
