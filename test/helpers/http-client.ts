export interface HttpAnswer {
  status: number
  /** The body as text, read whole. */
  body: string
  /** Whether it is a replay (`Idempotent-Replayed: true`). */
  replayed: boolean
  headers: Headers
}

/**
 * POSTs `body` (JSON: text as it is, anything else stringified) to `url` with an Idempotency-Key,
 * as a client over HTTP does, and reads the answer whole.
 */
export async function postWithKey (url: string, key: string, body: unknown = {}, headers: Record<string, string> = {}): Promise<HttpAnswer> {
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'idempotency-key': key, ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body)
  })
  return { status: res.status, body: await res.text(), replayed: res.headers.get('idempotent-replayed') === 'true', headers: res.headers }
}
