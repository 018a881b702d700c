import { describe, expect, it } from 'vitest'
import type { FastifyRequest } from 'fastify'
import { scopeByHeader } from '../lib/index.js'

const request = (headers: Record<string, string | string[]>) => ({ headers }) as unknown as FastifyRequest

describe('scopeByHeader', () => {
  const scope = scopeByHeader('Authorization')

  it('gives one caller one scope, and two callers two, without the credential in it', () => {
    const alice = scope(request({ authorization: 'Bearer sk_live_alice' }))
    expect(scope(request({ authorization: 'Bearer sk_live_alice' }))).toBe(alice)
    expect(scope(request({ authorization: 'Bearer sk_live_bob' }))).not.toBe(alice)
    expect(alice).not.toContain('sk_live')
    expect(alice).toMatch(/^sha256:[\w-]{43}$/)
  })

  it('finds no caller in a request without the header, and keeps a repeated header apart from one value', () => {
    expect(scope(request({}))).toBeUndefined()
    expect(scope(request({ authorization: ['a', 'b'] }))).not.toBe(scope(request({ authorization: 'a, b' })))
  })

  it('refuses an empty name at start-up', () => {
    expect(() => scopeByHeader('')).toThrow(/header name/)
  })
})
