/**
 * What a store keeps as a request's fingerprint: the digest with the encoding version, the route
 * that took it and the option set it was computed under, so that a deployment with other
 * fingerprint options, or another version of the plugin, compares a retry with a stored entry (or
 * a lease in flight) under the options that entry was made with:
 *
 *   version 3   '3.' <route: 8 characters> '.' <options: JSON of what differs from the defaults> '.' <digest>
 *   version 2   '2.' ... as version 3, its digest computed with the option tag (0.2.0's pre-releases)
 *   version 1   <digest>          fastify-idempotency 0.1.0, which kept neither route nor options
 *
 * where the digest is 43 base64url characters (fingerprint.ts) and the route a hash of the route's
 * URL pattern. Anything else (a later version's record, a damaged one) cannot be read: the request
 * is refused, never compared by guesswork.
 */
import { hash } from 'node:crypto'
import { FINGERPRINT_VERSION, normalizeFingerprint, type FingerprintOptions, type FingerprintSettings } from './fingerprint.js'
import { isFingerprintOptions } from '../options.js'

export type StoredFingerprint =
  | { version: 1, digest: string }
  | { version: 2 | 3, route: string, settings: FingerprintSettings, digest: string }

const DIGEST = /^[\w-]{43}$/
const DIGEST_LENGTH = 43
const ROUTE_LENGTH = 8
const HEAD = `${FINGERPRINT_VERSION}.`
/** Both heads are two characters long. */
const PREVIOUS_HEAD = '2.'

/** A route's tag, and the start of its records under each option set it was fingerprinted with. */
export interface RouteRecords {
  readonly tag: string
  /** By the option set's text: everything a record holds before its digest. */
  readonly heads: Map<string, string>
}

const routes = new Map<string, RouteRecords>()

/** The records of the route whose URL pattern is `url`. */
export function routeRecords (url: string): RouteRecords {
  let records = routes.get(url)
  if (records === undefined) {
    records = { tag: hash('sha256', url, 'base64url').slice(0, ROUTE_LENGTH), heads: new Map() }
    routes.set(url, records)
  }
  return records
}

/** The record's route: a hash of the route's URL pattern (`/orders/:id`), the same in every process. */
export function routeTag (url: string): string {
  return routeRecords(url).tag
}

/**
 * `fingerprintRecord` for a route's requests: the record's start is made once per route and
 * option set, so a request adds only its digest to it (one string, not a chain of five).
 */
export function routeRecord (records: RouteRecords, settings: FingerprintSettings, digest: string): string {
  let head = records.heads.get(settings.options)
  if (head === undefined) {
    head = fingerprintRecord(records.tag, settings, '')
    records.heads.set(settings.options, head)
  }
  return head + digest
}

/** The record of a digest computed under `settings` by the route whose tag is `route`. */
export function fingerprintRecord (route: string, settings: FingerprintSettings, digest: string): string {
  return `${HEAD}${route}.${settings.options}.${digest}`
}

/** Option sets read back from records, by their text: a handful per application. */
const known = new Map<string, FingerprintSettings>()
const MAX_KNOWN = 64

/** The record read back; an Error saying why when it cannot be. */
export function readRecord (record: string): StoredFingerprint | Error {
  if (DIGEST.test(record)) return { version: 1, digest: record }
  const digest = record.slice(-DIGEST_LENGTH)
  const optionsAt = HEAD.length + ROUTE_LENGTH + 1
  const version = record.startsWith(HEAD) ? FINGERPRINT_VERSION : record.startsWith(PREVIOUS_HEAD) ? 2 : null
  if (version === null || record.length < optionsAt + DIGEST_LENGTH + 3 || record[optionsAt - 1] !== '.' ||
    record[record.length - DIGEST_LENGTH - 1] !== '.' || !DIGEST.test(digest)) {
    return new Error('the stored fingerprint is of a format this version of fastify-idempotency does not know (written by a later version, or damaged)')
  }
  const options = record.slice(optionsAt, -DIGEST_LENGTH - 1)
  const settings = known.get(options) ?? readOptions(options)
  if (settings instanceof Error) return settings
  if (known.size >= MAX_KNOWN) known.clear()
  known.set(options, settings)
  return { version, route: record.slice(HEAD.length, optionsAt - 1), settings, digest }
}

function readOptions (text: string): FingerprintSettings | Error {
  let options: unknown
  try {
    options = JSON.parse(text)
  } catch {
    options = undefined
  }
  const settings = isFingerprintOptions(options) ? normalizeFingerprint(options) : null
  // Only the one text this version writes for an option set: anything else was not written by it.
  if (settings === null || settings.options !== text) return new Error('the stored fingerprint names options this version of fastify-idempotency does not know')
  return settings
}

const FLAGS = ['method', 'path', 'query', 'contentType'] as const

/**
 * The option sets a version 1 entry may have been made under, for a route whose options are now
 * `current`: every combination of method, path, query and content type on or off, with the
 * route's headers or none, and its body option, the whole body, or none. The digest covers the
 * option set, so a request that matches an entry under one of them matches it under the set it
 * was made with; a set outside these (other headers, other pointers) is not tried.
 */
export function legacyOptionSets (current: FingerprintSettings): FingerprintSettings[] {
  let sets = candidates.get(current)
  if (sets !== undefined) return sets
  const base = JSON.parse(current.options) as FingerprintOptions
  const bodies = [...new Set([JSON.stringify(base.body ?? true), 'true', 'false'])].map((text) => JSON.parse(text) as FingerprintOptions['body'])
  const headerLists = base.headers === undefined ? [undefined] : [base.headers, undefined]
  sets = []
  // Every combination is another option set: the bodies and header lists are distinct.
  for (let flags = 0; flags < 2 ** FLAGS.length; flags++) {
    for (const body of bodies) {
      for (const headers of headerLists) {
        const options: FingerprintOptions = { body, headers }
        FLAGS.forEach((name, bit) => { options[name] = (flags & (1 << bit)) !== 0 })
        const settings = normalizeFingerprint(options)
        // The route's own set first: the one an upgrade that changed no option meets.
        if (settings.options === current.options) sets.unshift(settings)
        else sets.push(settings)
      }
    }
  }
  candidates.set(current, sets)
  return sets
}

const candidates = new WeakMap<FingerprintSettings, FingerprintSettings[]>()
