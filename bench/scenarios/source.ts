/**
 * Where the servers take fastify-idempotency from. Default: the TypeScript sources in lib/, which
 * tsx transpiles with esbuild at load time, for the same Node 20 target tsup builds dist/ with.
 * `BENCH_SOURCE=dist` (after `npm run build`) loads the built package instead, the files users get.
 */
import { existsSync } from 'node:fs'
import { fileURLToPath, pathToFileURL } from 'node:url'

type Core = typeof import('../../lib/index.js')
type RedisModule = typeof import('../../lib/redis.js')
type KnexModule = typeof import('../../lib/knex.js')

export const source: 'lib' | 'dist' = process.env.BENCH_SOURCE === 'dist' ? 'dist' : 'lib'

function distFile (name: string): string {
  const path = fileURLToPath(new URL(`../../dist/${name}.js`, import.meta.url))
  if (!existsSync(path)) throw new Error(`BENCH_SOURCE=dist but ${path} is missing: run \`npm run build\` first`)
  return pathToFileURL(path).href
}

export async function loadCore (): Promise<Core> {
  if (source === 'dist') return await import(distFile('index')) as Core
  return await import('../../lib/index.js')
}

export async function loadRedisStorage (): Promise<RedisModule> {
  if (source === 'dist') return await import(distFile('redis')) as RedisModule
  return await import('../../lib/redis.js')
}

export async function loadKnexStorage (): Promise<KnexModule> {
  if (source === 'dist') return await import(distFile('knex')) as KnexModule
  return await import('../../lib/knex.js')
}
