/**
 * The package's type declarations, written by the TypeScript compiler's own command line (`tsc`),
 * so that the build works with whichever TypeScript is installed: 5.x, or 7.x, whose native
 * compiler has no JavaScript API for a bundler to call. `tsc -p tsconfig.build.json` writes one
 * `.d.ts` per module of lib/ into dist/; each gets a `.d.cts` twin, whose relative imports name
 * `.cjs` files, for `require` (the package is ESM: a `.d.ts` here declares an ES module); the main
 * entry's twin declares what `require` gives, the plugin (scripts/cjs-main.mjs).
 *
 *   node scripts/build-types.mjs                          # the project's TypeScript
 *   node scripts/build-types.mjs --typescript typescript7 --out-dir .tmp/types   # another one
 */
import { execFileSync } from 'node:child_process'
import { mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { dirname, join, relative, resolve } from 'node:path'
import { parseArgs } from 'node:util'
import { withoutTypeOnlyReexports, writeRequireDeclarations } from './cjs-main.mjs'

const root = resolve(import.meta.dirname, '..')
const { values } = parseArgs({ options: { typescript: { type: 'string', default: 'typescript' }, 'out-dir': { type: 'string', default: 'dist' } } })
const outDir = resolve(root, values['out-dir'])

/** The package entries whose module is not at the same path under lib/ as its entry in dist/. */
const ENTRIES = { conformance: 'storage/conformance' }

const tsc = join(dirname(createRequire(join(root, 'package.json')).resolve(`${values.typescript}/package.json`)), 'bin', 'tsc')
execFileSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.build.json'), '--outDir', outDir], { cwd: root, stdio: 'inherit' })

for (const [entry, module] of Object.entries(ENTRIES)) {
  writeFileSync(join(outDir, `${entry}.d.ts`), `export * from './${module}.js'\n`)
}

/** `./x.js` -> `./x.cjs` in import and export specifiers, and in `import('./x.js')` types. */
const toCommonJs = (source) => source.replace(/(from\s+|import\()(['"])(\.{1,2}\/[^'"]+)\.js\2/g, '$1$2$3.cjs$2')

let written = 0
const walk = (dir) => {
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name)
    if (entry.isDirectory()) walk(path)
    else if (entry.name.endsWith('.d.ts')) {
      const twin = path.replace(/\.d\.ts$/, '.d.cts')
      mkdirSync(dirname(twin), { recursive: true })
      writeFileSync(twin, withoutTypeOnlyReexports(toCommonJs(readFileSync(path, 'utf8'))))
      written++
    }
  }
}
walk(outDir)
// The CommonJS main entry is the plugin itself (scripts/cjs-main.mjs).
const names = writeRequireDeclarations(outDir)
console.log(`types: ${written} declaration files and their .d.cts twins in ${relative(root, outDir) || '.'}; index.d.cts declares require()'s plugin with ${names} exports`)
