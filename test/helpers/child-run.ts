import { spawn, type ChildProcess } from 'node:child_process'

export interface Finished {
  code: number | null
  signal: NodeJS.Signals | null
  stdout: string
  stderr: string
  /** stdout and stderr as they came, interleaved. */
  output: string
  /** Killed at the time limit. */
  timedOut: boolean
}

const running = new Set<ChildProcess>()

/** Runs `command` to its end, or kills it after `limitMs`, with what it wrote. */
export function runChild (command: string, args: string[], options: { cwd: string, env: NodeJS.ProcessEnv, limitMs: number }): Promise<Finished> {
  return new Promise((resolve) => {
    const child = spawn(command, args, { cwd: options.cwd, env: options.env, stdio: ['ignore', 'pipe', 'pipe'] })
    running.add(child)
    let stdout = ''
    let stderr = ''
    let output = ''
    let timedOut = false
    child.stdout.on('data', (chunk: Buffer) => { stdout += chunk.toString(); output += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { stderr += chunk.toString(); output += chunk.toString() })
    const timer = setTimeout(() => { timedOut = true; child.kill('SIGKILL') }, options.limitMs)
    child.once('close', (code, signal) => {
      clearTimeout(timer)
      running.delete(child)
      resolve({ code, signal, stdout, stderr, output, timedOut })
    })
  })
}

/** Kills every child `runChild` started that still runs: for a test file's afterAll. */
export function killChildren (): void {
  for (const child of running) child.kill('SIGKILL')
}
