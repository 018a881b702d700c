/**
 * RedisStorage's start-up proof: every command, script and form a request will send, tried on the
 * server with the client's own user, in the order a request sends them, on a probe key of its own
 * (`<prefix>{%probe:<token>}`: the `%` of an escaped key is always followed by an escape, so no
 * idempotency key is ever stored under it, and key patterns of an ACL see it as they see the keys),
 * which the proof deletes (or which expires within seconds if the process dies meanwhile):
 *
 *   SET … PX … NX GET (begin), GET (begin on a full Redis), the renew script, PEXPIRE (its fallback
 *   on a full Redis), the complete and release script, and with wait mode the mark of a waiter and
 *   a lease's end published to a subscriber; each script as EVAL, then as EVALSHA (an ACL may allow
 *   one and not the other, and a request sends EVALSHA).
 *
 * Then the server's settings that break the promise without refusing anything: an eviction policy
 * that may drop a lease (read from INFO, which managed Redis allows where CONFIG is disabled), and
 * persistence turned off.
 */
import { beforeAbort, failed, messageOf, passed, ProofAbortedError, warning } from '../proof.js'
import type { TokenGenerator } from '../tokens.js'
import type { StoreCheck, StoreProofOptions } from '../types.js'
import { encodeEntry, encodeLease, fenceOf } from './codec.js'
import { SilentServerError, type CommandArg, type RedisDriver, type Subscription } from './driver.js'
import { channelOf } from './keys.js'
import { END_LEASE, MARK_WAITING, RENEW, type Script, type ScriptForm } from './scripts.js'
import { evictionCheck, persistenceCheck, replicaCheck } from './server-settings.js'

/** How long a probe left by a process that died mid-proof stays, at most. */
const PROBE_MS = 10_000
const PROBE_FINGERPRINT = 'fastify-idempotency start-up proof'

export interface RedisProofContext {
  driver: RedisDriver
  /** The storage's prefix. */
  prefix: string
  tokens: TokenGenerator
  /** The storage's `allowEviction`: an evicting server is a warning, not a failure. */
  allowEviction: boolean
}

export interface RedisProof {
  checks: StoreCheck[]
  /** Wait mode's PUBLISH and SUBSCRIBE work (`undefined`: not proven, wait mode off). */
  signals: boolean | undefined
}

/** Redis did not answer a command at all: nothing more can be proven. */
class Unreachable extends Error {}

/** What a script is called in the proof's lines, and what it runs. */
const SCRIPTS = new Map<Script, { name: string, runs: string }>([
  [RENEW, { name: 'renew script', runs: 'GET, SET and PEXPIRE' }],
  [END_LEASE, { name: 'complete and release script', runs: 'GETRANGE, SET, DEL and PUBLISH' }],
  [MARK_WAITING, { name: 'wait-mark script', runs: 'GETRANGE and SETRANGE' }]
])

export async function proveRedis (context: RedisProofContext, options: StoreProofOptions): Promise<RedisProof> {
  const opening = new Proof(context, options, context.tokens.next(), null)
  try {
    await opening.connected()
  } catch (error) {
    if (!(error instanceof Unreachable)) throw error
    return { checks: opening.checks, signals: undefined }
  }
  const { proofs, checks } = context.driver.cluster ? await masterProofs(context, options, opening) : { proofs: [opening], checks: [] }
  for (const [index, proof] of proofs.entries()) {
    try {
      await proof.commands()
    } catch (error) {
      if (!(error instanceof Unreachable)) throw error
      return { checks: [...checks, ...merged(proofs.slice(0, index + 1))], signals: undefined }
    } finally {
      await proof.cleanUp()
    }
  }
  checks.push(...merged(proofs))
  const replica = await replicaCheck(context.driver, options.signal)
  if (replica !== null) checks.push(replica)
  checks.push(await evictionCheck(context.driver, context.allowEviction, options.signal))
  const persistence = await persistenceCheck(context.driver, options.signal)
  if (persistence !== null) checks.push(persistence)
  const signals = proofs.some((proof) => proof.signals === false) ? false : proofs[0]!.signals
  return { checks, signals }
}

/** Redis Cluster's hash slot of a key whose hash tag is `tag`: CRC16 (XMODEM) modulo 16384. */
export function slotOf (tag: string): number {
  let crc = 0
  for (const byte of Buffer.from(tag)) {
    crc ^= byte << 8
    for (let bit = 0; bit < 8; bit++) crc = (crc & 0x8000) !== 0 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff
  }
  return crc % 16384
}

/**
 * On a cluster, a proof per master, each on a probe key of a slot that master serves: an ACL, a
 * key pattern or a script cache is each node's own, and a request's key may land on any of them.
 * Where the masters cannot be read, the one node of `opening`'s probe, said in a warning.
 */
