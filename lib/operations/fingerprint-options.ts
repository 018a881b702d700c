/**
 * The option set a stored fingerprint was computed with, as an operator reads it: what its record
 * names (fingerprint-record.ts), written as the FingerprintOptions that differ from the defaults.
 * `null` for a record that names none (one written by 0.1.0) or cannot be read.
 */
import { readRecord } from '../fingerprint/record.js'
import type { FingerprintOptions } from '../fingerprint/fingerprint.js'

export function fingerprintOptionsOf (fingerprint: string): FingerprintOptions | null {
  const record = readRecord(fingerprint)
  if (record instanceof Error || record.version === 1) return null
  return JSON.parse(record.settings.options) as FingerprintOptions
}
