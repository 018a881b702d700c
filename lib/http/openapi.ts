/**
 * Guarded routes describe themselves in OpenAPI when @fastify/swagger is registered: the
 * Idempotency-Key header, the replay header on success responses, and the problem+json answers.
 *
 * Only what the route has not declared itself is added, and schemas are copied, never mutated
 * (an application may share one schema object between routes).
 */
import type { RouteOptions } from 'fastify'
import type { PluginSettings, RouteSettings } from '../options.js'

/** What documenting a route needs to know of its settings. */
type DocumentedSettings = Pick<PluginSettings, 'headerName' | 'maxKeyLength' | 'replayHeader'> & Pick<RouteSettings, 'required' | 'mismatchStatusCode' | 'failOpen' | 'key'>

type Schema = Record<string, unknown>

const problemSchema = {
  type: 'object',
  description: 'RFC 9457 problem details',
  required: ['type', 'title', 'status'],
  properties: {
    type: { type: 'string', description: 'Identifies the problem; a link to its documentation' },
    title: { type: 'string' },
    status: { type: 'integer' },
    detail: { type: 'string' },
    idempotencyKey: { type: 'string' }
  }
}

function problem (description: string): Schema {
  return { description, content: { 'application/problem+json': { schema: problemSchema } } }
}

function isPlainObjectSchema (schema: unknown): schema is Schema {
  return schema !== null && typeof schema === 'object' && !Array.isArray(schema)
}

function withKeyHeader (headers: unknown, settings: DocumentedSettings): unknown {
  const name = settings.headerName
  const property = {
    type: 'string',
    description: `Idempotency key of this operation: 1 to ${settings.maxKeyLength} visible ASCII characters, or an RFC 8941 quoted string. A retry with the same key gets the stored response.`
  }
  const required = settings.required ? [name] : []
  if (headers === undefined) return { type: 'object', properties: { [name]: property }, ...(required.length > 0 ? { required } : {}) }
  // A schema of another shape ($ref, a combinator) is the application's own: leave it alone.
  if (!isPlainObjectSchema(headers) || !isPlainObjectSchema(headers.properties)) return headers
  const properties = headers.properties
  // Declared by the route itself (in any case): its own description wins.
  if (Object.keys(properties).some((declared) => declared.toLowerCase() === name)) return headers
  const existing = Array.isArray(headers.required) ? headers.required as string[] : []
  return { ...headers, properties: { ...properties, [name]: property }, ...(required.length > 0 ? { required: [...existing, ...required] } : {}) }
}

function withResponses (response: unknown, settings: DocumentedSettings): unknown {
  if (response !== undefined && !isPlainObjectSchema(response)) return response
  const responses: Schema = { ...response }
  const replayHeaders = settings.replayHeader === null
    ? null
    : { [settings.replayHeader]: { type: 'string', enum: ['true'], description: 'Present when this is a stored response replayed for a retry' } }
  const successCodes = Object.keys(responses).filter((code) => /^2(\d\d|xx)$/i.test(code))
  if (replayHeaders !== null) {
    for (const code of successCodes) {
      const schema = responses[code]
      if (isPlainObjectSchema(schema)) responses[code] = { ...schema, headers: { ...(schema.headers as Schema | undefined), ...replayHeaders } }
    }
    if (successCodes.length === 0) responses['2xx'] = { description: 'Success', headers: replayHeaders }
  }
  const add = (code: number, description: string) => { if (responses[code] === undefined) responses[code] = problem(description) }
  add(400, 'Idempotency-Key missing or invalid, or the request could not be fingerprinted')
  add(409, settings.mismatchStatusCode === 409
    ? 'Idempotency-Key reused with a different request, or the first request with this key is still in progress (see Retry-After)'
    : 'The first request with this Idempotency-Key is still in progress (see Retry-After)')
  if (settings.mismatchStatusCode === 422) add(422, 'Idempotency-Key reused with a different request')
  if (!settings.failOpen) add(503, 'The idempotency store is unavailable; retry later (see Retry-After)')
  return responses
}

/** Add how the route treats the key header to its schema, for @fastify/swagger to render. */
export function documentRoute (routeOptions: RouteOptions, settings: DocumentedSettings): void {
  const schema: Schema = { ...routeOptions.schema }
  // A route whose key comes from a function of its own (a webhook's event id) reads no key header.
  if (settings.key === null) schema.headers = withKeyHeader(schema.headers, settings)
  schema.response = withResponses(schema.response, settings)
  routeOptions.schema = schema
}
