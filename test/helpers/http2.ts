/** A POST over HTTP/2 (h2c), as the tests of `http2: true` servers send it: no Content-Length. */
import type { ClientHttp2Session } from 'node:http2'

export interface Http2Answer {
  status: number
  /** The response's headers, pseudo-headers included, each as one string. */
  headers: Array<[string, string]>
  body: Buffer
}

export async function http2Post (session: ClientHttp2Session, path: string, headers: Record<string, string>, body: string | Buffer): Promise<Http2Answer> {
  return await new Promise((resolve, reject) => {
    const stream = session.request({ ':method': 'POST', ':path': path, ...headers })
    const chunks: Buffer[] = []
    let status = 0
    let received: Array<[string, string]> = []
    stream.on('response', (h) => {
      status = Number(h[':status'])
      received = Object.entries(h).map(([name, value]) => [name, Array.isArray(value) ? value.join(', ') : String(value)])
    })
    stream.on('data', (chunk: Buffer) => chunks.push(chunk))
    stream.on('end', () => { resolve({ status, headers: received, body: Buffer.concat(chunks) }) })
    stream.on('error', reject)
    stream.end(body)
  })
}