async function masterProofs (context: RedisProofContext, options: StoreProofOptions, opening: Proof): Promise<{ proofs: Proof[], checks: StoreCheck[] }> {
  let masters: Map<string, Set<number>>
  try {
    masters = await beforeAbort(context.driver.clusterMasters(), options.signal, 'CLUSTER SLOTS')
  } catch (error) {
    return {
      proofs: [opening],
      checks: [warning('cluster slots', `the cluster's masters could not be read (${messageOf(error)}), so only the master of one slot was proven: an ACL or a setting that differs on another master is not seen`,
        'allow CLUSTER SLOTS to the client\'s Redis user (+cluster|slots): the cluster client needs it too')]
    }
  }
  const proofs: Proof[] = []
  for (const [node, slots] of masters) {
    // About as many tries as there are masters (each serves its share of the slots); bounded.
    for (let attempt = 0; attempt < 100_000; attempt++) {
      const token = context.tokens.next()
      const slot = slotOf(`%probe:${token}`)
      if (slots.has(slot)) {
        proofs.push(new Proof(context, options, token, node))
        break
      }
    }
  }
  return { proofs, checks: [] }
}

/**
 * The checks of the proofs of every master as one list, in their order: a check that did not
 * pass on some master is said for each such master (naming it); one that passed on all, once.
 */
function merged (proofs: Proof[]): StoreCheck[] {
  const names: string[] = []
  const byName = new Map<string, StoreCheck[]>()
  for (const proof of proofs) {
    for (const check of proof.checks) {
      if (!byName.has(check.name)) names.push(check.name)
      const shown = proof.node === null || check.outcome === 'passed' ? check : { ...check, found: `on ${proof.node}: ${check.found}` }
      byName.set(check.name, [...(byName.get(check.name) ?? []), shown])
    }
  }
  return names.flatMap((name) => {
    const all = byName.get(name)!
    const notPassed = all.filter((check) => check.outcome !== 'passed')
    if (notPassed.length > 0) return notPassed
    return [proofs.length > 1 ? { ...all[0]!, found: `${all[0]!.found} (on each of the ${proofs.length} masters)` } : all[0]!]
  })
}

class Proof {
  readonly checks: StoreCheck[] = []
  signals: boolean | undefined
  readonly #driver: RedisDriver
  readonly #context: RedisProofContext
  readonly #options: StoreProofOptions
  readonly #key: string
  /** The cluster master whose slot the probe is in (`host:port`), `null` for a Redis. */
  readonly node: string | null
  #subscription: Promise<Subscription> | undefined

  constructor (context: RedisProofContext, options: StoreProofOptions, token: string, node: string | null) {
    this.#context = context
    this.#driver = context.driver
    this.#options = options
    this.#key = `${context.prefix}{%probe:${token}}`
    this.node = node
  }

  async connected (): Promise<void> {
    try {
      await this.#driver.whenReady(this.#options.signal)
    } catch (error) {
      this.#unreachable(error)
    }
  }

  /** The commands and scripts of a request, in a request's order, on the probe. */
  async commands (): Promise<void> {
    const first = await this.#lease('SET … PX … NX GET')
    if (first === null) return
    await this.#plain('GET', 'get', [], 'begin reads the key this way when Redis is full')
    await this.#script(RENEW, () => [fenceOf(first), String(Date.now() + PROBE_MS), String(PROBE_MS)])
    await this.#plain('PEXPIRE', 'pexpire', [String(PROBE_MS)], 'a lease is renewed this way when Redis is full')
    const wait = this.#options.wait
    const heard = wait ? await this.#subscribe() : null
    // The release form (DEL), on the first lease; then the complete form (SET), on a second one.
    // Each script as EVAL first, then as EVALSHA: the mark on each lease, the end across both.
    const markedFirst = wait && await this.#run(MARK_WAITING, 'eval', [], 1) !== null
    const endedFirst = await this.#run(END_LEASE, 'eval', [fenceOf(first)], 1)
    const second = endedFirst === null ? null : await this.#lease('SET … PX … NX GET (again)')
    if (second === null) return
    const markedSecond = markedFirst && await this.#run(MARK_WAITING, 'evalsha', [], 1) !== null
    if (markedSecond) this.#passed(MARK_WAITING)
    const entry = encodeEntry(PROBE_FINGERPRINT, { statusCode: 200, contentType: null, headers: {}, body: Buffer.alloc(0) }, Date.now())
    const endedSecond = await this.#run(END_LEASE, 'evalsha', [fenceOf(second), entry, String(PROBE_MS)], 1)
    if (endedSecond !== null) this.#passed(END_LEASE)
    // Only the end of a marked lease is published (a mark refused has failed the proof already).
    const published = [markedFirst ? endedFirst : null, markedSecond ? endedSecond : null].filter((ended) => ended !== null)
    if (heard !== null && published.length > 0) await this.#heard(heard, published)
  }

