/**
 * Reading a callgrind dump (bench/instructions.ts): the total instructions, and the part of them
 * spent in JIT compilation, in major GC and in minor GC, attributed by function name.
 *
 * The rule. A function belongs to a category when its (demangled) name matches the category's
 * pattern (CATEGORIES below). Every other function takes a share of each category equal to the
 * share of its inclusive cost that its callers in that category account for, weighted by the
 * inclusive cost callgrind recorded on each call edge, computed to a fixed point over the call
 * graph: `malloc` called half (by cost) from the compiler counts half as compilation. A
 * category's instructions are the functions' own (self) instructions times their shares. The
 * categories exclude each other (a major GC that compilation triggers is major GC), so they never
 * add up to more than the total. Callgrind keeps one level of callers, not whole stacks, so this
 * is an estimate; it moves by a few hundred instructions per request, not by thousands.
 */
import { readFileSync } from 'node:fs'

export const CATEGORIES = {
  /** JIT compilation (Ignition's lazy compilation, Sparkplug, Maglev, Turbofan) and deoptimisation. */
  compile: /v8::internal::(compiler::|Compiler::|maglev::|baseline::|turboshaft::|OptimizingCompileDispatcher|Deoptimizer::|Runtime_Compile|Runtime_InstallBaselineCode)/,
  /** Major (mark-compact) GC: incremental and concurrent marking, the marking barrier, mark-compact, sweeping. */
  majorGC: /v8::internal::((?<!Minor)MarkCompact|MajorGC|IncrementalMarking|ConcurrentMarking|MarkingBarrier|MarkingVisitor|MainMarkingVisitor|Sweeper::|Heap::StartIncrementalMarking|Heap::FinalizeIncrementalMarking)/,
  /** Minor GC (scavenges): counted in the core figure, reported for information. */
  minorGC: /v8::internal::(Scavenger|ScavengerCollector|ScavengeJob|Heap::Scavenge|MinorGC|MinorMarkCompact)/
} as const

export type Category = keyof typeof CATEGORIES
const NAMES = Object.keys(CATEGORIES) as Category[]

export interface Attribution {
  total: number
  /** Instructions per category (compile, majorGC, minorGC), and any extra patterns asked for by name. */
  parts: Record<string, number>
}

interface Graph {
  total: number
  names: string[]
  self: Float64Array
  /** Call edges: caller, callee, inclusive cost. */
  edges: Array<[number, number, number]>
}

/** Parse a callgrind output file (one part, `events: Ir` first). */
export function parseCallgrind (text: string): Graph {
  const ids = new Map<string, number>()
  const names: string[] = []
  const selfList: number[] = []
  const edgeCost = new Map<string, number>()
  let positions = 1
  let total: number | null = null
  const fnIndex = (spec: string): number => {
    // "(12) name" defines compressed id 12, "(12)" refers to it; an uncompressed name stands alone.
    const m = /^\((\d+)\)(?: (.*))?$/.exec(spec)
    let key: string
    let name: string
    if (m === null) {
      key = `name:${spec}`
      name = spec
    } else {
      key = `id:${m[1]!}`
      name = m[2] ?? ''
    }
    let index = ids.get(key)
    if (index === undefined) {
      index = names.length
      ids.set(key, index)
      names.push(name)
      selfList.push(0)
    } else if (name !== '' && names[index] === '') {
      names[index] = name
    }
    return index
  }
  let fn = -1
  let cfn = -1
  let pendingCall = false
  for (const line of text.split('\n')) {
    if (line === '') continue
    const c = line.charCodeAt(0)
    const isCost = (c >= 48 && c <= 57) || c === 43 || c === 45 || c === 42 // digit, +, -, *
    if (isCost) {
      const fields = line.split(' ')
      const value = Number(fields[positions] ?? 0)
      if (pendingCall) {
        if (fn >= 0 && cfn >= 0) {
          const key = `${fn},${cfn}`
          edgeCost.set(key, (edgeCost.get(key) ?? 0) + value)
        }
        pendingCall = false
      } else if (fn >= 0) {
        selfList[fn]! += value
      }
      continue
    }
    if (line.startsWith('fn=')) {
      fn = fnIndex(line.slice(3))
      cfn = -1
    } else if (line.startsWith('cfn=')) {
      cfn = fnIndex(line.slice(4))
    } else if (line.startsWith('calls=')) {
      if (cfn < 0) cfn = fn
      pendingCall = true
    } else if (line.startsWith('positions:')) {
      positions = line.slice(10).trim().split(/\s+/).length
    } else if (line.startsWith('totals:')) {
      total = Number(line.slice(7).trim().split(/\s+/)[0])
    }
  }
  const self = Float64Array.from(selfList)
  const edges: Array<[number, number, number]> = []
  for (const [key, cost] of edgeCost) {
    const [a, b] = key.split(',').map(Number) as [number, number]
    if (a !== b) edges.push([a, b, cost])
  }
  return { total: total ?? self.reduce((s, v) => s + v, 0), names, self, edges }
}

/** Instructions of a dump per category (see the rule at the top of this file). `extra` adds patterns, attributed the same way. */
export function attribute (graph: Graph, extra: Record<string, RegExp> = {}): Attribution {
  const patterns: Array<[string, RegExp]> = [...NAMES.map((n) => [n, CATEGORIES[n]] as [string, RegExp]), ...Object.entries(extra)]
  const n = graph.names.length
  const k = patterns.length
  const member = new Int32Array(n).fill(-1)
  for (let f = 0; f < n; f++) {
    const name = graph.names[f]!
    const found = patterns.findIndex(([, re]) => re.test(name))
    member[f] = found
  }
  // Incoming edges per function, and the sum of their costs.
  const incoming: Array<Array<[number, number]>> = Array.from({ length: n }, () => [])
  const inSum = new Float64Array(n)
  for (const [a, b, cost] of graph.edges) {
    incoming[b]!.push([a, cost])
    inSum[b]! += cost
  }
  const share = new Float64Array(n * k)
  for (let f = 0; f < n; f++) if (member[f]! >= 0) share[f * k + member[f]!] = 1
  for (let iteration = 0; iteration < 200; iteration++) {
    let change = 0
    for (let f = 0; f < n; f++) {
      if (member[f]! >= 0 || inSum[f] === 0) continue
      for (let c = 0; c < k; c++) {
        let s = 0
        for (const [a, cost] of incoming[f]!) s += share[a * k + c]! * cost
        const next = s / inSum[f]!
        change = Math.max(change, Math.abs(next - share[f * k + c]!))
        share[f * k + c] = next
      }
    }
    if (change < 1e-9) break
  }
  const parts: Record<string, number> = Object.fromEntries(patterns.map(([name]) => [name, 0]))
  for (let f = 0; f < n; f++) {
    for (let c = 0; c < k; c++) parts[patterns[c]![0]]! += graph.self[f]! * share[f * k + c]!
  }
  for (const name of Object.keys(parts)) parts[name] = Math.round(parts[name]!)
  return { total: graph.total, parts }
}

export function attributeFile (path: string, extra: Record<string, RegExp> = {}): Attribution {
  return attribute(parseCallgrind(readFileSync(path, 'utf8')), extra)
}
