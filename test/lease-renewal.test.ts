import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest'
import { LeaseRenewal, type RenewedLease } from '../lib/engine/lease-renewal.js'

interface TestLease extends RenewedLease { name: string }

function lease (name: string): TestLease {
  return { name, acquiredAt: Date.now(), renewing: false, renewedAt: 0, previousHeld: null, nextHeld: null }
}

describe('LeaseRenewal', () => {
  beforeEach(() => { vi.useFakeTimers() })
  afterEach(() => { vi.useRealTimers() })

  it('renews each held lease every lockTimeout/8, the first time within 3/16 of lockTimeout, and stops at drop', () => {
    const renewed: string[] = []
    const renewal = new LeaseRenewal<TestLease>(1600, Infinity, (l) => { renewed.push(`${l.name}@${Date.now() - 1_000_000}`) })
    vi.setSystemTime(1_000_000)
    const a = lease('a')
    renewal.hold(a)
    vi.advanceTimersByTime(150)
    const b = lease('b') // 50 ms old at the first tick (200 ms): too young; renewed at the second, 250 ms old
    renewal.hold(b)
    vi.advanceTimersByTime(50) // t = 200: first tick
    expect(renewed).toEqual(['a@200'])
    vi.advanceTimersByTime(200) // t = 400
    expect(renewed.slice(1).sort()).toEqual(['a@400', 'b@400'])
    renewal.drop(a)
    vi.advanceTimersByTime(200) // t = 600
    expect(renewed.slice(3)).toEqual(['b@600'])
    renewal.drop(b)
    vi.advanceTimersByTime(1000)
    expect(renewed).toHaveLength(4)
    // The idle tick stopped the timer.
    expect(vi.getTimerCount()).toBe(0)
  })

  it('keeps the list intact whichever lease is dropped, and tolerates a second drop', () => {
    const renewed: string[] = []
    const renewal = new LeaseRenewal<TestLease>(800, Infinity, (l) => { renewed.push(l.name) })
    const leases = ['a', 'b', 'c', 'd', 'e'].map(lease)
    for (const l of leases) renewal.hold(l)
    renewal.drop(leases[2]!) // middle
    renewal.drop(leases[4]!) // first in the list (taken last)
    renewal.drop(leases[0]!) // last in the list
    renewal.drop(leases[0]!) // again: nothing happens
    vi.advanceTimersByTime(100)
    expect(renewed.sort()).toEqual(['b', 'd'])
    renewal.hold(leases[0]!)
    renewal.hold(leases[0]!) // held twice: still one entry
    vi.advanceTimersByTime(100)
    expect(renewed.sort()).toEqual(['a', 'b', 'b', 'd', 'd'])
    renewal.stop()
    expect(leases.every((l) => !l.renewing && l.previousHeld === null && l.nextHeld === null)).toBe(true)
    vi.advanceTimersByTime(1000)
    expect(renewed).toHaveLength(5)
    expect(vi.getTimerCount()).toBe(0)
  })

  it('stops renewing a lease maxHold after it was acquired, and hands it to expire', () => {
    const renewed: string[] = []
    const expired: string[] = []
    vi.setSystemTime(2_000_000)
    const renewal = new LeaseRenewal<TestLease>(800, 1000, (l) => { renewed.push(`${l.name}@${Date.now() - 2_000_000}`) }, (l) => { expired.push(`${l.name}@${Date.now() - 2_000_000}`) })
    const a = lease('a')
    renewal.hold(a)
    vi.advanceTimersByTime(500)
    const b = lease('b') // acquired at 500: it outlives a
    renewal.hold(b)
    vi.advanceTimersByTime(900) // t = 1400
    expect(expired).toEqual(['a@1000'])
    expect(renewed.filter((entry) => entry.startsWith('a@')).every((entry) => Number(entry.slice(2)) < 1000)).toBe(true)
    expect(a.renewing).toBe(false)
    expect(b.renewing).toBe(true)
    vi.advanceTimersByTime(1100) // t = 2500
    expect(expired).toEqual(['a@1000', 'b@1500'])
    renewal.stop()
  })

  it('counts from when the call that took the lease was sent: held late, it is renewed at the first tick; inTime says when that is too late', () => {
    const renewed: string[] = []
    vi.setSystemTime(3_000_000)
    const renewal = new LeaseRenewal<TestLease>(1600, Infinity, (l) => { renewed.push(`${l.name}@${Date.now() - 3_000_000}`) })
    // begin was sent at 0 and answered at 100 (lockTimeout / 16): still in time.
    vi.advanceTimersByTime(100)
    expect(renewal.inTime(3_000_000)).toBe(true)
    expect(renewal.inTime(2_999_999)).toBe(false)
    renewal.hold(lease('a'), 3_000_000)
    vi.advanceTimersByTime(200) // t = 300: the first tick, the lease 300 ms old
    expect(renewed).toEqual(['a@300'])
    renewal.stop()
  })
  it('tells, for each lease it renews, of a tick that came late by half of lockTimeout or more: the event loop stalled', () => {
    const stalls: string[] = []
    const renewed: string[] = []
    const renewal = new LeaseRenewal<TestLease>(800, Infinity, (l) => { renewed.push(l.name) }, () => {}, (l, stalledMs) => { stalls.push(`${l.name}:${stalledMs}`) })
    const a = lease('a')
    renewal.hold(a)
    vi.advanceTimersByTime(100) // an on-time tick renews, and tells of no stall
    expect(renewed).toEqual(['a'])
    // A stall of 600 ms: timers are held back as a blocked event loop holds them.
    const stalledUntil = performance.now() + 600
    vi.spyOn(performance, 'now').mockImplementation(() => stalledUntil)
    vi.advanceTimersByTime(100)
    expect(renewed).toEqual(['a', 'a'])
    expect(stalls).toHaveLength(1)
    expect(stalls[0]).toMatch(/^a:\d+$/)
    expect(Number(stalls[0]!.slice(2))).toBeGreaterThanOrEqual(400)
    vi.restoreAllMocks()
    renewal.stop()
  })
})
