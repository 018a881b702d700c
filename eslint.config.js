import neostandard from 'neostandard'

export default [
  ...neostandard({
    ts: true,
    ignores: ['dist/**', 'coverage/**', 'bench/results/**', '.tmp/**', 'docs/api/**']
  }),
  {
    rules: {
      // `void promise` marks a deliberately unawaited promise whose errors are handled inside it.
      'no-void': ['error', { allowAsStatement: true }]
    }
  },
  ...layerRules()
]

/**
 * What each folder of lib/ may import from outside itself: the table of docs/architecture.md,
 * checked. Arrows only point down: the stores import nothing of the plugin; fingerprinting and
 * the engine know nothing of Fastify's request and reply (only the adapter in lib/http/ does),
 * which keeps them testable without a server and lets a second adapter (lib/run/) drive them.
 * Paths are relative to lib/; a folder ends with a slash. The root's files may import anything.
 */
function layerRules () {
  const layers = {
    'storage/': [],
    'fingerprint/': ['storage/error-identity.js', 'options.js'],
    'engine/': ['storage/', 'fingerprint/', 'errors.js', 'options.js', 'encryption.js', 'diagnostics.js'],
    'options/': ['storage/', 'fingerprint/', 'encryption.js', 'http/scope.js', 'http/excluded-headers.js'],
    'http/': ['engine/', 'fingerprint/', 'storage/', 'errors.js', 'options.js', 'diagnostics.js', 'encryption.js'],
    'run/': ['engine/', 'fingerprint/', 'storage/', 'operations/', 'errors.js', 'options.js', 'diagnostics.js', 'encryption.js'],
    'operations/': ['engine/', 'fingerprint/', 'storage/', 'errors.js', 'options.js', 'diagnostics.js', 'http/key.js'],
    'cli/': ['operations/', 'engine/time-limit.js', 'engine/store-proof.js', 'storage/proof.js', 'errors.js', 'options.js']
  }
  const escape = (text) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')
  return Object.entries(layers).flatMap(([folder, allowed]) => [1, 2].map((depth) => {
    // In a file `depth` folders below lib/, what leaves its layer starts with this (within the
    // layer's own subfolders, lib/storage/redis/ importing ../types.js, it does not).
    const up = escape('../'.repeat(depth))
    const permitted = allowed.map((target) => target.endsWith('/') ? escape(target) : `${escape(target)}$`)
    if (depth > 1) permitted.push(escape(folder))
    return {
      files: [`lib/${folder}${'*/'.repeat(depth - 1)}*.ts`],
      rules: {
        'no-restricted-imports': ['error', {
          patterns: [{
            regex: permitted.length === 0 ? `^${up}` : `^${up}(?!${permitted.join('|')})`,
            message: `lib/${folder} may import only ${allowed.length === 0 ? 'from itself' : allowed.map((target) => `lib/${target}`).join(', ')} (docs/architecture.md)`
          }]
        }]
      }
    }
  }))
}
