import { defineConfig } from 'tsup'

export default defineConfig([{
  entry: {
    index: 'lib/index.ts',
    redis: 'lib/redis.ts',
    knex: 'lib/knex.ts',
    conformance: 'lib/storage/conformance.ts',
    standalone: 'lib/standalone.ts'
  },
  format: ['esm', 'cjs'],
  dts: false,
  clean: true,
  target: 'node20',
  // devalue ships ESM only; bundling it keeps `require('fastify-idempotency')` working on every
  // Node 20 release, not only those that can require() ES modules. (structured-headers ships both.)
  noExternal: ['devalue']
}, {
  // The command (package.json `bin`): ESM only, loaded by Node as the program; not an entry to import.
  entry: { cli: 'lib/cli/main.ts' },
  format: ['esm'],
  target: 'node20',
  noExternal: ['devalue']
}])
