/**
 * Ready-made scopes. A scope namespaces keys by principal, so one caller can never receive
 * another's stored response; it ends up in the store as part of the key, so it must not be a
 * secret in clear: a bearer token or an API key used as a scope would sit in Redis key names and
 * SQL rows.
 */
import { hash } from 'node:crypto'
import type { FastifyRequest } from 'fastify'

/** The scope of requests without the header: one shared namespace, unlike any hashed value. */
const WITHOUT_HEADER = 'none'

/**
 * Scope keys by a request header that identifies the caller (`authorization`, `x-api-key`): its
 * SHA-256, never its value. Requests without the header share one scope.
 *
 *   await app.register(idempotency, { scope: scopeByHeader('authorization') })
 */
export function scopeByHeader (name: string): (request: FastifyRequest) => string {
  if (typeof name !== 'string' || name.length === 0) throw new TypeError('fastify-idempotency: scopeByHeader needs a header name')
  const header = name.toLowerCase()
  return (request) => {
    const value = request.headers[header]
    if (value === undefined) return WITHOUT_HEADER
    // A header sent twice is one value per line: two lines never equal one.
    return `sha256:${hash('sha256', Array.isArray(value) ? value.join('\n') : value, 'base64url')}`
  }
}
