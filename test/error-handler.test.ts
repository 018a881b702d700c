import { readFileSync } from 'node:fs'
import { describe, expect, it } from 'vitest'
import Fastify from 'fastify'
import * as exported from '../lib/index.js'
import {
  IdempotencyError,
  IdempotencyFingerprintError,
  IdempotencyFingerprintMismatchError,
  IdempotencyFingerprintUnsupportedError,
  IdempotencyKeyInvalidError,
  IdempotencyKeyMissingError,
  IdempotencyLeaseLostError,
  IdempotencyRequestInProgressError,
  IdempotencyResultNotRecordedError,
  IdempotencyScopeError,
  IdempotencyServerClosingError,
  IdempotencyStoreUnavailableError,
  IdempotencyStoredResponseUnreadableError,
  idempotencyErrorHandler,
  isIdempotencyError
} from '../lib/index.js'
import { anchorsOf } from './helpers/markdown.js'

const kinds = [
  { error: new IdempotencyFingerprintMismatchError('k1'), status: 409, anchor: 'fingerprint-mismatch', title: 'Idempotency fingerprint mismatch', key: 'k1' },
  { error: new IdempotencyFingerprintMismatchError('k2', 422), status: 422, anchor: 'fingerprint-mismatch', title: 'Idempotency fingerprint mismatch', key: 'k2' },
  { error: new IdempotencyKeyMissingError('Idempotency-Key'), status: 400, anchor: 'key-missing', title: 'Idempotency key missing', key: undefined },
  { error: new IdempotencyKeyInvalidError('bad'), status: 400, anchor: 'key-invalid', title: 'Idempotency key invalid', key: undefined },
  { error: new IdempotencyRequestInProgressError('k3', 12.2), status: 409, anchor: 'request-in-progress', title: 'Idempotency request in progress', key: 'k3' },
  { error: new IdempotencyStoreUnavailableError('k4', new Error('ECONNREFUSED')), status: 503, anchor: 'store-unavailable', title: 'Idempotency store unavailable', key: 'k4' },
  { error: new IdempotencyFingerprintError('k6', new RangeError('deep')), status: 400, anchor: 'fingerprint-failed', title: 'Idempotency fingerprint failed', key: 'k6' },
  { error: new IdempotencyFingerprintUnsupportedError('k7', 'POST /orders', '/items/0', 'the body holds an instance of Point', null), status: 500, anchor: 'fingerprint-unsupported', title: 'Idempotency fingerprint unsupported', key: 'k7' },
  { error: new IdempotencyStoredResponseUnreadableError('k5', new Error('tampered')), status: 409, anchor: 'stored-response-unreadable', title: 'Idempotency stored response unreadable', key: 'k5' },
  { error: new IdempotencyServerClosingError('k7'), status: 503, anchor: 'server-closing', title: 'Idempotency server closing', key: 'k7' },
  { error: new IdempotencyScopeError('k8'), status: 500, anchor: 'scope-unresolved', title: 'Idempotency scope unresolved', key: 'k8' },
  { error: new IdempotencyResultNotRecordedError('k9', 'the function returned a function'), status: 409, anchor: 'result-not-recorded', title: 'Idempotency result not recorded', key: 'k9' },
  { error: new IdempotencyLeaseLostError('k10', 'lease-lost'), status: 500, anchor: 'lease-lost', title: 'Idempotency lease lost', key: 'k10' }
]

async function answer (error: Error, handler = idempotencyErrorHandler()) {
  const app = Fastify()
  app.setErrorHandler(handler)
  app.get('/', async () => { throw error })
  const res = await app.inject('/')
  await app.close()
  return res
}

