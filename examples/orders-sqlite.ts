/**
 * `npm run example:sqlite`: the orders-and-payments app (orders-app.ts) with its idempotency keys
 * in its own SQLite database, through KnexStorage: one file holds the orders, the payments and
 * the keys. `npm run example:sqlite -- --self-test` drives it over HTTP and exits.
 */
// In an application of your own: from 'fastify-idempotency/knex'.
import { KnexStorage } from '../lib/knex.js'
import { openDatabase, runExample } from './orders-app.js'

const db = openDatabase(process.argv.includes('--self-test'))

await runExample({
  title: `Orders and payments, with the idempotency keys in SQLite (${db.file})`,
  db,
  // The table of keys is created on first use, next to the app's own tables.
  storage: new KnexStorage({ knex: db.knex, createTable: true }),
  // The self-test's database is a file of its own, deleted when the app closes.
  forget: async () => {},
  close: async () => {}
})
