/**
 * The CommonJS main entry as @fastify plugins have it: `require('fastify-idempotency')` is the
 * plugin itself, and its other exports (`default`, `idempotency`, `MemoryStorage`, the errors...)
 * are the plugin's properties, so that `fastify.register(require('fastify-idempotency'))`,
 * TypeScript's `import idempotency = require('fastify-idempotency')` and a checked JavaScript
 * file all see the plugin where they expect it.
 *
 * - dist/index.cjs (run as a script, after tsup): tsup's exports object is copied onto the plugin,
 *   which becomes `module.exports`;
 * - dist/index.d.cts (`writeRequireDeclarations`, called by scripts/build-types.mjs): the
 *   declarations of lib/index.ts move to dist/exports.d.cts, and index.d.cts declares the plugin
 *   as a function merged with a namespace of those exports (`export =`), as the @fastify plugins'
 *   own declarations do. The ES entry's default export is that plugin too (scripts/esm-entries.mjs).
 */
import { appendFileSync, readFileSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'

/** Every name lib/index.ts's declarations export (values and types), but `default`. */
function exportedNames (declarations) {
  const names = new Set()
  for (const [, list] of declarations.matchAll(/^export (?:type )?\{([^}]*)\}/gm)) {
    for (const item of list.split(',')) {
      const name = item.trim().replace(/^type\s+/, '').split(/\s+as\s+/).at(-1)
      if (name) names.add(name)
    }
  }
  for (const [, name] of declarations.matchAll(/^export declare (?:const|let|function|class|abstract class|enum) (\w+)/gm)) names.add(name)
  for (const [, name] of declarations.matchAll(/^export (?:interface|type) (\w+)/gm)) names.add(name)
  names.delete('default')
  return [...names].sort()
}

/**
 * Declarations' re-exports without their `type` modifiers: a namespace can alias a type only if
 * no module on its way exported it with `export type`, and in declarations the modifier says
 * nothing else.
 */
export function withoutTypeOnlyReexports (source) {
  return source.replace(/^export type \{/gm, 'export {').replace(/^export \{[^}]*\}/gm, (list) => list.replace(/\btype\s+/g, ''))
}

/** Rewrite `outDir`'s index.d.cts (lib/index.ts's declarations) for the CommonJS main entry. */
export function writeRequireDeclarations (outDir) {
  const declarations = readFileSync(join(outDir, 'index.d.cts'), 'utf8')
  const names = exportedNames(declarations)
  if (!names.includes('idempotency')) throw new Error('cjs-main: index.d.cts does not export idempotency')
  writeFileSync(join(outDir, 'exports.d.cts'), declarations)
  writeFileSync(join(outDir, 'index.d.cts'), `/**
 * \`require('fastify-idempotency')\`: the plugin, with every other export as its property.
 *
 * @module fastify-idempotency
 */
import * as exported from './exports.cjs';
/** The plugin, for \`fastify.register(idempotency, options)\`. */
declare function idempotency(...args: Parameters<typeof exported.idempotency>): ReturnType<typeof exported.idempotency>;
declare namespace idempotency {
${names.map((name) => `    export import ${name} = exported.${name};`).join('\n')}
    export { idempotency as default };
}
export = idempotency;
`)
  return names.length
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const dist = resolve(import.meta.dirname, '..', 'dist')
  appendFileSync(join(dist, 'index.cjs'), `
// require('fastify-idempotency') is the plugin, its exports its properties (scripts/cjs-main.mjs).
module.exports = Object.assign(module.exports.idempotency, module.exports);
`)
  console.log("cjs-main: require('fastify-idempotency') is the plugin, with its exports as its properties")
}
