/**
 * The @fastify/autoload layout for real, in a child process, as an app built on it runs: the app is
 * made first, then a plugins folder whose file registers the plugin (and is the first to load the
 * package), then a routes folder, whose route sets `config.idempotency` itself or gets it from the
 * folder's autohooks file (an `onRoute` hook that runs after the plugin's). With fastify-plugin
 * around the plugin file, the routes are guarded (one run, then a replay, a mismatch refused with
 * the whole problem body, over HTTP); without it, the app refuses to start and says why. A plugin
 * registered by the routes folder's own autohooks guards that folder's routes.
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
await app.register(autoload, { dir: join(import.meta.dirname, 'routes'), autoHooks: true, cascadeHooks: true })
try {
  await app.listen({ host: '127.0.0.1', port: 0 })
} catch (error) {
  console.log('not started:', (error as Error).message)
  process.exit(0)
}
const url = \`http://127.0.0.1:\${(app.server.address() as { port: number }).port}/orders\`
const send = (sku: string, key?: string) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { 'idempotency-key': key }) }, body: JSON.stringify({ sku }) })
const first = await send('A1', 'order-1')
const retry = await send('A1', 'order-1')
console.log('answers:', first.status, retry.status, retry.headers.get('idempotent-replayed'), await retry.text())
const other = await send('B2', 'order-1')
console.log('mismatch:', other.status, other.headers.get('content-type'), await other.text())
console.log('without a key:', (await send('A1')).status)
await app.close()
`

const PROBLEM = 'mismatch: 409 application/problem+json; charset=utf-8 {"type":"https://github.com/fastify-idempotency/fastify-idempotency/blob/main/docs/errors.md#fingerprint-mismatch","title":"Idempotency fingerprint mismatch","status":409,"detail":"The request fingerprint does not match the existing entry for this Idempotency-Key; use a new key for a different operation.","idempotencyKey":"order-1"}'

/** The routes folder's route: `config.idempotency` in its options, or none (the autohooks set it). */
function routes (configured: boolean): string {
  return `import type { FastifyInstance } from 'fastify'

let orders = 0
export default async function (app: FastifyInstance) {
  app.post('/', ${configured ? '{ config: { idempotency: { required: true } } }, ' : ''}async (_request, reply) => {
    reply.code(201)
    return { order: ++orders }
  })
}
`
}

/** The routes folder's autohooks: every POST of the folder requires a key; and, if `registers`, the plugin itself. */
function autohooks (registers: boolean): string {
  return `import type { FastifyInstance } from 'fastify'
import fp from 'fastify-plugin'
${registers ? `import idempotency, { idempotencyErrorHandler } from '${plugin}'\n` : ''}
export default fp(async function (app: FastifyInstance) {
${registers ? '  await app.register(idempotency)\n  app.setErrorHandler(idempotencyErrorHandler())\n' : ''}  app.addHook('onRoute', (route) => {
    if (route.method === 'POST') route.config = { ...route.config, idempotency: { required: true } }
  })
})
`
}

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

interface Layout {
  /** A plugins folder whose file registers the plugin, with fastify-plugin around it or not; none: `false`. */
  pluginsFolder: 'wrapped' | 'unwrapped' | false
  /** Where the route's config comes from. */
  config: 'options' | 'autohooks' | 'autohooks that register the plugin'
}

function project (name: string, layout: Layout): string {
  const dir = join(work, name)
  mkdirSync(join(dir, 'plugins'), { recursive: true })
  mkdirSync(join(dir, 'routes', 'orders'), { recursive: true })
  writeFileSync(join(dir, 'app.ts'), app)
  if (layout.pluginsFolder !== false) writeFileSync(join(dir, 'plugins', 'idempotency.ts'), pluginFile(layout.pluginsFolder === 'wrapped'))
  writeFileSync(join(dir, 'routes', 'orders', 'index.ts'), routes(layout.config === 'options'))
  if (layout.config !== 'options') writeFileSync(join(dir, 'routes', 'orders', 'autohooks.ts'), autohooks(layout.config === 'autohooks that register the plugin'))
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

const GUARDED = ['answers: 201 201 true {"order":1}', PROBLEM, 'without a key: 400'].join('\n')

describe('@fastify/autoload: a plugins folder and a routes folder', () => {
  it('with fastify-plugin around the plugin file: the routes are guarded', async () => {
    const { code, output } = await run(project('wrapped', { pluginsFolder: 'wrapped', config: 'options' }))
    expect(code, output).toBe(0)
    expect(output.trim()).toBe(GUARDED)
  }, scaled(60_000))

  it('with fastify-plugin around the plugin file and the config set by the routes folder\'s autohooks: the routes are guarded', async () => {
    const { code, output } = await run(project('autohooks', { pluginsFolder: 'wrapped', config: 'autohooks' }))
    expect(code, output).toBe(0)
    expect(output.trim()).toBe(GUARDED)
  }, scaled(60_000))

  it('with the plugin registered by the routes folder\'s autohooks: that folder\'s routes are guarded', async () => {
    const { code, output } = await run(project('autohooks-register', { pluginsFolder: false, config: 'autohooks that register the plugin' }))
    expect(code, output).toBe(0)
    expect(output.trim()).toBe(GUARDED)
  }, scaled(60_000))

  for (const config of ['options', 'autohooks'] as const) {
    it(`without fastify-plugin, the config set in the ${config}: the app refuses to start, naming the route and the fix`, async () => {
      const { code, output } = await run(project(`unwrapped-${config}`, { pluginsFolder: 'unwrapped', config }))
      expect(code, output).toBe(0)
      expect(output).toContain('not started: fastify-idempotency: 1 route(s) would run unguarded:\n- route POST /orders sets config.idempotency, but no registration of the plugin is in its context or above it')
      expect(output).toContain("a file of @fastify/autoload's plugins folder that registers it needs fastify-plugin: export default fp(...)")
    }, scaled(60_000))
  }
})
