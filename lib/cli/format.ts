/**
 * What the command prints: a short table for people, or JSON for scripts (a stored body, when
 * asked for, as base64 in JSON; as text for people when it is UTF-8).
 */
import { isUtf8 } from 'node:buffer'
import type { StoreProof } from '../engine/store-proof.js'
import { NO_CALLER_SCOPE, type ForgetResult, type HeldKey, type InFlightListing, type Inspection } from '../operations/index.js'

/** `1h 2m`, `3m 4s`, `5.2s`, `120ms`: the two largest units. */
export function span (ms: number): string {
  const abs = Math.abs(ms)
  if (abs < 1000) return `${Math.round(abs)}ms`
  if (abs < 60_000) return `${(abs / 1000).toFixed(1)}s`
  const units: Array<[string, number]> = [['d', 86_400_000], ['h', 3_600_000], ['m', 60_000], ['s', 1000]]
  const parts: string[] = []
  let rest = abs
  for (const [unit, size] of units) {
    if (rest >= size || parts.length > 0) parts.push(`${Math.floor(rest / size)}${unit}`)
    rest %= size
    if (parts.length === 2) break
  }
  return parts.join(' ')
}

function at (ms: number | null, now: number): string {
  if (ms === null) return 'unknown'
  return `${new Date(ms).toISOString()} (${ms <= now ? `${span(now - ms)} ago` : `in ${span(ms - now)}`})`
}

/** A key for a terminal: JSON quoting shows a NUL, a line feed or a trailing space. */
/** A scope as typed, or what stands for the requests without a caller. */
function scopeShown (scope: string): string {
  return scope === NO_CALLER_SCOPE ? '(no caller)' : shown(scope)
}

function shown (text: string): string {
  return /^[\x21-\x7e]+$/.test(text) ? text : JSON.stringify(text)
}

function table (rows: Array<[string, string]>): string {
  const width = Math.max(...rows.map(([label]) => label.length))
  return rows.map(([label, value]) => `${label.padEnd(width)}  ${value}`).join('\n') + '\n'
}

export function inspection (result: Inspection, now: number): string {
  const rows: Array<[string, string]> = [['key', shown(result.key)]]
  if (result.scope !== null) rows.push(['scope', scopeShown(result.scope)])
  if (result.state === 'absent') return table([...rows, ['state', 'absent: nothing is held under this key']])
  if (result.state === 'in-flight') {
    rows.push(['state', 'in flight: a request holds the key'], ['since', at(result.since, now)], ['lease ends', at(result.lockExpiresAt, now)])
  } else {
    rows.push(['state', 'stored'], ['status', String(result.statusCode)], ['stored at', at(result.storedAt, now)], ['expires at', at(result.expiresAt, now)])
    if (result.unreadable !== undefined) rows.push(['sealed', `cannot be opened: ${result.unreadable}`])
    else {
      rows.push(['content type', result.contentType ?? '(none)'])
      rows.push(['body', result.bodyOmitted === true ? 'omitted: the handler answered, its body was not kept' : `${result.bodyBytes} bytes`])
    }
  }
  rows.push(['fingerprint', result.fingerprint])
  if (result.fingerprintOptions !== null) rows.push(['fingerprinted', JSON.stringify(result.fingerprintOptions)])
  let text = table(rows)
  if (result.state === 'stored' && result.body !== undefined) {
    text += isUtf8(result.body) ? `\n${result.body.toString('utf8')}\n` : `\nbody (base64): ${result.body.toString('base64')}\n`
  }
  return text
}

export function forgotten (result: ForgetResult, now: number): string {
  const subject = `key ${JSON.stringify(result.key)}${result.scope === null ? '' : result.scope === NO_CALLER_SCOPE ? ' (no caller)' : ` (scope ${JSON.stringify(result.scope)})`}`
  if (result.outcome === 'refused') {
    return `refused: ${subject} is in flight, its lease ends ${at(result.lockExpiresAt, now)}. ` +
      '--force removes it: the running request then stores nothing, and a retry may run beside it.\n'
  }
  const records = `${result.recoveryPoints} recovery-point record${result.recoveryPoints === 1 ? '' : 's'} removed`
  if (result.previous === 'absent' && result.recoveryPoints === 0) return `nothing to forget: nothing is held under ${subject}\n`
  return `forgotten: ${subject} (it was ${result.previous === 'absent' ? 'absent' : result.previous === 'stored' ? 'stored' : 'in flight'}; ${records}). The next request with it runs afresh.\n`
}

function keyOf (lease: HeldKey): string {
  return lease.key === null ? `${shown(lease.storageKey)} (hashed)` : shown(lease.key)
}

export function inFlight (result: InFlightListing, now: number): string {
  const more = result.complete ? '' : ' (there may be more: see --limit, and for Redis the scan bound in docs/operations.md)'
  if (result.leases.length === 0) return `no keys in flight${more}\n`
  const rows = [['KEY', 'SCOPE', 'HELD', 'SINCE', 'LEASE ENDS'], ...result.leases.map((lease) => [
    keyOf(lease),
    lease.scope === null ? '-' : scopeShown(lease.scope),
    lease.heldMs === null ? 'unknown' : span(lease.heldMs),
    lease.since === null ? 'unknown' : new Date(lease.since).toISOString(),
    `in ${span(lease.lockExpiresAt - now)}`
  ])]
  const widths = rows[0]!.map((_, column) => Math.max(...rows.map((row) => row[column]!.length)))
  const lines = rows.map((row) => row.map((cell, column) => column === row.length - 1 ? cell : cell.padEnd(widths[column]!)).join('  '))
  return `${lines.join('\n')}\n${result.leases.length} key${result.leases.length === 1 ? '' : 's'} in flight${more}\n`
}

const OUTCOMES = { passed: 'ok', failed: 'FAILED', warning: 'warning' } as const

/** `doctor`: each check of the store's start-up proof, what it found, the cure; then the verdict. */
export function proofReport ({ store, checks }: StoreProof): string {
  if (checks.length === 0) return `${store} has no start-up check (neither prove() nor ready()): nothing to prove\n`
  const width = Math.max(...checks.map((check) => check.name.length))
  const indent = ' '.repeat(width + 12)
  const lines = checks.map(({ name, outcome, found, cure }) =>
    `${OUTCOMES[outcome].padEnd(8)}  ${name.padEnd(width)}  ${found}${cure === undefined ? '' : `\n${indent}cure: ${cure}`}`)
  const failed = checks.filter((check) => check.outcome === 'failed').length
  const warned = checks.filter((check) => check.outcome === 'warning').length
  const counts = `${failed} failed, ${warned} warning${warned === 1 ? '' : 's'}, ${checks.length - failed - warned} passed`
  const verdict = failed > 0
    ? `${store} cannot keep the plugin's promise (${counts}): an app on it does not start (checkStore)`
    : `${store} can work (${counts})${warned > 0 ? ': an app on it starts, and logs each warning' : ''}`
  return `${store}: start-up proof\n${lines.join('\n')}\n${verdict}\n`
}

/** JSON for scripts: a body as base64. */
export function json (value: unknown): string {
  return JSON.stringify(value, (name, item: unknown) => {
    if (name === 'body' && (item as { type?: unknown })?.type === 'Buffer') return Buffer.from((item as { data: number[] }).data).toString('base64')
    return item
  }, 2) + '\n'
}
