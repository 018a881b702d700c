import { afterEach, describe, expect, it } from 'vitest'
import diagnostics from 'node:diagnostics_channel'
import { CHANNEL_PREFIX, MemoryStorage, type IdempotencyEvent, type IdempotencyStorage } from '../lib/index.js'
import { buildApp, newKey } from './helpers/app.js'
import { Gate } from './helpers/gate.js'

const events: IdempotencyEvent[] = []
const outcomes = ['execute', 'replay', 'mismatch', 'in-progress', 'wait', 'lease-lost', 'store-error']
const listener = (message: unknown) => { events.push(message as IdempotencyEvent) }
for (const outcome of outcomes) diagnostics.subscribe(`${CHANNEL_PREFIX}${outcome}`, listener)
afterEach(() => { events.length = 0 })

describe('diagnostics channels', () => {
  it('publishes execute, replay and mismatch with key, route, store and timing', async () => {
    const { app } = await buildApp()
    const key = newKey()
    const send = (payload: object) => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': key }, payload })
    await send({ a: 1 })
    await send({ a: 1 })
    await send({ a: 2 })
    expect(events.map((e) => e.outcome)).toEqual(['execute', 'replay', 'mismatch'])
    for (const event of events) {
      expect(event).toMatchObject({ idempotencyKey: key, method: 'POST', route: '/orders', store: 'MemoryStorage' })
      expect(event.durationMs).toBeGreaterThanOrEqual(0)
    }
    expect(events[0]).toMatchObject({ stored: true, statusCode: 201 })
    expect(events[1]).toMatchObject({ statusCode: 201 })
  })

  it('says why an executed response was not stored', async () => {
    const { app } = await buildApp({ maxResponseBytes: 10, unstorableResponse: 'release' }, { '/fail': (_req, reply) => { reply.code(500); return {} }, '/big': () => 'x'.repeat(100) })
    await app.inject({ method: 'POST', url: '/fail', headers: { 'idempotency-key': newKey() }, payload: {} })
    await app.inject({ method: 'POST', url: '/big', headers: { 'idempotency-key': newKey() }, payload: {} })
    expect(events.map((e) => [e.outcome, e.stored, e.reason])).toEqual([['execute', false, 'not-cacheable'], ['execute', false, 'too-large']])
  })

  it('says when only the outcome of an executed response was stored, without its body', async () => {
    const { app } = await buildApp({ maxResponseBytes: 10 }, { '/big': () => 'x'.repeat(100) })
    await app.inject({ method: 'POST', url: '/big', headers: { 'idempotency-key': newKey() }, payload: {} })
    expect(events.map((e) => [e.outcome, e.stored, e.bodyOmitted])).toEqual([['execute', true, true]])
  })

  it('publishes in-progress, wait and store-error', async () => {
    const gate = new Gate()
    const { app } = await buildApp({}, { '/slow': async () => { await gate.hold(); return {} } })
    const key = newKey()
    const first = app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: {} })
    await gate.entered
    await app.inject({ method: 'POST', url: '/slow', headers: { 'idempotency-key': key }, payload: {} })
    expect(events.map((e) => e.outcome)).toEqual(['in-progress'])
    gate.open()
    await first

    events.length = 0
    let release!: () => void
    const hold = new Promise<void>((resolve) => { release = resolve })
    let entered!: () => void
    const inHandler = new Promise<void>((resolve) => { entered = resolve })
    let waiterParked!: () => void
    const parked = new Promise<void>((resolve) => { waiterParked = resolve })
    class Signalling extends MemoryStorage {
      override waitFor (key: string, timeout: number): Promise<void> {
        const waiting = super.waitFor(key, timeout)
        waiterParked()
        return waiting
      }
    }
    const waiting = await buildApp({ wait: true, storage: new Signalling() }, { '/slow2': async () => { entered(); await hold; return {} } })
    const other = newKey()
    const a = waiting.app.inject({ method: 'POST', url: '/slow2', headers: { 'idempotency-key': other }, payload: {} })
    await inHandler
    const b = waiting.app.inject({ method: 'POST', url: '/slow2', headers: { 'idempotency-key': other }, payload: {} })
    await parked
    release()
    await Promise.all([a, b])
    expect(events.map((e) => e.outcome)).toContain('wait')
    expect(events.find((e) => e.outcome === 'wait')!.waitedMs).toBeGreaterThan(0)

    events.length = 0
    const inner = new MemoryStorage()
    const broken: IdempotencyStorage = { begin: async () => { throw new Error('down') }, complete: inner.complete.bind(inner), release: inner.release.bind(inner), renew: inner.renew.bind(inner) }
    const failing = await buildApp({ storage: broken })
    await failing.app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': newKey() }, payload: {} })
    expect(events).toHaveLength(1)
    expect(events[0]).toMatchObject({ outcome: 'store-error', phase: 'begin', failOpen: false })
  })
})
