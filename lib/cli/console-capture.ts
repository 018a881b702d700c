/**
 * What the store's client library prints to the console while the command runs (ioredis's
 * "Unhandled error event" with its stack, a driver's warnings): held back, reduced to the first
 * line of each distinct message, so that the command can name the true cause of a failure from it
 * and print it once, without stack traces.
 */
import { format } from 'node:util'

const METHODS = ['error', 'warn', 'log', 'info', 'debug'] as const

export class ConsoleCapture {
  readonly lines: string[] = []
  readonly #saved = new Map<(typeof METHODS)[number], (...args: unknown[]) => void>()

  start (): void {
    for (const method of METHODS) {
      this.#saved.set(method, console[method])
      console[method] = (...args: unknown[]) => {
        const line = format(...args).split('\n')[0]!.trim()
        if (line !== '' && !this.lines.includes(line)) this.lines.push(line)
      }
    }
  }

  stop (): void {
    for (const [method, saved] of this.#saved) console[method] = saved
    this.#saved.clear()
  }
}
