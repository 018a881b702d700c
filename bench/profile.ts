/**
 * Reading a V8 `.cpuprofile` (from `node --cpu-prof`): where the samples fall, by function.
 * Self time says what burns the CPU; inclusive time of the plugin's own functions says which
 * step of its code path costs what.
 */
import { readFileSync } from 'node:fs'
import { relative } from 'node:path'
import { fileURLToPath } from 'node:url'
import { REPO_ROOT } from './processes.js'

interface ProfileNode {
  id: number
  callFrame: { functionName: string, url: string, lineNumber: number }
  hitCount?: number
  children?: number[]
}

interface CpuProfile {
  nodes: ProfileNode[]
  samples?: number[]
  timeDeltas?: number[]
  startTime: number
  endTime: number
}

export interface ProfileLine {
  name: string
  where: string
  selfPercent: number
  totalPercent: number
  selfMicrosPerRequest: number
  totalMicrosPerRequest: number
}

function where (url: string, line: number): string {
  if (url === '') return ''
  let path = url
  if (url.startsWith('file://')) path = relative(REPO_ROOT, fileURLToPath(url))
  path = path.replace(/^node_modules\//, '')
  // tsx compiles TypeScript without keeping line numbers: the file alone says where.
  if (path.endsWith('.ts')) return path
  return `${path}:${line + 1}`
}

/** Samples per node, counting only those stamped within [from, to] (microseconds, V8's monotonic clock). */
function hitsWithin (profile: CpuProfile, from: number, to: number): { hits: Map<number, number>, microsPerSample: number } {
  const hits = new Map<number, number>()
  if (profile.samples === undefined || profile.timeDeltas === undefined) {
    for (const n of profile.nodes) hits.set(n.id, n.hitCount ?? 0)
    const count = profile.nodes.reduce((sum, n) => sum + (n.hitCount ?? 0), 0)
    return { hits, microsPerSample: (profile.endTime - profile.startTime) / Math.max(1, count) }
  }
  let time = profile.startTime
  let first = Infinity
  let last = -Infinity
  let count = 0
  for (let i = 0; i < profile.samples.length; i++) {
    time += profile.timeDeltas[i] ?? 0
    if (time < from || time > to) continue
    const id = profile.samples[i]!
    hits.set(id, (hits.get(id) ?? 0) + 1)
    count++
    if (time < first) first = time
    if (time > last) last = time
  }
  return { hits, microsPerSample: count > 1 ? (last - first) / (count - 1) : 0 }
}

/** What a frame belongs to: a file of the plugin or of the bench, a package, Node's internals, or native code. */
function component (url: string): string {
  if (url === '') return '(native: syscalls, GC, VM)'
  if (url.startsWith('node:')) return 'node: (http, streams, crypto, events…)'
  const path = url.startsWith('file://') ? relative(REPO_ROOT, fileURLToPath(url)) : url
  if (path.startsWith('lib/') || path.startsWith('dist/') || path.startsWith('bench/')) return path
  const match = /node_modules\/((?:@[^/]+\/)?[^/]+)/.exec(path)
  return match?.[1] ?? path
}

export interface ProfileSummary {
  busySamples: number
  requests: number
  cpuMicrosPerRequest: number
  microsPerSample: number
  self: ProfileLine[]
  plugin: ProfileLine[]
  components: Array<{ name: string, selfPercent: number, microsPerRequest: number }>
}

/**
 * `cpuMicrosPerRequest` is the process's own CPU time per request (process.cpuUsage() over the same
 * window): each function's share of the busy samples times that gives its µs per request. (The
 * samples' own spacing would overstate it on a busy machine: a sample waits while the process is
 * descheduled.)
 */
export function summarizeProfile (file: string, from = 0, to = Infinity, requests = 0, cpuMicrosPerRequest = NaN): ProfileSummary {
  const profile = JSON.parse(readFileSync(file, 'utf8')) as CpuProfile
  const { hits, microsPerSample } = hitsWithin(profile, from, to)
  for (const n of profile.nodes) n.hitCount = hits.get(n.id) ?? 0
  const byId = new Map(profile.nodes.map((n) => [n.id, n]))
  const parent = new Map<number, number>()
  for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id)
  const key = (n: ProfileNode): string => `${n.callFrame.functionName || '(anonymous)'}\u0000${where(n.callFrame.url, n.callFrame.lineNumber)}`
  const subtree = new Map<number, number>()
  const total = (id: number): number => {
    const cached = subtree.get(id)
    if (cached !== undefined) return cached
    const n = byId.get(id)!
    let sum = n.hitCount ?? 0
    for (const c of n.children ?? []) sum += total(c)
    subtree.set(id, sum)
    return sum
  }
  const isIdle = (n: ProfileNode): boolean => n.callFrame.functionName === '(idle)'
  const all = profile.nodes.reduce((sum, n) => sum + (n.hitCount ?? 0), 0)
  const idle = profile.nodes.filter(isIdle).reduce((sum, n) => sum + (n.hitCount ?? 0), 0)
  const busy = Math.max(1, all - idle)
  const self = new Map<string, number>()
  const inclusive = new Map<string, number>()
  const components = new Map<string, number>()
  for (const n of profile.nodes) {
    const k = key(n)
    self.set(k, (self.get(k) ?? 0) + (n.hitCount ?? 0))
    if (!isIdle(n)) {
      const c = component(n.callFrame.url)
      components.set(c, (components.get(c) ?? 0) + (n.hitCount ?? 0))
    }
    // Inclusive time counts a function once per stack, not once per recursive frame.
    let ancestor = parent.get(n.id)
    let nested = false
    while (ancestor !== undefined) {
      if (key(byId.get(ancestor)!) === k) { nested = true; break }
      ancestor = parent.get(ancestor)
    }
    if (!nested) inclusive.set(k, (inclusive.get(k) ?? 0) + total(n.id))
  }
  const perRequest = (samples: number): number => (samples / busy) * cpuMicrosPerRequest
  const line = (k: string): ProfileLine => {
    const [name, at] = k.split('\u0000') as [string, string]
    return {
      name,
      where: at,
      selfPercent: (100 * (self.get(k) ?? 0)) / busy,
      totalPercent: (100 * (inclusive.get(k) ?? 0)) / busy,
      selfMicrosPerRequest: perRequest(self.get(k) ?? 0),
      totalMicrosPerRequest: perRequest(inclusive.get(k) ?? 0)
    }
  }
  const keys = [...self.keys()].filter((k) => !k.startsWith('(idle)'))
  return {
    busySamples: busy,
    requests,
    cpuMicrosPerRequest,
    microsPerSample,
    self: keys.sort((a, b) => (self.get(b) ?? 0) - (self.get(a) ?? 0)).slice(0, 30).map(line),
    plugin: keys.filter((k) => k.includes('\u0000lib/') || k.includes('\u0000dist/'))
      .sort((a, b) => (inclusive.get(b) ?? 0) - (inclusive.get(a) ?? 0)).filter((k) => (inclusive.get(k) ?? 0) > 0).slice(0, 30).map(line),
    components: [...components.entries()].sort((a, b) => b[1] - a[1])
      .map(([name, samples]) => ({ name, selfPercent: (100 * samples) / busy, microsPerRequest: perRequest(samples) }))
  }
}

