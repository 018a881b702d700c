/**
 * A request's fingerprint as the hooks take it, and its comparison with what a store holds.
 *
 * The body counts as it arrived: it is taken in preValidation, before the route's preHandler
 * hooks can change it and before validation coerces it, fills in defaults, strips members or
 * (with a type provider such as fastify-type-provider-zod) transforms it into values JSON cannot
 * hold. Two requests with the
 * same body are the same request whatever the schema makes of them, and a transform that is not
 * deterministic (a default of `new Date()`) cannot turn a retry into a mismatch.
 *
 * A stored fingerprint that differs as text is not yet a mismatch: it may have been made by the
 * same route under another option set (a deployment that changed `fingerprint`) or by 0.1.0. The
 * request is then fingerprinted again under that set (fingerprint-record.ts), and only a
 * difference under it is. An entry another route made stays a mismatch when the options differ,
 * as the key was reused for another operation.
 */
import type { FastifyRequest } from 'fastify'
import { BodyNestedTooDeeplyError, FingerprintValueError } from '../fingerprint/canonical-value.js'
import { IdempotencyFingerprintError, IdempotencyFingerprintUnsupportedError, type IdempotencyError } from '../errors.js'
import type { FingerprintVerdict } from '../engine/fingerprint-check.js'
import { bodyPart, fingerprintDigest, FINGERPRINT_VERSION, rawBodyPart, type ArrivedBody, type BodyPart, type FingerprintSettings } from '../fingerprint/fingerprint.js'
import { legacyOptionSets, readRecord, routeRecord, routeRecords } from '../fingerprint/record.js'
import { isStreamBody, unparsedBody, type RawBodyHash } from './raw-body.js'

/**
 * In preValidation: the body before validation changes it. A stream's bytes are read in
 * preHandler, which may wait for them. Throws the refusal when it cannot be fingerprinted.
 */
export function takeArrivedBody (request: FastifyRequest, settings: FingerprintSettings, key: string, url: string): ArrivedBody {
  const value = request.body
  try {
    const counted = settings.body && !settings.raw && !isStreamBody(value)
    return { part: counted ? bodyPart(value, request.headers['content-type'], settings) : null, value }
  } catch (error) {
    throw fingerprintFailure(error, key, request, url)
  }
}

/** In preHandler: the hash to take of a body no parser made a value of (see raw-body.ts), or `null`. */
export function unparsedBodyHash (request: FastifyRequest, key: string, url: string): RawBodyHash | null {
  try {
    return unparsedBody(request)
  } catch (error) {
    throw fingerprintFailure(error, key, request, url)
  }
}

/** In preHandler: the request's fingerprint (its record, and its comparison with a stored one), with the body `context` took in preValidation. */
export function takeFingerprint (request: FastifyRequest, settings: FingerprintSettings, context: { readonly key: string, readonly arrivedBody?: ArrivedBody | null }, rawHash: string | undefined, url: string): Fingerprinted {
  try {
    return fingerprintRequest(request, url, settings, context.arrivedBody ?? null, rawHash)
  } catch (error) {
    throw fingerprintFailure(error, context.key, request, url)
  }
}

/**
 * The fingerprint record of a request to the route `url` under `settings`, and the comparison of
 * a stored one with it. `arrived` is what preValidation took (`null` when it took none: the
 * body is as it arrived); `rawHash` the hash of a body counted by its bytes.
 */
export function fingerprintRequest (request: FastifyRequest, url: string, settings: FingerprintSettings, arrived: ArrivedBody | null, rawHash: string | undefined): Fingerprinted {
  const value = arrived === null ? request.body : arrived.value
  const part = !settings.body
    ? null
    : rawHash !== undefined ? rawBodyPart(rawHash) : arrived?.part ?? bodyPart(value, request.headers['content-type'], settings)
  const records = routeRecords(url)
  return new Fingerprinted(routeRecord(records, settings, fingerprintDigest(request, settings, part)), request, records.tag, settings, part, value, rawHash)
}

/** A request's fingerprint, and what it takes to fingerprint the request again under other options. */
export class Fingerprinted {
  constructor (
    readonly record: string,
    readonly request: FastifyRequest,
    /** The route's tag in a record. */
    readonly route: string,
    readonly settings: FingerprintSettings,
    /** The body's part under `settings`. */
    readonly part: BodyPart | null,
    /** The body as it arrived. */
    readonly value: unknown,
    readonly rawHash: string | undefined
  ) {}

