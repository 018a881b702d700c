/**
 * Leases that mean what they say, over real sockets: no handler holds a key for ever, whether its
 * client stayed or left (even before the lease was taken).
 */
import { afterEach, describe, expect, it } from 'vitest'
import { connect } from 'node:net'
import { setTimeout as sleep } from 'node:timers/promises'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency, { idempotencyErrorHandler, MemoryStorage, type IdempotencyOptions, type IdempotencyStorage } from '../lib/index.js'
import { newKey } from './helpers/app.js'
import { resendWhile } from './helpers/resend.js'

let app: FastifyInstance | undefined
afterEach(async () => { await app?.close() })

/** A server whose /hang handler never answers, and whose /quick handler does. */
async function server (options: IdempotencyOptions): Promise<{ port: number, runs: () => number }> {
  app = Fastify({ forceCloseConnections: true })
  // Its handlers may hang for ever: closing the app waits for them only this long.
  await app.register(idempotency, { closeTimeout: 100, ...options })
  app.setErrorHandler(idempotencyErrorHandler())
  let runs = 0
  app.post('/hang', { config: { idempotency: true } }, async (request) => {
    runs++
    if ((request.body as { hang?: boolean }).hang === true) await new Promise(() => {})
    return { run: runs }
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  return { port: typeof address === 'object' && address !== null ? address.port : 0, runs: () => runs }
}

function post (port: number, key: string, body: object): Promise<{ status: number, body: string }> {
  return fetch(`http://127.0.0.1:${port}/hang`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(body) })
    .then(async (res) => ({ status: res.status, body: await res.text() }))
}

/** Send a request and close the connection after `ms`, without waiting for an answer. */
function sendAndLeave (port: number, key: string, body: object, ms: number): Promise<void> {
  const payload = JSON.stringify(body)
  return new Promise((resolve) => {
    const socket = connect(port, '127.0.0.1', () => {
      socket.write(`POST /hang HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: ${key}\r\nContent-Length: ${Buffer.byteLength(payload)}\r\n\r\n${payload}`)
      setTimeout(() => { socket.destroy(); resolve() }, ms)
    })
  })
}

describe('leases', () => {
  it('frees the key of a hung handler whose client left before the lease was taken', async () => {
    const inner = new MemoryStorage()
    // A slow store: the client is gone by the time the lease is taken.
    const slow: IdempotencyStorage = {
      begin: async (k, f, l) => { await sleep(100); return inner.begin(k, f, l) },
      complete: (k, t, r, e) => inner.complete(k, t, r, e),
      release: (k, t) => inner.release(k, t),
      renew: (k, t, l) => inner.renew(k, t, l)
    }
    const { port, runs } = await server({ storage: slow, lockTimeout: 300 })
    const key = newKey()
    await sendAndLeave(port, key, { hang: true }, 30)
    while (runs() < 1) await sleep(10)
    // Renewal never started: within lockTimeout of the lease (plus the slow begin) the key is free.
    await sleep(500)
    const retry = await post(port, key, { hang: false })
    expect(retry.status).not.toBe(409)
  })

  it('frees the key of a hung handler, client still connected, once maxLockHold has passed', async () => {
    const { port, runs } = await server({ lockTimeout: 100, maxLockHold: 400 })
    const key = newKey()
    void post(port, key, { hang: true }).catch(() => {})
    while (runs() < 1) await sleep(10)
    expect((await post(port, key, { hang: true })).status).toBe(409)
    const started = Date.now()
    const { status } = await resendWhile([409], () => post(port, key, { hang: false }), { attempts: 60 })
    // Renewed until maxLockHold (400 ms), then the 100 ms lease lapsed: free after about 500 ms.
    expect(status).not.toBe(409)
    expect(Date.now() - started).toBeGreaterThan(250)
    expect(runs()).toBe(2)
  })
})
