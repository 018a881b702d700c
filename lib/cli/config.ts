/**
 * The command's configuration: a module that exports the options the app registers the plugin
 * with, `{ storage, encryption? }` (any other option is ignored, except `headerName` and
 * `maxKeyLength`, which decide what a valid key is). Accepted, as its default export or as the
 * module itself (named exports, or CommonJS `module.exports`): that object, a promise of it, or
 * a function (async or not) returning it. `.js`, `.mjs` and `.cjs` load as Node loads them;
 * `.ts`, `.mts` and `.cts` too where Node strips types itself, and otherwise through tsx, when
 * the project the command runs in has it installed.
 */
import { existsSync, readFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { dirname, extname, join, resolve } from 'node:path'
import { pathToFileURL } from 'node:url'
import type { IdempotencyOptions } from '../options.js'

/** The configuration is wrong: exit 2, nothing done. */
export class ConfigError extends Error {}

const TYPESCRIPT = new Set(['.ts', '.mts', '.cts'])

export type CommandConfig = Pick<IdempotencyOptions, 'encryption' | 'headerName' | 'maxKeyLength'> & { storage: NonNullable<IdempotencyOptions['storage']> }

export async function loadConfig (path: string, cwd: string): Promise<CommandConfig> {
  const file = resolve(cwd, path)
  if (!existsSync(file)) throw new ConfigError(`the config module ${path} does not exist (resolved to ${file})`)
  let loaded: unknown
  try {
    loaded = await importModule(file, cwd)
    // An ES module's default export; TypeScript compiled to CommonJS nests it once more.
    for (let depth = 0; depth < 2 && !hasStorage(loaded) && hasDefault(loaded); depth++) loaded = loaded.default
    if (typeof loaded === 'function') loaded = await (loaded as () => unknown)()
    loaded = await loaded
  } catch (error) {
    if (error instanceof ConfigError) throw error
    throw new ConfigError(`the config module ${path} failed: ${(error as Error)?.message ?? String(error)}`, { cause: error })
  }
  const options = loaded as Partial<CommandConfig> | null | undefined
  if (options === null || typeof options !== 'object' || options.storage === undefined || options.storage === null) {
    throw new ConfigError(`the config module ${path} exports no storage: export default { storage, encryption? }, the options the app registers the plugin with`)
  }
  const { storage, encryption, headerName, maxKeyLength } = options
  return { storage, ...(encryption === undefined ? {} : { encryption }), ...(headerName === undefined ? {} : { headerName }), ...(maxKeyLength === undefined ? {} : { maxKeyLength }) }
}

function hasStorage (value: unknown): boolean {
  return value !== null && typeof value === 'object' && 'storage' in value
}

function hasDefault (value: unknown): value is { default: unknown } {
  return value !== null && typeof value === 'object' && (value as { default?: unknown }).default !== undefined
}

async function importModule (file: string, cwd: string): Promise<unknown> {
  // Node.js 23.6 and later strip types themselves (`process.features.typescript`); before, tsx does.
  if (!TYPESCRIPT.has(extname(file)) || (process.features as { typescript?: unknown }).typescript) return await import(pathToFileURL(file).href)
  // tsx, from the project the command runs in.
  let manifest: string
  try {
    manifest = createRequire(join(cwd, 'package.json')).resolve('tsx/package.json')
  } catch {
    throw new ConfigError(`the config module ${file} is TypeScript, which this Node.js does not load by itself: install tsx in the project (npm install --save-dev tsx), or give a .js module`)
  }
  // tsx's ESM API, as its exports map gives it to `import` (its CommonJS build cannot load it from here).
  const exported = (JSON.parse(readFileSync(manifest, 'utf8')) as { exports: Record<string, { import: { default: string } }> }).exports['./esm/api']!.import.default
  const api = await import(pathToFileURL(join(dirname(manifest), exported)).href) as { tsImport: (specifier: string, parent: string) => Promise<unknown> }
  return await api.tsImport(pathToFileURL(file).href, pathToFileURL(join(cwd, 'index.js')).href)
}