  /** Remove the probe and the proof's subscriber; what cannot be removed expires. */
  async cleanUp (): Promise<void> {
    const deleted = Promise.resolve().then(() => this.#driver.call('del', this.#key, []))
    // Not past the proof's time (a client that cannot reach Redis queues it): the probe expires.
    await beforeAbort(deleted, this.#options.signal, 'DEL').catch(() => {})
    // A subscriber still connecting is closed once it has connected: the proof does not wait.
    this.#subscription?.then((subscription) => { subscription.close() }).catch(() => {})
  }

  /** A lease on the probe, as begin takes one: its token, or `null` when refused (said). */
  async #lease (name: string): Promise<string | null> {
    const token = this.#context.tokens.next()
    const lease = encodeLease(token, Date.now() + PROBE_MS, PROBE_FINGERPRINT)
    try {
      const found = await this.#send(this.#driver.call('set', this.#key, [lease, 'PX', String(PROBE_MS), 'NX', 'GET']), name)
      if (found !== null) {
        this.checks.push(failed(name, `${name} found the probe key ${this.#key} taken`, 'another client wrote the key: start again'))
        return null
      }
      if (!name.endsWith('(again)')) this.checks.push(passed(name, 'begin takes a lease this way'))
      return token
    } catch (error) {
      if (error instanceof Unreachable) throw error
      this.checks.push(this.#setRefused(name, error))
      return null
    }
  }

  #setRefused (name: string, error: unknown): StoreCheck {
    const reason = messageOf(error)
    const code = this.#driver.replyCode(error)
    if (code === 'NOPERM') return failed(name, `SET was refused: ${reason}`, `allow SET and GET on the keys under "${this.#context.prefix}" in the ACL of the client's Redis user (+set +get ~${this.#driver.keyPrefix}${this.#context.prefix}*): every request begins with it`)
    if (code === 'READONLY') return failed(name, `the server is a read-only replica: ${reason}`, 'point the client at the primary: every request writes its key')
    if (code === 'OOM') return failed(name, `Redis is full: ${reason}`, 'free memory or raise maxmemory: no new key can be taken until then')
    const writes = 'every request writes its key'
    if (code === 'NOREPLICAS') return failed(name, `Redis refuses writes while it has fewer replicas than min-replicas-to-write: ${reason}`, `bring its replicas back, or lower min-replicas-to-write: ${writes}`)
    if (code === 'MISCONF') return failed(name, `Redis refuses writes since it failed to save a snapshot: ${reason}`, `fix what keeps it from saving (its log says), or set stop-writes-on-bgsave-error no: ${writes}`)
    if (code === 'BUSY') return failed(name, `Redis is busy running a script: ${reason}`, 'end the script (SCRIPT KILL, or FUNCTION KILL) or wait for it: Redis answers nothing else meanwhile')
    if (/syntax/i.test(reason)) return failed(name, `the server refuses SET with NX and GET together: ${reason}`, 'use Redis 7.0 or later, or Valkey')
    return failed(name, `the server refuses SET … PX … NX GET: ${reason}`, 'Redis\'s reason says what to change: every request begins with this command')
  }

  /** A plain command on the probe, said passed or refused. */
  async #plain (name: string, command: string, args: string[], why: string): Promise<void> {
    try {
      await this.#send(this.#driver.call(command, this.#key, args), name)
      this.checks.push(passed(name, why))
    } catch (error) {
      if (error instanceof Unreachable) throw error
      this.checks.push(failed(name, `${name} was refused: ${messageOf(error)}`, `allow ${name} in the ACL of the client's Redis user (+${command}): ${why}`))
    }
  }

  /** `script` in both forms on the probe (renew: its lease's fence), said once. */
  async #script (script: Script, args: () => string[]): Promise<void> {
    if (await this.#run(script, 'eval', args(), 1) === null) return
    if (await this.#run(script, 'evalsha', args(), 1) !== null) this.#passed(script)
  }

  #passed (script: Script): void {
    this.checks.push(passed(SCRIPTS.get(script)!.name, 'ran as EVAL, then as EVALSHA'))
  }

