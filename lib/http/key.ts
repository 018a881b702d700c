/**
 * Reading the Idempotency-Key header. Validation happens before the store is touched, so a
 * hostile header can cost nothing but this function.
 */
import { parseItem } from 'structured-headers'
import { IdempotencyKeyInvalidError } from '../errors.js'

/** Visible ASCII (0x21-0x7E), the bare form's alphabet. */
const BARE_KEY = /^[\x21-\x7E]+$/
/** Printable ASCII (0x20-0x7E), the alphabet of an RFC 8941 sf-string once unquoted. */
const STRING_KEY = /^[\x20-\x7E]+$/

/**
 * The key carried by the header value, or `undefined` when the header is absent.
 *
 * Accepts a bare value (`abc-123`, what most clients send) or an RFC 8941 sf-string
 * (`"abc-123"`, what the IETF draft specifies). Throws `IdempotencyKeyInvalidError` for anything
 * else, including a header sent twice: Node joins repeated custom headers with `, `, which no
 * valid bare key contains and which no longer parses as a single sf-string.
 */
export function readIdempotencyKey (value: string | string[] | undefined, headerName: string, maxLength: number): string | undefined {
  if (value === undefined) return undefined
  if (typeof value !== 'string') throw new IdempotencyKeyInvalidError(`The ${headerName} header must be sent once.`)
  if (value.length === 0) throw new IdempotencyKeyInvalidError(`The ${headerName} header is empty.`)
  let key: string
  if (value.charCodeAt(0) === 0x22) {
    key = unquote(value, headerName)
  } else if (BARE_KEY.test(value)) {
    key = value
  } else {
    throw new IdempotencyKeyInvalidError(`The ${headerName} header must be 1 to ${maxLength} visible ASCII characters, or a quoted string, sent once.`)
  }
  if (key.length > maxLength) {
    throw new IdempotencyKeyInvalidError(`The ${headerName} header is longer than ${maxLength} characters.`)
  }
  return key
}

function unquote (value: string, headerName: string): string {
  let item
  try {
    item = parseItem(value)
  } catch {
    throw new IdempotencyKeyInvalidError(`The ${headerName} header is not a valid quoted string.`)
  }
  const key = item[0]
  if (typeof key !== 'string' || !STRING_KEY.test(key)) {
    throw new IdempotencyKeyInvalidError(`The ${headerName} header must be a non-empty quoted string of printable ASCII.`)
  }
  return key
}
