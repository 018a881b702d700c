/**
 * The recipes of docs/jobs.md are the modules in examples/recipes/ that the recipes' tests run:
 * the page shows each one whole, in a block named after its file (`// rabbitmq-consumer.ts`), with
 * the package's import specifiers where the example has paths into lib/. `expectDocumented` fails
 * when the two drift apart, so that the code a user copies is the code the tests kill.
 */
import { readFileSync } from 'node:fs'
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

export function expectDocumented (file: string): void {
  const example = readFileSync(new URL(`examples/recipes/${file}`, root), 'utf8')
    .replace(/(from\s+)'(\.\.\/\.\.\/lib\/[\w-]+\.js)'/g, (match, from: string, path: string) => ENTRY_POINTS[path] === undefined ? match : `${from}'${ENTRY_POINTS[path]}'`)
  expect(documentedBlock(file), `docs/jobs.md has no block starting with "// ${file}"`).not.toBeNull()
  expect(documentedBlock(file)).toBe(example)
}
