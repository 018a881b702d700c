import { defineConfig } from 'tsup'

export default defineConfig({
  entry: {
    index: 'lib/index.ts',
    redis: 'lib/redis.ts',
    knex: 'lib/knex.ts',
    conformance: 'lib/storage/conformance.ts'
  },
  format: ['esm', 'cjs'],
  dts: true,
  clean: true,
  target: 'node20',
  // structured-headers ships ESM only; bundling it keeps `require('fastify-idempotency')` working
  // on every Node 20 release, not only those that can require() ES modules.
  noExternal: ['structured-headers']
})