  /**
   * One form of `script` on the probe: its answer, or `null` when it failed (said). An answer of
   * 2 from the end of a lease: ended, its PUBLISH refused (the subscriber's check says so).
   */
  async #run (script: Script, form: ScriptForm, args: CommandArg[], expected: number): Promise<number | null> {
    const { name, runs } = SCRIPTS.get(script)!
    const shown = `${form === 'eval' ? 'EVAL' : 'EVALSHA'} of the ${name}`
    let answer: number
    try {
      answer = Number(await this.#send(this.#driver.script(script, this.#key, args, form), shown))
    } catch (error) {
      if (error instanceof Unreachable) throw error
      const reason = messageOf(error)
      const code = this.#driver.replyCode(error)
      if (code === 'NOPERM') {
        this.checks.push(failed(name, `${shown} was refused: ${reason}`, 'allow EVAL and EVALSHA in the ACL of the client\'s Redis user (+eval +evalsha): each script is sent once as EVAL, then as EVALSHA on every request (each renewal, each stored response)'))
      } else if (code === 'NOSCRIPT') {
        this.checks.push(warning(name, `EVALSHA answered NOSCRIPT right after EVAL loaded the script: ${reason}`, 'the client reaches several servers that do not share their scripts (a proxy in front?): each script is sent again as EVAL where it is missing, one round trip more'))
      } else {
        this.checks.push(failed(name, `${shown} failed: ${reason}`, `the script runs ${runs} on the storage's keys: allow them in the ACL of the client's Redis user, and scripting on the server`))
      }
      return null
    }
    if (answer !== expected && !(script === END_LEASE && answer === 2)) {
      this.checks.push(failed(name, `${shown} answered ${answer}, not ${expected}: it did not find the probe's lease`, 'another client changed the probe key meanwhile: start again'))
      return null
    }
    return answer
  }

  /** Wait mode: the storage's subscriber, subscribed to the probe's channel: resolves at its first message. */
  async #subscribe (): Promise<{ message: Promise<void> } | null> {
    const channel = this.#driver.keyPrefix + channelOf(this.#key)
    let heard!: () => void
    const message = new Promise<void>((resolve) => { heard = resolve })
    // Its connection is a second one: whatever fails there, requests still work, and waits poll.
    try {
      const subscription = this.#subscription = this.#driver.subscribe({ message: (name) => { if (name === channel) heard() }, lost: () => {} })
      const connection = await beforeAbort(subscription, this.#options.signal, 'the subscriber connection')
      await beforeAbort(connection.subscribe(channel), this.#options.signal, 'SUBSCRIBE')
      // Wrapped: an async function would otherwise wait for the message itself.
      return { message }
    } catch (error) {
      this.#cannotSignal(`SUBSCRIBE to ${channel} failed: ${messageOf(error)}`)
      return null
    }
  }

  /** Whether the ends of the probe's leases reached the subscriber. */
  async #heard ({ message }: { message: Promise<void> }, ends: number[]): Promise<void> {
    if (ends.includes(2)) {
      this.#cannotSignal('PUBLISH was refused to the scripts (the end of a lease was stored, its waiters not told)')
      return
    }
    try {
      await beforeAbort(message, this.#options.signal, 'PUBLISH')
      this.signals = true
      this.checks.push(passed('PUBLISH and SUBSCRIBE', 'the end of a lease reached a subscriber: waiting duplicates are woken at once'))
    } catch {
      this.#cannotSignal('the end of a lease never reached the subscriber')
    }
  }

  #cannotSignal (found: string): void {
    this.signals = false
    const channels = `${this.#driver.keyPrefix}${this.#context.prefix}*`
    this.checks.push(warning('PUBLISH and SUBSCRIBE', `${found}: waiting duplicates poll the store instead (every 25 ms to 400 ms)`,
      `to have them woken at once, allow PUBLISH and SUBSCRIBE on the storage's channels in the ACL of the client's Redis user (+publish +subscribe &${channels})`))
  }

  /**
   * `command`, given up when the proof's time is up. An error that is not Redis's answer (the
   * connection lost, a command timeout) ends the proof: Redis cannot be reached.
   */
  async #send<T> (command: Promise<T>, step: string): Promise<T> {
    try {
      return await beforeAbort(command, this.#options.signal, step)
    } catch (error) {
      if (error instanceof ProofAbortedError || this.#driver.replyCode(error) === null) this.#unreachable(error)
      throw error
    }
  }

  /**
   * Nothing more can be proven: Redis refused the connection, or took it and answered nothing (a
   * command past the proof's time, a client connected and never ready), which is said apart.
   */
  #unreachable (error: unknown): never {
    const family = this.#driver.family
    if (error instanceof ProofAbortedError || error instanceof SilentServerError) {
      this.checks.push(failed('connection', `Redis did not answer through the ${family} client: ${messageOf(error)}`,
        'check that Redis answers (a server paused or overloaded, a long script or command that blocks it, a network that drops packets), and the client\'s host, port, TLS and credentials'))
    } else {
      this.checks.push(failed('connection', `Redis cannot be reached through the ${family} client: ${messageOf(error)}`,
        'check that Redis runs, and the client\'s host, port, TLS and credentials'))
    }
    throw new Unreachable()
  }
}
