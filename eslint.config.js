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
  }
]
