/**
 * Scopes: who a request's key belongs to. A scope namespaces keys by caller, so one caller can
 * never receive another's stored response; it ends up in the store as part of the key, so it must
 * not be a secret in clear: a bearer token or an API key used as a scope would sit in Redis key
 * names and SQL rows.
 */
import { hash } from 'node:crypto'
import type { FastifyRequest } from 'fastify'
import { NO_CALLER_SCOPE, RUN_SCOPE } from '../engine/storage-key.js'
import { IdempotencyScopeError } from '../errors.js'

/**
 * A scope: the caller's id (a non-empty string), or `undefined` / `null` for a request with no
 * caller. Runs in `preHandler`, after the application's authentication hooks.
 */
export type Scope = (request: FastifyRequest) => string | null | undefined | Promise<string | null | undefined>

/**
 * Scope keys by a request header: its SHA-256, never its value. That is one scope per credential,
 * not per caller: a client that refreshes its token and retries gets a new scope, and runs again.
 * Prefer the signed-in principal (`scope: (request) => request.user?.id`); this suits credentials
 * that never change for a caller, such as a long-lived API key. A request without the header has
 * no caller (see `resolveScope`).
 *
 *   await app.register(idempotency, { scope: scopeByHeader('x-api-key') })
 */
export function scopeByHeader (name: string): (request: FastifyRequest) => string | undefined {
  if (typeof name !== 'string' || name.length === 0) throw new TypeError('fastify-idempotency: scopeByHeader needs a header name')
  const header = name.toLowerCase()
  return (request) => {
    const value = request.headers[header]
    if (value === undefined) return undefined
    // A header sent twice is one value per line: two lines never equal one.
    return `sha256:${hash('sha256', Array.isArray(value) ? value.join('\n') : value, 'base64url')}`
  }
}

/** The credentials a request carries, as named in messages ('' when none). */
function credentialsOf (request: FastifyRequest): string {
  const { authorization, cookie } = request.headers
  return authorization === undefined ? cookie === undefined ? '' : 'Cookie' : cookie === undefined ? 'Authorization' : 'Authorization, Cookie'
}

export function hasCredentials (request: FastifyRequest): boolean {
  return credentialsOf(request) !== ''
}

function describe (value: unknown): string {
  if (value === '') return 'an empty string'
  const type = value === null ? 'null' : typeof value
  return `${/^[aeiou]/.test(type) ? 'an' : 'a'} ${type}`
}

/**
 * The request's scope. A request with no caller shares the namespace of callers without one
 * (`NO_CALLER_SCOPE`, which no value a scope returns can equal: an empty one is refused below),
 * unless it carries credentials: then its scope failed to read them (a cookie-authenticated caller
 * on a route scoped by the Authorization header, a token the authentication hook did not accept),
 * and sharing would hand it another caller's response: refused with 500 #scope-unresolved, logged
 * with the route. So is a value that is not a caller's id. An error the scope throws is the app's
 * own, and passes on as from any hook.
 */
export async function resolveScope (scope: Scope, request: FastifyRequest, key: string, route: string): Promise<string> {
  const value: unknown = await scope(request)
  if (typeof value === 'string' && value !== '' && !value.startsWith(RUN_SCOPE)) return value
  let problem
  if (typeof value === 'string' && value !== '') {
    problem = `returned a scope that starts with "${RUN_SCOPE}", the namespace of the keys of run() (jobs, messages), which no request may reach`
  } else if (value === undefined || value === null) {
    const credentials = credentialsOf(request)
    if (credentials === '') return NO_CALLER_SCOPE
    problem = `found no caller in a request that carries credentials (${credentials}): sharing the namespace of callers without one would hand it another caller's response. Scope by the signed-in principal, read after your authentication hook (scope: (request) => request.user?.id), and make sure that hook refuses credentials it does not accept`
  } else {
    problem = `returned ${describe(value)}: a scope returns the caller's id as a non-empty string, or undefined for a request with no caller`
  }
  const error = new IdempotencyScopeError(key)
  request.log.error({ idempotencyKey: key }, `fastify-idempotency: scope of route ${route} ${problem}; the request was refused (500 #scope-unresolved)`)
  throw error
}
