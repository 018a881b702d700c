import { defineConfig } from 'tsup'

/**
 * One CommonJS build whose entries share their chunks: the core is in the package once. The ES
 * entries (dist/*.js) re-export these modules, written after this build by scripts/esm-entries.mjs
 * from the metafile's export lists; `import` and `require()` thus load the same modules.
 */
export default defineConfig({
  entry: {
    index: 'lib/index.ts',
    redis: 'lib/redis.ts',
    knex: 'lib/knex.ts',
    conformance: 'lib/storage/conformance.ts',
    standalone: 'lib/standalone.ts',
    // The command (package.json `bin`): loaded by Node as the program; not an entry to import.
    cli: 'lib/cli/main.ts'
  },
  format: ['cjs'],
  // esbuild splits ES modules only: tsup builds ES chunks, then Rollup writes each as CommonJS
  // (`treeshake` makes tsup use Rollup for that step; its sucrase alternative rewrites `?.` and
  // `??` into helper calls on the request path).
  splitting: true,
  treeshake: 'safest',
  metafile: true,
  clean: true,
  target: 'node20',
  // devalue ships ESM only; bundling it keeps `require('fastify-idempotency')` working on every
  // Node 20 release, not only those that can require() ES modules. (structured-headers ships both.)
  noExternal: ['devalue']
})
