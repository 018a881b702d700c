/**
 * The JSON Schema pieces the option table (table.ts) is written with, and checking options
 * against a schema with a message that names the option and the problem.
 */
import { Ajv, type ErrorObject } from 'ajv'
import type { FingerprintOptions } from '../fingerprint/fingerprint.js'

/** An HTTP token (RFC 9110): a header name. */
const TOKEN = "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
const pointers = { type: 'array', items: { type: 'string', pattern: '^/' } } as const

export const boolean = { type: 'boolean' } as const
/** Milliseconds, or a duration string (parsed by toMilliseconds). */
export const duration = { type: ['integer', 'string'], minimum: 1 } as const
export const statusCodes = { type: 'array', items: { type: 'integer', minimum: 100, maximum: 599 } } as const
export const token = { type: 'string', pattern: TOKEN } as const
export const tokens = { type: 'array', items: token } as const
/** Functions, stores and Buffers: JSON Schema cannot describe them; their field checks them (table.ts). */
export const anything = {} as const

export const fingerprintSchema = {
  type: 'object',
  additionalProperties: false,
  properties: {
    body: {
      anyOf: [
        { type: 'boolean' },
        { const: 'raw' },
        {
          type: 'object',
          additionalProperties: false,
          minProperties: 1,
          maxProperties: 1,
          properties: { include: { ...pointers, minItems: 1 }, exclude: { ...pointers, minItems: 1 } }
        }
      ]
    },
    method: boolean,
    path: boolean,
    query: boolean,
    contentType: boolean,
    headers: tokens
  }
} as const

const ajv = new Ajv({ allErrors: false, strict: true, allowUnionTypes: true })
/** Whether an option set read back from a stored fingerprint is one these options allow. */
export const isFingerprintOptions = ajv.compile<FingerprintOptions>(fingerprintSchema)

/** The most telling error: the deepest one, and of two equally deep, not a mere type mismatch of an anyOf branch. */
function mostSpecific (errors: ErrorObject[]): ErrorObject {
  const depth = (error: ErrorObject) => error.instancePath.split('/').length * 2 + (error.keyword === 'type' ? 0 : 1)
  return errors.filter((error) => error.keyword !== 'anyOf').reduce((best, error) => (depth(error) > depth(best) ? error : best), errors[0]!)
}

function describeError (error: ErrorObject, root: string): string {
  const where = error.instancePath === '' ? root : error.instancePath.slice(1).replaceAll('/', '.')
  if (error.keyword === 'additionalProperties') return `${where} has an unknown property '${String(error.params.additionalProperty)}'`
  return `${where} ${error.message ?? 'is invalid'}`
}

/** The TypeError every bad option throws: `context` says whose options ('options', or a route's config). */
export function invalid (context: string, problem: string): TypeError {
  return new TypeError(`fastify-idempotency: invalid ${context}: ${problem}`)
}

/** A check against `schema` that throws a TypeError naming the first problem; `root` names the whole value. */
export function schemaCheck (schema: object, root: string): (value: unknown, context: string) => void {
  const validate = ajv.compile(schema)
  return (value, context) => {
    if (!validate(value)) throw invalid(context, describeError(mostSpecific(validate.errors!), root))
  }
}
