import neostandard from 'neostandard'

export default [
  ...neostandard({
    ts: true,
    ignores: ['dist/**', 'coverage/**', 'bench/results/**', '.tmp/**']
  }),
  {
    rules: {
      // `void promise` marks a deliberately unawaited promise whose errors are handled inside it.
      'no-void': ['error', { allowAsStatement: true }]
    }
  },
  {
    // The engine, the stores and fingerprinting know nothing of Fastify's request and reply: only
    // the adapter in lib/http/ does. Keeping them out of it keeps them testable without a server
    // and keeps one place where HTTP turns into the engine's inputs (docs/architecture.md).
    files: ['lib/engine/**', 'lib/storage/**', 'lib/fingerprint/**'],
    rules: {
      'no-restricted-imports': ['error', {
        patterns: [{ group: ['**/http/*', '**/http/**'], message: 'lib/engine, lib/storage and lib/fingerprint must not import the Fastify adapter (lib/http/).' }]
      }]
    }
  }
]
