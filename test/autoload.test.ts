/**
 * The @fastify/autoload layout for real, in a child process, as an app built on it runs: the app is
 * made first, then a plugins folder whose file registers the plugin (and is the first to load the
 * package), then a routes folder. With fastify-plugin around the plugin file, the routes are
 * guarded (one run, then a replay, over HTTP); without it, the app refuses to start and says why.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { spawn } from 'node:child_process'
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { pathToFileURL } from 'node:url'
import { scaled } from './helpers/pace.js'

const root = resolve(import.meta.dirname, '..')
const work = join(root, '.tmp', `autoload-${process.pid}`)
const plugin = pathToFileURL(join(root, 'lib/index.ts')).href

const app = `import { join } from 'node:path'
import Fastify from 'fastify'
import autoload from '@fastify/autoload'

const app = Fastify()
await app.register(autoload, { dir: join(import.meta.dirname, 'plugins') })
await app.register(autoload, { dir: join(import.meta.dirname, 'routes') })
try {
  await app.listen({ host: '127.0.0.1', port: 0 })
} catch (error) {
  console.log('not started:', (error as Error).message)
  process.exit(0)
}
const url = \`http://127.0.0.1:\${(app.server.address() as { port: number }).port}/orders\`
const send = () => fetch(url, { method: 'POST', headers: { 'idempotency-key': 'order-1', 'content-type': 'application/json' }, body: '{"sku":"A1"}' })
const first = await send()
const retry = await send()
console.log('answers:', first.status, retry.status, retry.headers.get('idempotent-replayed'), await retry.text())
await app.close()
`

const routes = `import type { FastifyInstance } from 'fastify'

let orders = 0
export default async function (app: FastifyInstance) {
  app.post('/orders', { config: { idempotency: { required: true } } }, async (_request, reply) => {
    reply.code(201)
    return { order: ++orders }
  })
}
`

function pluginFile (wrapped: boolean): string {
  const body = `async function (app: FastifyInstance) {
  await app.register(idempotency)
  app.setErrorHandler(idempotencyErrorHandler())
}`
  return `import type { FastifyInstance } from 'fastify'
import fp from 'fastify-plugin'
import idempotency, { idempotencyErrorHandler } from '${plugin}'

${wrapped ? `export default fp(${body})` : `export default ${body}`}
`
}

function project (name: string, wrapped: boolean): string {
  const dir = join(work, name)
  mkdirSync(join(dir, 'plugins'), { recursive: true })
  mkdirSync(join(dir, 'routes'), { recursive: true })
  writeFileSync(join(dir, 'app.ts'), app)
  writeFileSync(join(dir, 'plugins', 'idempotency.ts'), pluginFile(wrapped))
  writeFileSync(join(dir, 'routes', 'orders.ts'), routes)
  return join(dir, 'app.ts')
}

function run (file: string): Promise<{ code: number | null, output: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ['--import', 'tsx', file], { cwd: root, stdio: ['ignore', 'pipe', 'pipe'] })
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { output += chunk.toString() })
    const timer = setTimeout(() => { child.kill('SIGKILL') }, scaled(45_000))
    child.once('close', (code) => {
      clearTimeout(timer)
      resolve({ code, output })
    })
  })
}

beforeAll(() => { rmSync(work, { recursive: true, force: true }) })
afterAll(() => { rmSync(work, { recursive: true, force: true }) })

describe('@fastify/autoload: a plugins folder and a routes folder', () => {
  it('with fastify-plugin around the plugin file: the routes are guarded', async () => {
    const { code, output } = await run(project('wrapped', true))
    expect(code, output).toBe(0)
    expect(output.trim()).toBe('answers: 201 201 true {"order":1}')
  }, scaled(60_000))

  it('without it: the app refuses to start, naming the route and the fix', async () => {
    const { code, output } = await run(project('unwrapped', false))
    expect(code, output).toBe(0)
    expect(output).toContain('not started: fastify-idempotency: 1 route(s) would run unguarded:\n- route POST /orders sets config.idempotency, but no registration of the plugin is in its context or above it')
    expect(output).toContain("a file of @fastify/autoload's plugins folder that registers it needs fastify-plugin: export default fp(...)")
  }, scaled(60_000))
})
