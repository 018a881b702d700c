/**
 * The package's type declarations, written by the TypeScript compiler's own command line (`tsc`),
 * so that the build works with whichever TypeScript is installed: 5.x, or 7.x, whose native
 * compiler has no JavaScript API for a bundler to call.
 *
 * They are written once, as the code is: CommonJS (tsup.config.ts). `tsc -p tsconfig.build.json`
 * writes one `.d.ts` per module of lib/ into dist/; each becomes a `.d.cts` (the package is ESM: a
 * `.d.ts` here would declare an ES module), whose relative imports name `.cjs` files. The main
 * entry's declares what `require` gives, the plugin (scripts/cjs-main.mjs). Each ES entry
 * (dist/<entry>.js, scripts/esm-entries.mjs) gets a `.d.ts` of one or two lines that re-exports
 * its CommonJS module's declarations, as its code does.
 *
 *   node scripts/build-types.mjs                          # the project's TypeScript
 *   node scripts/build-types.mjs --typescript typescript7 --out-dir .tmp/types   # another one
 */
import { execFileSync } from 'node:child_process'
import { readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { dirname, join, relative, resolve } from 'node:path'
import { parseArgs } from 'node:util'
import { withoutTypeOnlyReexports, writeRequireDeclarations } from './cjs-main.mjs'
import { packageEntries } from './esm-entries.mjs'

const root = resolve(import.meta.dirname, '..')
const { values } = parseArgs({ options: { typescript: { type: 'string', default: 'typescript' }, 'out-dir': { type: 'string', default: 'dist' } } })
const outDir = resolve(root, values['out-dir'])

/** The package entries whose module is not at the same path under lib/ as its entry in dist/. */
const MOVED = { conformance: 'storage/conformance' }

const tsc = join(dirname(createRequire(join(root, 'package.json')).resolve(`${values.typescript}/package.json`)), 'bin', 'tsc')
execFileSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.build.json'), '--outDir', outDir], { cwd: root, stdio: 'inherit' })

/** `./x.js` -> `./x.cjs` in import and export specifiers, and in `import('./x.js')` types. */
const toCommonJs = (source) => source.replace(/(from\s+|import\()(['"])(\.{1,2}\/[^'"]+)\.js\2/g, '$1$2$3.cjs$2')

let written = 0
const walk = (dir) => {
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name)
    if (entry.isDirectory()) walk(path)
    else if (entry.name.endsWith('.d.ts')) {
      writeFileSync(path.replace(/\.d\.ts$/, '.d.cts'), withoutTypeOnlyReexports(toCommonJs(readFileSync(path, 'utf8'))))
      rmSync(path)
      written++
    }
  }
}
walk(outDir)
for (const [entry, module] of Object.entries(MOVED)) {
  writeFileSync(join(outDir, `${entry}.d.cts`), `export * from './${module}.cjs';\n`)
}
// The CommonJS main entry is the plugin itself (scripts/cjs-main.mjs); its module's declarations
// move to exports.d.cts.
const names = writeRequireDeclarations(outDir)
for (const entry of packageEntries()) {
  const module = entry === 'index' ? 'exports' : entry
  writeFileSync(join(outDir, `${entry}.d.ts`), entry === 'index'
    ? `import idempotency from './index.cjs';\nexport * from './${module}.cjs';\nexport default idempotency;\n`
    : `export * from './${module}.cjs';\n`)
}
console.log(`types: ${written} declaration files (.d.cts) in ${relative(root, outDir) || '.'}, and a .d.ts for each ES entry; index.d.cts declares require()'s plugin with ${names} exports`)
