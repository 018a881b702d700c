/**
 * The recipes of docs/jobs.md, as the recipes' tests run them: each is a module the page shows
 * whole, in a block named after its file (`// rabbitmq-consumer.ts`). The worker processes of the
 * tests import it as `examples/recipes/<file>.js`, and `documentedRecipes` hands the bundler the
 * page's block instead, its package imports pointed at the sources in lib/: the code a user copies
 * is the code the tests kill. examples/recipes/ keeps the same modules for the type-checker and
 * for readers of the repository; `expectDocumented` fails when the two drift apart.
 */
import { readFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import type { Plugin } from 'esbuild'
import { expect } from 'vitest'

const root = new URL('../../', import.meta.url)

/** The example's paths into lib/, and the package's entry points a user imports instead. */
const ENTRY_POINTS: Record<string, string> = {
  '../../lib/index.js': 'fastify-idempotency',
  '../../lib/standalone.js': 'fastify-idempotency/standalone',
  '../../lib/redis.js': 'fastify-idempotency/redis',
  '../../lib/knex.js': 'fastify-idempotency/knex'
}

/** The ```ts block of docs/jobs.md whose first line is `// <file>`, without that line; null when there is none. */
function documentedBlock (file: string): string | null {
  const page = readFileSync(new URL('docs/jobs.md', root), 'utf8')
  for (const [, body] of page.matchAll(/^```ts\n([\s\S]*?)^```$/gm)) {
    const [first, ...rest] = body!.split('\n')
    if (first === `// ${file}`) return rest.join('\n')
  }
  return null
}

/** An esbuild plugin: `examples/recipes/<name>.js` is the block `// <name>.ts` of docs/jobs.md. */
export const documentedRecipes: Plugin = {
  name: 'documented-recipes',
  setup (build) {
    build.onResolve({ filter: /examples\/recipes\/[\w-]+\.js$/ }, ({ path }) => ({ path: `${/([\w-]+)\.js$/.exec(path)![1]!}.ts`, namespace: 'docs/jobs.md' }))
    build.onLoad({ filter: /.*/, namespace: 'docs/jobs.md' }, ({ path }) => {
      const block = documentedBlock(path)
      if (block === null) return { errors: [{ text: `docs/jobs.md has no block starting with "// ${path}"` }] }
      const sources = Object.fromEntries(Object.entries(ENTRY_POINTS).map(([source, entry]) => [entry, fileURLToPath(new URL(source.replace('../../', '').replace(/\.js$/, '.ts'), root))]))
      const contents = block.replace(/(from\s+)'(fastify-idempotency(?:\/\w+)?)'/g, (match, from: string, entry: string) => sources[entry] === undefined ? match : `${from}'${sources[entry]}'`)
      return { contents, loader: 'ts', resolveDir: fileURLToPath(root) }
    })
  }
}

export function expectDocumented (file: string): void {
  const example = readFileSync(new URL(`examples/recipes/${file}`, root), 'utf8')
    .replace(/(from\s+)'(\.\.\/\.\.\/lib\/[\w-]+\.js)'/g, (match, from: string, path: string) => ENTRY_POINTS[path] === undefined ? match : `${from}'${ENTRY_POINTS[path]}'`)
  expect(documentedBlock(file), `docs/jobs.md has no block starting with "// ${file}"`).not.toBeNull()
  expect(documentedBlock(file)).toBe(example)
}
