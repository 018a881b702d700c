/**
 * Fencing tokens: the time the lease was taken, a random prefix per store instance (90 bits) and
 * a counter, unique across processes and cheaper than a UUID each. One fixed length, which
 * RedisStorage's lease layout needs.
 *
 *   '.' <issue time: epoch ms, 9 base-36 digits> <random: 15 base64url> <counter: 11 base-36 digits>
 *
 * The issue time is what lets every store say since when a lease is held (`inspect`,
 * `listInFlight`) without writing anything more on the request path. Tokens of earlier versions
 * (a random prefix and a counter, no '.') are still valid tokens: their leases only have no known
 * start.
 */
import { randomBytes } from 'node:crypto'

/** The length of every token. */
export const TOKEN_LENGTH = 36

/** Marks a token that starts with its issue time; base64url never produces it. */
const DATED = '.'
const TIME_DIGITS = 9
const RANDOM_CHARS = 15
const COUNTER_DIGITS = TOKEN_LENGTH - 1 - TIME_DIGITS - RANDOM_CHARS

/**
 * Every two-digit base-36 string, '00' to 'zz': the last two digits of a number are looked up
 * here, and only the digits before them are formatted, once every 1,296 numbers. Formatting a
 * number in base 36 (`toString(36)`) costs V8 a floating-point division per digit, about 2,000
 * instructions per token for the two fields, each request.
 */
const DIGIT_PAIRS = Array.from({ length: 36 * 36 }, (_, n) => n.toString(36).padStart(2, '0'))

/** `n` (a non-negative integer) in base 36, `digits` long: the digits before the last two come from `head`. */
class Base36Field {
  readonly #headDigits: number
  #headValue = -1
  #head = ''

  constructor (digits: number) {
    this.#headDigits = digits - 2
  }

  format (n: number): string {
    const headValue = Math.floor(n / DIGIT_PAIRS.length)
    if (headValue !== this.#headValue) {
      this.#headValue = headValue
      this.#head = headValue.toString(36).padStart(this.#headDigits, '0')
    }
    return this.#head + DIGIT_PAIRS[n - headValue * DIGIT_PAIRS.length]!
  }
}

export class TokenGenerator {
  readonly #random = randomBytes(12).toString('base64url').slice(0, RANDOM_CHARS)
  readonly #timeField = new Base36Field(TIME_DIGITS)
  readonly #counterField = new Base36Field(COUNTER_DIGITS)
  #count = 0
  /** The last issue time and the token's start for it: requests in the same millisecond share it. */
  #time = NaN
  #prefix = ''

  /** A new token, dated `now` (epoch ms). */
  next (now: number = Date.now()): string {
    if (now !== this.#time) {
      this.#time = now
      this.#prefix = DATED + this.#timeField.format(Math.floor(now)) + this.#random
    }
    return this.#prefix + this.#counterField.format(++this.#count)
  }
}

/** When a token was issued (epoch ms), or `null` for a token that does not say (another store's, an earlier version's). */
export function tokenIssuedAt (token: string | null | undefined): number | null {
  if (typeof token !== 'string' || token.length < 1 + TIME_DIGITS || token[0] !== DATED) return null
  const issued = parseInt(token.slice(1, 1 + TIME_DIGITS), 36)
  return Number.isSafeInteger(issued) ? issued : null
}
