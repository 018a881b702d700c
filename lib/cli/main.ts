#!/usr/bin/env node
/**
 * `fastify-idempotency`, the command (package.json `bin`): see run.ts, and docs/operations.md.
 * It exits once done, whatever the configuration module left open (a knex pool, a Redis client).
 */
import { format } from 'node:util'
import { runCommand } from './run.js'

const write = async (stream: NodeJS.WriteStream, text: string): Promise<void> => {
  await new Promise<void>((resolve) => { stream.write(text, () => resolve()) })
}
const pending: Array<Promise<void>> = []
// stdout carries the command's output alone (scripts parse it): what libraries print through
// the console (knex's connection errors, a driver's warnings) goes to stderr.
for (const method of ['log', 'info', 'warn', 'debug'] as const) {
  console[method] = (...args: unknown[]) => { pending.push(write(process.stderr, `${format(...args)}\n`)) }
}
// No top-level await: the command is built as CommonJS, sharing the package's chunks.
void runCommand(process.argv.slice(2), {
  stdout: (text) => { pending.push(write(process.stdout, text)) },
  stderr: (text) => { pending.push(write(process.stderr, text)) },
  cwd: process.cwd(),
  env: process.env,
  terminal: process.stderr.isTTY === true
}).then(async (code) => {
  await Promise.all(pending)
  process.exit(code)
})
