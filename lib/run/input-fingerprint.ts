/**
 * The fingerprint of a function's input, made as a request body's is: the input's canonical value
 * (RFC 8785's order and form for plain data; BigInt, Date, Map, Set, bytes and cycles each written
 * apart), under the default fingerprint options, recorded as a route of its own, `run()`. Two
 * inputs that hold the same data, members in any order, are the same operation.
 */
import type { FastifyRequest } from 'fastify'
import type { FingerprintComparison } from '../engine/fingerprint-check.js'
import { IdempotencyFingerprintError, IdempotencyFingerprintUnsupportedError } from '../errors.js'
import { BodyNestedTooDeeplyError, FingerprintValueError } from '../fingerprint/canonical-value.js'
import { bodyPart, fingerprintDigest, FINGERPRINT_VERSION, normalizeFingerprint } from '../fingerprint/fingerprint.js'
import { fingerprintRecord, readRecord, routeTag } from '../fingerprint/record.js'

/** What `run` names itself in fingerprints, events and errors. */
export const RUN_ROUTE = 'run()'

const SETTINGS = normalizeFingerprint({})
const ROUTE = routeTag(RUN_ROUTE)
/** With the default options, a fingerprint reads nothing of the request but its body. */
const NO_REQUEST = { method: 'RUN', url: '', headers: {} } as unknown as FastifyRequest

/** The record of `input`'s fingerprint; an IdempotencyError when it has no canonical form. */
export function inputFingerprint (key: string, input: unknown): string {
  try {
    // Read as a JSON body: a string counts by its value, a Buffer by its bytes.
    return fingerprintRecord(ROUTE, SETTINGS, fingerprintDigest(NO_REQUEST, SETTINGS, bodyPart(input, 'application/json', SETTINGS)))
  } catch (error) {
    if (error instanceof BodyNestedTooDeeplyError) throw new IdempotencyFingerprintError(key, error)
    const located = error instanceof FingerprintValueError
    throw new IdempotencyFingerprintUnsupportedError(key, RUN_ROUTE, located ? error.path : '', located ? error.message.replace('the body', 'the input') : `fingerprinting it threw ${String(error)}`, error)
  }
}

/**
 * How a job's input compares with a record a request made, for a run that shares its keys with
 * requests (`sharedWithRequests`): the record names another route, so it never equals the job's
 * as text. A request fingerprinted under the default options counted its body alone, as a job's
 * input is counted: the digests tell, whichever route made it. A record under other options
 * counted parts of a request (its method, path, headers) that a job does not have: another
 * operation.
 */
export function inputComparison (record: string): FingerprintComparison {
  return {
    compare: (stored) => {
      const read = readRecord(stored)
      if (read instanceof Error) return read
      if (read.version !== FINGERPRINT_VERSION || read.settings.options !== SETTINGS.options) return 'different'
      return record.endsWith(read.digest) ? 'same' : 'different'
    }
  }
}
