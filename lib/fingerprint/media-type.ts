/**
 * A `Content-Type` as the fingerprint counts it: two headers that say the same thing count alike,
 * and a multipart body's boundary, which clients choose anew for every attempt (fetch's FormData
 * does), does not count at all.
 *
 * RFC 9110 (8.3.1, 5.6.6): a media type is `type/subtype` and parameters `; name=value`. The type,
 * the subtype and the parameters' names are case-insensitive; whitespace around `;` is not part of
 * it; a value may be a token or a quoted string, which mean the same; the order of the parameters
 * says nothing. So the canonical form is the type lower-cased, then the parameters sorted by name
 * (a stable sort keeps the order of a repeated name's values), each `;name=value` with its name
 * lower-cased and its value unquoted, and written back quoted only when it is not a token:
 *
 *   Multipart/Form-Data; boundary=----x1   ->  multipart/form-data
 *   text/plain; Charset="UTF-8"; format=flowed  ->  text/plain;charset=utf-8;format=flowed
 *
 * `boundary` is left out, whatever the type. `charset` values are lower-cased (charset names are
 * case-insensitive, RFC 2978); every other value is compared as sent: whether it is
 * case-sensitive depends on the parameter, which only the application knows. A parameter without
 * `=` is kept as its name, so that nothing a client sent is silently dropped.
 */

const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/

/** Parameters that never count. */
const LEFT_OUT = new Set(['boundary'])

/** Parameters whose values are case-insensitive. */
const CASELESS = new Set(['charset'])

/** The canonical form of a `Content-Type` header value (see above). */
export function canonicalMediaType (header: string): string {
  const end = header.indexOf(';')
  const type = (end === -1 ? header : header.slice(0, end)).trim().toLowerCase()
  if (end === -1) return type
  const parameters = parseParameters(header, end)
    .filter(([name]) => !LEFT_OUT.has(name))
    .sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
  let canonical = type
  for (const [name, value] of parameters) {
    if (value === null) {
      canonical += `;${name}`
      continue
    }
    const text = CASELESS.has(name) ? value.toLowerCase() : value
    canonical += `;${name}=${TOKEN.test(text) ? text : `"${text.replaceAll('\\', '\\\\').replaceAll('"', '\\"')}"`}`
  }
  return canonical
}

/** The parameters after the `;` at `at`: names lower-cased, values unquoted (`null`: no `=`). */
function parseParameters (header: string, at: number): Array<[string, string | null]> {
  const parameters: Array<[string, string | null]> = []
  let position = at
  while (position < header.length) {
    // At a ';': the next parameter starts after it.
    position++
    const equals = header.indexOf('=', position)
    const semicolon = header.indexOf(';', position)
    if (equals === -1 || (semicolon !== -1 && semicolon < equals)) {
      const stop = semicolon === -1 ? header.length : semicolon
      const name = header.slice(position, stop).trim().toLowerCase()
      if (name !== '') parameters.push([name, null])
      position = stop
      continue
    }
    const name = header.slice(position, equals).trim().toLowerCase()
    const [value, next] = readValue(header, equals + 1)
    parameters.push([name, value])
    position = next
  }
  return parameters
}

/** A parameter's value from `start`, and where the next `;` (or the end) is. */
function readValue (header: string, start: number): [string, number] {
  let position = start
  while (header[position] === ' ' || header[position] === '\t') position++
  if (header[position] !== '"') {
    const semicolon = header.indexOf(';', position)
    const stop = semicolon === -1 ? header.length : semicolon
    return [header.slice(position, stop).trim(), stop]
  }
  // A quoted string: `\` escapes the next character; it ends at the next unescaped `"`.
  let value = ''
  position++
  while (position < header.length && header[position] !== '"') {
    if (header[position] === '\\' && position + 1 < header.length) position++
    value += header[position]
    position++
  }
  const semicolon = header.indexOf(';', position)
  return [value, semicolon === -1 ? header.length : semicolon]
}