  /** How a stored record that differs from `record` as text compares with this request. */
  compare (stored: string): FingerprintVerdict {
    const read = readRecord(stored)
    if (read instanceof Error) return read
    if (read.version === 1) return compareLegacy(read.digest, this)
    const sameOptions = read.settings.options === this.settings.options
    // Under the same options and version the digests tell, whichever route made the entry (the same
    // key and body on another route are the same request unless the options include the path).
    if (sameOptions && read.version === FINGERPRINT_VERSION) return read.digest === this.record.slice(-read.digest.length) ? 'same' : 'different'
    // Another route's entry under other options is another operation's: the key was reused across routes.
    if (!sameOptions && read.route !== this.route) return 'different'
    try {
      return fingerprintDigest(this.request, read.settings, partUnder(read.settings, this), read.version) === read.digest ? 'same' : 'different'
    } catch (error) {
      return new Error('the request cannot be fingerprinted under the options the stored fingerprint was made with', { cause: error })
    }
  }
}

/** The body's part under another option set. */
function partUnder (settings: FingerprintSettings, { settings: current, part, value, rawHash, request }: Fingerprinted): BodyPart | null {
  if (!settings.body) return null
  if (settings.raw || part?.[0] === 'R') {
    // A body the route counts by its bytes has no value to select from; a raw hash that was not taken cannot be had now.
    if (rawHash === undefined) throw new Error('the stored fingerprint counts the body by its raw bytes (body: \'raw\'), which this route does not read')
    return rawBodyPart(rawHash)
  }
  if (part !== null && sameSelection(settings, current)) return part
  return bodyPart(value, request.headers['content-type'], settings)
}

function sameSelection (a: FingerprintSettings, b: FingerprintSettings): boolean {
  return selectionOf(a) === selectionOf(b)
}

/** The members a body part is made of, as text: two option sets with the same selection share their body part. */
function selectionOf (settings: FingerprintSettings): string {
  return JSON.stringify([settings.include, settings.exclude])
}

/**
 * A version 1 record carries no option set: the request is fingerprinted as 0.1.0 did (the body
 * as validation left it, version 1's encoding) under each option set it may have been made with.
 */
function compareLegacy (digest: string, { request, settings: current, rawHash }: Fingerprinted): FingerprintVerdict {
  const contentType = request.headers['content-type']
  let incomparable: Error | null = null
  // One body part per member selection, whichever other parts the set includes.
  const parts = new Map<string, BodyPart>()
  const partOf = (settings: FingerprintSettings): BodyPart => {
    // A route whose body counts by its bytes has a raw hash, and version 1 used it for every set with a body.
    if (rawHash !== undefined) return rawBodyPart(rawHash)
    const selection = selectionOf(settings)
    let part = parts.get(selection)
    if (part === undefined) parts.set(selection, part = bodyPart(request.body, contentType, settings, true))
    return part
  }
  for (const settings of legacyOptionSets(current)) {
    try {
      if (fingerprintDigest(request, settings, settings.body ? partOf(settings) : null, 1) === digest) return 'same'
    } catch (error) {
      incomparable ??= new Error('the entry was stored by fastify-idempotency 0.1.0, whose fingerprint could not tell this body from others (a Set, a Map, an empty selection)', { cause: error })
    }
  }
  return incomparable ?? 'different'
}

/**
 * The refusal for a body that could not be fingerprinted: 400 for one nested too deeply (the
 * client's), otherwise 500 naming the route and where in the body (the server's own parser, hook
 * or schema made it), logged at `error` level so the developer can find it.
 */
function fingerprintFailure (error: unknown, key: string, request: FastifyRequest, url: string): IdempotencyError {
  if (error instanceof BodyNestedTooDeeplyError) return new IdempotencyFingerprintError(key, error)
  const located = error instanceof FingerprintValueError
  const failure = new IdempotencyFingerprintUnsupportedError(key, `${request.method} ${url}`, located ? error.path : '', located ? error.message : `fingerprinting it threw ${String(error)}`, error)
  request.log.error({ err: failure }, `fastify-idempotency: ${failure.message}`)
  return failure
}
