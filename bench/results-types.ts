/** The shape of bench/results/latest.json. */
import type { MemoryReport } from './memory.js'
import type { ExecutionStats } from './scenarios/common.js'
import type { ScenarioKind, Workload } from './scenarios/index.js'

/** One autocannon run: one scenario, one workload, one round. */
export interface RunRecord {
  round: number
  scenario: string
  workload: Workload
  /** Responses per second over the measured part (warm-up excluded). */
  rps: number
  /** Latency percentiles and mean in milliseconds (measured part). */
  p50: number
  p99: number
  latencyMean: number
  /**
   * The server process's CPU time (user + system) per response over the measured part, in µs:
   * unlike throughput, barely moved by other processes taking turns on the cores.
   */
  serverCpuMicrosPerRequest: number
  /** Redis's own CPU time per response (INFO cpu, shared server: others' commands count too), µs; null off Redis. */
  redisCpuMicrosPerRequest: number | null
  /** The machine's 1-minute load average when the run ended. */
  loadAverage: number
  requests: number
  seconds: number
  /** Status codes of every response, warm-up included. */
  statusCodes: Record<string, number>
  /** Socket errors and timeouts, warm-up included. */
  errors: number
  timeouts: number
  /** Handler executions over the warm-up and the measured part. */
  executions: ExecutionStats
  /** The server's resident set after the run, MiB. */
  serverRssMiB: number
  /** What made this run incorrect (empty: correct, or not applicable to a baseline). */
  issues: string[]
}

export interface Spread {
  median: number
  min: number
  max: number
}

/** One scenario on one workload, over all rounds. */
export interface Summary {
  scenario: string
  label: string
  kind: ScenarioKind
  store: string
  framework: string
  workload: Workload
  baseline: string | null
  rounds: number
  rps: Spread
  p50: number
  p99: number
  /** Throughput over the baseline's, paired by round (same round, same workload); medians. */
  ratio: (Spread & { perRound: number[] }) | null
  /** Median server CPU µs per response. */
  cpuPerRequest: number
  /**
   * The baseline's server CPU per response over this scenario's, paired by round (above 1: cheaper
   * than the baseline). For the Redis scenarios it leaves out what Redis itself spends.
   */
  cpuRatio: Spread | null
  /** Median Redis CPU µs per response (Redis scenarios only). */
  redisCpuPerRequest: number | null
  executions: number
  duplicateKeys: number
  statusCodes: Record<string, number>
  /** `null` for baselines and floors, which promise nothing about executions. */
  correct: boolean | null
  issues: string[]
}

export interface BarResult {
  id: string
  /** The bar as the contract states it. */
  text: string
  scenario: string
  workload: Workload
  against: string
  threshold: number
  value: number | null
  met: boolean | null
  /** The middle half of the rounds' ratios lies on one side of the threshold (otherwise: within the noise). */
  clear: boolean
  note: string
}

export interface PeerComparison {
  peer: string
  ours: string
  workload: Workload
  /** What is compared: each one's throughput over its own framework's baseline, or raw req/s (CONFLICT). */
  measure: 'ratio to own baseline' | 'req/s'
  oursValue: number | null
  peerValue: number | null
  oursCorrect: boolean | null
  peerCorrect: boolean | null
  ahead: boolean | null
  note: string
}

export interface MachineInfo {
  cpuModel: string
  cores: number
  totalMemoryMiB: number
  node: string
  platform: string
  loadAverageStart: number[]
  loadAverageEnd: number[]
  redisVersion: string | null
  postgresVersion: string | null
}

export interface BenchResults {
  generatedAt: string
  mode: 'quick' | 'full'
  settings: {
    rounds: number
    durationSeconds: number
    conflictDurationSeconds: number
    warmupSeconds: number
    roundWarmupSeconds: number
    /** Fresh server processes every round (full), or one set for all rounds (quick). */
    freshProcesses: boolean
    connections: number
    pipelining: number
    source: 'lib' | 'dist'
    memoryRequests: number
  }
  machine: MachineInfo
  versions: Record<string, string>
  wallSeconds: number
  skipped: Array<{ scenario: string, reason: string }>
  runs: RunRecord[]
  summary: Summary[]
  bars: BarResult[]
  peers: PeerComparison[]
  memory: MemoryReport | null
}
