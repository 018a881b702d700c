/**
 * Fencing tokens: a random prefix per store instance (128 bits) and a counter, unique across
 * processes and cheaper than a UUID each. Padded to one fixed length, which RedisStorage's lease
 * layout needs.
 */
import { randomBytes } from 'node:crypto'

/** The length of every token. */
export const TOKEN_LENGTH = 36

export class TokenGenerator {
  readonly #prefix = randomBytes(16).toString('base64url')
  #count = 0

  next (): string {
    return this.#prefix + (++this.#count).toString(36).padStart(TOKEN_LENGTH - this.#prefix.length, '0')
  }
}
