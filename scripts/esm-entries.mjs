/**
 * The package's ES entries (dist/<entry>.js): each re-exports, by name, what its CommonJS module
 * exports, so that `import` and `require()` load the same modules, and the package holds its code
 * once (tsup.config.ts). The names are the entry's ES exports, from the metafile tsup writes
 * (dist/metafile-cjs.json, removed here: it is not for the package); Node.js finds them in the
 * CommonJS module as it finds any CommonJS module's named exports (cjs-module-lexer), and the
 * package test imports every entry.
 *
 * Run after tsup (npm run build).
 */
import { readFileSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'

const root = resolve(import.meta.dirname, '..')
const dist = join(root, 'dist')

/** The package's entries, as dist/ names their files: `index` for `.`, `redis` for `./redis`... */
export function packageEntries () {
  const { exports } = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'))
  return Object.keys(exports).filter((path) => path !== './package.json').map((path) => path === '.' ? 'index' : path.slice(2))
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const metafile = join(dist, 'metafile-cjs.json')
  const { outputs } = JSON.parse(readFileSync(metafile, 'utf8'))
  for (const entry of packageEntries()) {
    const names = outputs[`dist/${entry}.cjs`]?.exports
    if (names === undefined) throw new Error(`esm-entries: tsup built no dist/${entry}.cjs`)
    const named = names.filter((name) => name !== 'default')
    // `default` is module.exports: for the main entry, the plugin (scripts/cjs-main.mjs).
    writeFileSync(join(dist, `${entry}.js`), `export { ${named.join(', ')} } from './${entry}.cjs';\n${names.includes('default') ? `export { default } from './${entry}.cjs';\n` : ''}`)
  }
  rmSync(metafile)
  console.log(`esm-entries: ${packageEntries().join(', ')} re-export their CommonJS modules`)
}
