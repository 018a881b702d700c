/**
 * How guarded routes describe themselves in the OpenAPI document of @fastify/swagger: the
 * Idempotency-Key header, the replay header on success responses, the problem+json answers.
 *
 * They are added by `idempotencyTransform`, given to @fastify/swagger as its `transform`, to the
 * schema the document is made from, and never to the route's own schema, the one Fastify compiles:
 * a response schema added there would serialize the route's own answers with that status (a
 * `2xx` entry taking precedence over the route's `default` sends the fields its schema strips),
 * and plain JSON Schema in a route compiled by a type provider's serializer (zod's) fails the start.
 * @fastify/swagger keeps no way to reach its transform from a route, and a route-level
 * `swaggerTransform` would replace the application's own transform (zod's, which turns the route's
 * zod schemas into JSON Schema): so the plugin's documentation is a transform that wraps the
 * application's, and runs on what it returns.
 *
 * Nothing takes precedence over what the route declares: where a status the plugin answers is
 * covered by the route's own entry (that status, its `4xx`/`5xx` range, or `default`), the problem
 * media type is added beside the route's own; schemas are copied, never changed in place.
 */
import type { FastifySchema, RouteOptions } from 'fastify'
import type { PluginSettings, RouteSettings } from '../options.js'

/** What documenting a route needs to know of its settings. */
export type DocumentedSettings = Pick<PluginSettings, 'headerName' | 'maxKeyLength' | 'replayHeader'> & Pick<RouteSettings, 'required' | 'mismatchStatusCode' | 'failOpen' | 'key'>

/** What @fastify/swagger gives a `transform`: the route's schema and URL, the route, and the document being made. */
export interface TransformInput {
  /** The route's schema, as @fastify/swagger hands it over. */
  schema: FastifySchema
  /** The route's URL. */
  url: string
  /** The route's options, where the plugin finds what it guards. */
  route: RouteOptions
}

/** What a `transform` gives back to @fastify/swagger. */
export interface TransformResult {
  /** The schema to document, with the plugin's header and answers added. */
  schema: FastifySchema
  /** The URL to document the route at. */
  url: string
}

type Schema = Record<string, unknown>

/**
 * Where a guarded route's settings are kept for the transform, on its options (which is what
 * @fastify/swagger hands the transform as `route`). A `Symbol.for` key, so that the transform
 * imported from the CommonJS build reads what the plugin loaded as ESM wrote.
 */
const kDocumented = Symbol.for('fastify-idempotency.openapi')

/** Keep (or, with `null`, forget) how the route is guarded, for the transform. */
export function recordDocumentation (routeOptions: RouteOptions, settings: DocumentedSettings | null): void {
  // Not enumerable: @fastify/swagger copies a route's options for its HEAD twin, which is never guarded.
  Object.defineProperty(routeOptions, kDocumented, { value: settings ?? undefined, configurable: true, writable: true, enumerable: false })
}

/**
 * @fastify/swagger's `transform` that documents guarded routes, on what `transform` (the
 * application's own, such as fastify-type-provider-zod's `jsonSchemaTransform`) returns:
 *
 *   app.register(swagger, { openapi: { ... }, transform: idempotencyTransform() })
 *   app.register(swagger, { openapi: { ... }, transform: idempotencyTransform(jsonSchemaTransform) })
 */
export function idempotencyTransform (): (input: TransformInput) => TransformResult
export function idempotencyTransform<Input extends TransformInput> (transform: (input: Input) => TransformResult): (input: Input) => TransformResult
export function idempotencyTransform (transform?: (input: TransformInput) => TransformResult): (input: TransformInput) => TransformResult {
  return function documentIdempotency (input) {
    const result = transform === undefined ? { schema: input.schema, url: input.url } : transform(input)
    const settings = (input.route as { [kDocumented]?: DocumentedSettings })[kDocumented]
    if (settings === undefined) return result
    return { ...result, schema: documentSchema(result.schema ?? input.schema, settings) as FastifySchema }
  }
}

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

const PROBLEM_TYPE = 'application/problem+json'

function isPlainObject (schema: unknown): schema is Schema {
  return schema !== null && typeof schema === 'object' && !Array.isArray(schema)
}

/** The documented copy of a route's schema (`undefined`: it has none). */
function documentSchema (schema: unknown, settings: DocumentedSettings): Schema {
  const documented: Schema = { ...(isPlainObject(schema) ? schema : {}) }
  // A route whose key comes from a function of its own (a webhook's event id) reads no key header.
  if (settings.key === null) documented.headers = withKeyHeader(documented.headers, settings)
  documented.response = withResponses(documented.response, settings, documented.produces)
  return documented
}

