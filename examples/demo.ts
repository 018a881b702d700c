/**
 * `npm run demo`: a small payments API guarded by fastify-idempotency on the embedded in-memory
 * store, driven over real HTTP on 127.0.0.1. Every exchange is printed as it happened.
 */
import Fastify from 'fastify'
import idempotency, { idempotencyErrorHandler } from '../lib/index.js'

const app = Fastify()
await app.register(idempotency, { expiration: '24h' })
app.setErrorHandler(idempotencyErrorHandler())

let charges = 0
let releaseSlowCharge: () => void = () => {}
let slowChargeStarted: () => void = () => {}
const slowChargeRunning = new Promise<void>((resolve) => { slowChargeStarted = resolve })

app.post('/payments', { config: { idempotency: { required: true } } }, async (request, reply) => {
  charges++
  const { amount, currency, slow } = request.body as { amount: number, currency: string, slow?: boolean }
  if (slow === true) {
    slowChargeStarted()
    await new Promise<void>((resolve) => { releaseSlowCharge = resolve })
  }
  const id = `pay_${charges}`
  reply.code(201).header('location', `/payments/${id}`)
  return { id, amount, currency, status: 'captured' }
})

const address = await app.listen({ host: '127.0.0.1', port: 0 })
/** Every response header is printed but these, which say nothing about idempotency. */
const omitted = new Set(['date', 'connection', 'keep-alive', 'content-length'])

async function exchange (title: string, key: string | undefined, body: object): Promise<void> {
  const headers: Record<string, string> = { 'content-type': 'application/json' }
  if (key !== undefined) headers['idempotency-key'] = key
  const payload = JSON.stringify(body)
  const response = await fetch(`${address}/payments`, { method: 'POST', headers, body: payload })
  const text = await response.text()
  const lines = [`\n=== ${title}`, '> POST /payments HTTP/1.1']
  for (const [name, value] of Object.entries(headers)) lines.push(`> ${name}: ${value}`)
  lines.push(`> ${payload}`, `< HTTP/1.1 ${response.status} ${response.statusText}`)
  for (const [name, value] of response.headers) {
    if (!omitted.has(name)) lines.push(`< ${name}: ${value}`)
  }
  lines.push(`< ${text}`, `(handler has run ${charges} time${charges === 1 ? '' : 's'})`)
  console.log(lines.join('\n'))
}

console.log(`fastify-idempotency demo: a payments API on ${address}, in-memory store`)
await exchange('1. First request: the handler runs, 201 Created', 'order-7f3a', { amount: 4200, currency: 'eur' })
await exchange('2. Same key, same body (a client retry): replayed, the handler does not run', 'order-7f3a', { amount: 4200, currency: 'eur' })
await exchange('3. Same key, another body: refused, 409 problem+json', 'order-7f3a', { amount: 9900, currency: 'eur' })

const slow = fetch(`${address}/payments`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': 'order-slow' }, body: JSON.stringify({ amount: 100, currency: 'eur', slow: true }) })
await slowChargeRunning
await exchange('4. A duplicate while the first is still running: 409 in progress, with Retry-After', 'order-slow', { amount: 100, currency: 'eur', slow: true })
releaseSlowCharge()
console.log(`\n(the slow first request finished with ${(await slow).status})`)

await exchange('5. No Idempotency-Key on a route that requires one: 400 problem+json', undefined, { amount: 1, currency: 'eur' })

await app.close()
console.log('\nDone: the handler ran', charges, 'times for 6 requests.')
