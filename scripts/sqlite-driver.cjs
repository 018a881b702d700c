/**
 * Which better-sqlite3 knex loads for `client: 'better-sqlite3'` in this repository's tests and
 * examples. better-sqlite3 13 (the devDependency) runs on Node 22 and later only: on Node 20 its
 * prebuilt binary crashes at the first statement. better-sqlite3 12 runs on Node 20, and aborts
 * the process on Node 24.19 and later. So, as docs/stores/knex.md tells users, Node 20 gets 12:
 * installed here as `better-sqlite3-node20`. On Node 22 and later this file does nothing.
 *
 * Loaded with `--require` (vitest.config.ts puts it in NODE_OPTIONS for every process of the
 * tests; the SQLite examples' npm scripts pass it to tsx).
 */
'use strict'
if (Number(process.versions.node.split('.')[0]) < 22) {
  // At resolution, so that nothing is loaded before somebody asks for it.
  const Module = require('node:module')
  const resolveFilename = Module._resolveFilename
  Module._resolveFilename = function (request, parent, ...rest) {
    const fromKnex = request === 'better-sqlite3' && /[\\/]node_modules[\\/]knex[\\/]/.test(parent?.filename ?? '')
    return resolveFilename.call(this, fromKnex ? 'better-sqlite3-node20' : request, parent, ...rest)
  }
}