function withKeyHeader (headers: unknown, settings: DocumentedSettings): unknown {
  const name = settings.headerName
  const property = {
    type: 'string',
    description: `Idempotency key of this operation: 1 to ${settings.maxKeyLength} visible ASCII characters, or an RFC 8941 quoted string. A retry with the same key gets the stored response.`
  }
  const required = settings.required ? [name] : []
  const own = { type: 'object', properties: { [name]: property }, ...(required.length > 0 ? { required } : {}) }
  if (headers === undefined) return own
  if (!isPlainObject(headers)) return headers
  const properties = headers.properties
  // A `$ref` to a shared schema, or a combinator without properties of its own: the key beside it.
  if (typeof headers.$ref === 'string' || (properties === undefined && ['allOf', 'anyOf', 'oneOf'].some((word) => word in headers))) return { allOf: [headers, own] }
  if (properties !== undefined && !isPlainObject(properties)) return headers
  // Declared by the route itself (in any case): its own description wins.
  if (Object.keys(properties ?? {}).some((declared) => declared.toLowerCase() === name)) return headers
  const existing = Array.isArray(headers.required) ? headers.required as string[] : []
  return { ...headers, properties: { ...properties, [name]: property }, ...(required.length > 0 ? { required: [...existing, ...required] } : {}) }
}

/** The plugin's answers, by status, with what each says. */
function problems (settings: DocumentedSettings): Array<[status: number, description: string]> {
  const answers: Array<[number, string]> = [[400, 'Idempotency-Key missing or invalid, or the request could not be fingerprinted']]
  answers.push([409, settings.mismatchStatusCode === 409
    ? 'Idempotency-Key reused with a different request, or the first request with this key is still in progress (see Retry-After)'
    : 'The first request with this Idempotency-Key is still in progress (see Retry-After)'])
  if (settings.mismatchStatusCode === 422) answers.push([422, 'Idempotency-Key reused with a different request'])
  if (!settings.failOpen) answers.push([503, 'The idempotency store is unavailable; retry later (see Retry-After)'])
  return answers
}

/** The route's own entry that answers `status`: that status, its range (`4xx`, `4XX`), or `default`. */
function coveringEntry (responses: Schema, status: number): string | undefined {
  const range = `${String(status)[0]}xx`
  return Object.keys(responses).find((code) => code === String(status)) ??
    Object.keys(responses).find((code) => code.toLowerCase() === range) ??
    ('default' in responses ? 'default' : undefined)
}

function withResponses (response: unknown, settings: DocumentedSettings, produces: unknown): unknown {
  if (response !== undefined && !isPlainObject(response)) return response
  const responses: Schema = { ...response }
  if (settings.replayHeader !== null) {
    const replayHeaders = { [settings.replayHeader]: { type: 'string', enum: ['true'], description: 'Present when this is a stored response replayed for a retry' } }
    const success = Object.keys(responses).filter((code) => /^2(\d\d|xx)$/i.test(code))
    // Without a success entry of its own, the route's `default` describes its successes: a `2XX` added beside it would take precedence.
    const targets = success.length > 0 ? success : 'default' in responses ? ['default'] : []
    for (const code of targets) {
      const entry = responses[code]
      if (isPlainObject(entry)) responses[code] = { ...entry, headers: { ...(entry.headers as Schema | undefined), ...replayHeaders } }
    }
    if (targets.length === 0) responses['2xx'] = { description: 'Success', headers: replayHeaders }
  }
  // The plugin's answers that a route's entry covers are grouped by that entry, and added to it once.
  const merged = new Map<string, string[]>()
  for (const [status, description] of problems(settings)) {
    const covering = coveringEntry(responses, status)
    if (covering === undefined) responses[status] = { description, content: { [PROBLEM_TYPE]: { schema: problemSchema } } }
    else merged.set(covering, [...(merged.get(covering) ?? []), `${status}: ${description}`])
  }
  for (const [code, descriptions] of merged) responses[code] = withProblem(responses[code], descriptions.join('; '), produces)
  return responses
}

/**
 * The route's own entry, with the problem media type beside its own. An entry given as a JSON
 * Schema is written in the content form @fastify/swagger also reads (the same media types,
 * description and headers as it would have rendered), so that the two can stand side by side.
 */
function withProblem (entry: unknown, description: string, produces: unknown): unknown {
  if (!isPlainObject(entry)) return entry
  const problem = { schema: { ...problemSchema, description: `RFC 9457 problem details of this plugin's answers (${description})` } }
  if (isPlainObject(entry.content)) {
    if (PROBLEM_TYPE in entry.content) return entry
    return { ...entry, content: { ...entry.content, [PROBLEM_TYPE]: problem } }
  }
  const { headers, ...schema } = entry
  const types = Array.isArray(produces) && produces.length > 0 ? produces as string[] : ['application/json']
  const content: Schema = schema.type === 'null' ? {} : Object.fromEntries(types.map((type) => [type, { schema }]))
  const documented: Schema = { description: schema['x-response-description'] ?? schema.description ?? 'Default Response', content: { ...content, [PROBLEM_TYPE]: problem } }
  if (headers !== undefined) documented.headers = headers
  return documented
}