describe('errors', () => {
  it('each have a section of docs/errors.md where their problem type points', () => {
    const sections = anchorsOf(readFileSync(new URL('../docs/errors.md', import.meta.url), 'utf8'))
    for (const { anchor } of kinds) expect(sections).toContain(anchor)
    expect(sections).toContain('idempotency-errors')
  })

  it('each have a row of the table atop docs/errors.md, with their status, and the 5xx ones are those said to keep a stack', () => {
    const page = readFileSync(new URL('../docs/errors.md', import.meta.url), 'utf8')
    const classes = Object.entries(exported)
      .filter(([, value]) => typeof value === 'function' && value !== IdempotencyError && value.prototype instanceof IdempotencyError)
      .map(([name]) => name)
    expect(new Set(kinds.map(({ error }) => error.constructor.name))).toEqual(new Set(classes))
    for (const { error, status, anchor } of kinds) {
      const row = new RegExp(`^\\| \\[[^\\]]+\\]\\(#${anchor}\\) \\| \`${error.constructor.name}\` \\| ([^|]+) \\|`, 'm').exec(page)
      expect(row, `${error.constructor.name}'s row`).not.toBeNull()
      expect(row![1], `${error.constructor.name}'s status`).toMatch(new RegExp(`\\b${status}\\b`))
    }
    const stackRow = /^\| `stack` \| Only for a 5xx \((.+?)\)\. /m.exec(page)
    const listed = [...stackRow![1]!.matchAll(/\(#([a-z-]+)\)/g)].map((match) => match[1])
    expect(new Set(listed)).toEqual(new Set(kinds.filter(({ status }) => status >= 500).map(({ anchor }) => anchor)))
  })

  it('share a base class, a type guard, static type/title and instance members', () => {
    for (const { error, status, anchor, title, key } of kinds) {
      expect(error).toBeInstanceOf(IdempotencyError)
      expect(isIdempotencyError(error)).toBe(true)
      const kind = error.constructor as typeof IdempotencyError
      expect(kind.type).toMatch(new RegExp(`^https://[^#]+/docs/errors\\.md#${anchor}$`))
      expect(kind.title).toBe(title)
      expect(error.type).toBe(kind.type)
      expect(error.title).toBe(title)
      expect(error.statusCode).toBe(status)
      expect(error.idempotencyKey).toBe(key)
      expect(error.code).toMatch(/^FST_IDEMPOTENCY_/)
      expect(error.name).toBe(kind.name)
    }
    expect(isIdempotencyError(new Error('x'))).toBe(false)
    expect(IdempotencyFingerprintMismatchError.title).toBe('Idempotency fingerprint mismatch')
  })

  it('capture no stack trace for a 4xx (the client\'s request, not a fault in code) and keep it for a 5xx', () => {
    const frames = (error: Error) => (error.stack ?? '').split('\n').filter((line) => line.trimStart().startsWith('at ')).length
    for (const { error, status } of kinds) {
      if (status < 500) expect(frames(error), error.name).toBe(0)
      else expect(frames(error), error.name).toBeGreaterThan(0)
    }
    // The limit is put back: other errors keep their stacks.
    expect(frames(new Error('plain'))).toBeGreaterThan(0)
  })

  it('rounds Retry-After up to whole seconds, at least 1', () => {
    expect(new IdempotencyRequestInProgressError('k', 12.2).headers['retry-after']).toBe('13')
    expect(new IdempotencyRequestInProgressError('k', -5).headers['retry-after']).toBe('1')
  })

  it('tells clients which refusals a retry cannot fix (Stripe-Should-Retry, X-Should-Retry) and when to retry the others', () => {
    for (const { error, anchor } of kinds) {
      const retryable = anchor === 'request-in-progress' || anchor === 'store-unavailable' || anchor === 'server-closing'
      expect(error.headers['stripe-should-retry'], anchor).toBe(String(retryable))
      expect(error.headers['x-should-retry'], anchor).toBe(String(retryable))
      if (retryable) expect(Number(error.headers['retry-after-ms']), anchor).toBeGreaterThan(0)
      else expect(error.headers['retry-after'], anchor).toBeUndefined()
    }
    expect(new IdempotencyRequestInProgressError('k', 0.25).headers).toMatchObject({ 'retry-after': '1', 'retry-after-ms': '250' })
  })

  it('keeps the cause of a store failure out of the client\'s answer', async () => {
    const res = await answer(new IdempotencyStoreUnavailableError('k', new Error('password=hunter2')))
    expect(res.body).not.toContain('hunter2')
  })
})

describe('idempotencyErrorHandler', () => {
  for (const { error, status, key } of kinds) {
    it(`answers ${error.name} (${status}) with RFC 9457 problem+json`, async () => {
      const res = await answer(error)
      expect(res.statusCode).toBe(status)
      expect(res.headers['content-type']).toMatch(/^application\/problem\+json/)
      const body = res.json()
      expect(body).toEqual({ type: error.type, title: error.title, status, detail: error.message, ...(key === undefined ? {} : { idempotencyKey: key }) })
      for (const [name, value] of Object.entries(error.headers)) expect(res.headers[name]).toBe(value)
    })
  }

  it('passes other errors to the fallback', async () => {
    const res = await answer(new Error('other'), idempotencyErrorHandler({
      fallback (error, _request, reply) { reply.code(418).send({ mine: error.message }) }
    }))
    expect(res.statusCode).toBe(418)
    expect(res.json()).toEqual({ mine: 'other' })
  })

  it('leaves other errors to Fastify\'s default handling without a fallback', async () => {
    const teapot = Object.assign(new Error('short and stout'), { statusCode: 418 })
    const res = await answer(teapot)
    expect(res.statusCode).toBe(418)
    expect(res.json()).toEqual({ statusCode: 418, error: "I'm a Teapot", message: 'short and stout' })
    const plain = await answer(new Error('boom'))
    expect(plain.statusCode).toBe(500)
  })

  it('without the helper, Fastify\'s default handler still answers with the status and Retry-After', async () => {
    const app = Fastify()
    app.get('/', async () => { throw new IdempotencyRequestInProgressError('k', 5) })
    const res = await app.inject('/')
    expect(res.statusCode).toBe(409)
    expect(res.headers['retry-after']).toBe('5')
    expect(res.json().code).toBe('FST_IDEMPOTENCY_REQUEST_IN_PROGRESS')
  })
})
