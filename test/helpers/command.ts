/** The `fastify-idempotency` command as a child process, as its bin runs it (through tsx). */
import { spawn } from 'node:child_process'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'

const root = fileURLToPath(new URL('../..', import.meta.url))

export interface CommandRun { code: number | null, stdout: string, stderr: string }

export async function commandProcess (args: string[], env: Record<string, string>): Promise<CommandRun> {
  const child = spawn(process.execPath, ['--import', 'tsx', join(root, 'lib/cli/main.ts'), ...args], { cwd: root, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  let stdout = ''
  let stderr = ''
  child.stdout.on('data', (chunk: Buffer) => { stdout += chunk.toString() })
  child.stderr.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
  const code = await new Promise<number | null>((resolve) => child.once('close', resolve))
  return { code, stdout, stderr }
}