export function formatProfile (title: string, summary: ProfileSummary): string {
  const us = (n: number): string => (Number.isNaN(n) ? '     ' : n.toFixed(1).padStart(5))
  const row = (l: ProfileLine): string =>
    `  ${l.selfPercent.toFixed(1).padStart(5)} %  ${l.totalPercent.toFixed(1).padStart(5)} %  ${us(l.selfMicrosPerRequest)}  ${us(l.totalMicrosPerRequest)}  ${l.name}  ${l.where}`
  return [
    `== ${title}: ${summary.busySamples} busy samples (idle excluded, one per ${summary.microsPerSample.toFixed(0)} µs of wall time), ${summary.requests} requests, ` +
      `${summary.cpuMicrosPerRequest.toFixed(1)} µs of process CPU per request (process.cpuUsage), shared out below by sample counts`,
    '  by component:  self %   µs/req',
    ...summary.components.map((c) => `    ${c.selfPercent.toFixed(1).padStart(5)} %  ${us(c.microsPerRequest)}  ${c.name}`),
    '',
    '   self    total  self µs/req total µs/req  function (top 30 by self time)',
    ...summary.self.map(row),
    '',
    '   self    total  self µs/req total µs/req  plugin functions (lib/), by inclusive time',
    ...summary.plugin.map(row),
    ''
  ].join('\n')
}
