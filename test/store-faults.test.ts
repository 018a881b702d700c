/**
 * Nothing under the plugin can end the app: each store with a connection (Redis, PostgreSQL,
 * PostgreSQL through PgBouncer, MariaDB) hangs past statementTimeout and storeTimeout (a proxy
 * that accepts and answers nothing), then its connections are reset; the app, in a process of its
 * own (where a rejection nobody handled ends it, and the suite's guard reports it), answers 503 on
 * time, stays alive, and serves the next request once the store is back.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { afterAll, describe, expect, it } from 'vitest'
import { bundle } from './helpers/bundle.js'
import { startProxy, type Proxy } from './helpers/proxy.js'
import { pgbouncer } from './helpers/pgbouncer.js'
import { MARIADB, POSTGRES, REDIS, mysqlConnection, pgConnection, service, type Availability } from './helpers/services.js'
import { dropNamespace } from './helpers/processes.js'
import { postWithKey, type HttpAnswer } from './helpers/http-client.js'
import { newKey } from './helpers/app.js'
import { resendWhile } from './helpers/resend.js'
import { scaled } from './helpers/pace.js'

const program = bundle(fileURLToPath(new URL('./fixtures/fault-server.ts', import.meta.url)), fileURLToPath(new URL('../.tmp/bundles', import.meta.url)))
const [redis, postgres, mariadb, bouncer] = await Promise.all([service(REDIS), service(POSTGRES), service(MARIADB), pgbouncer()])
const STORE_TIMEOUT = scaled(1000)
const stamp = `${process.pid}_${Date.now().toString(36)}`

interface Target {
  name: string
  availability: Availability
  store: 'redis' | 'pg' | 'mysql2'
  server: { host: string, port: number }
  connection: Record<string, unknown>
  /** Where the namespace is dropped (dropNamespace's store). */
  owner: string
  /** The store cancels a statement past statementTimeout through a connection of its own. */
  cancels: boolean
}

const targets: Target[] = [
  { name: 'Redis', availability: redis, store: 'redis', server: REDIS, connection: {}, owner: 'redis', cancels: false },
  { name: 'PostgreSQL', availability: postgres, store: 'pg', server: POSTGRES, connection: pgConnection, owner: 'postgres', cancels: true },
  { name: 'PostgreSQL through PgBouncer', availability: bouncer.availability, store: 'pg', server: { host: '127.0.0.1', port: bouncer.transaction.port }, connection: bouncer.transaction, owner: 'postgres', cancels: false },
  { name: 'MariaDB', availability: mariadb, store: 'mysql2', server: MARIADB, connection: mysqlConnection, owner: 'mysql', cancels: false }
]

for (const target of targets) {
  describe.skipIf(!target.availability.available)(`a ${target.name} that hangs, then resets its connections${target.availability.reason}`, () => {
    const namespace = `faults_${target.store}_${stamp}`
    let proxy: Proxy | undefined
    let child: ChildProcess | undefined
    afterAll(async () => {
      child?.kill('SIGKILL')
      await proxy?.close()
      await dropNamespace(target.owner, namespace)
    })

    it('answers 503 on time, stays alive, and serves again once the store is back', async () => {
      proxy = await startProxy(target.server.host, target.server.port)
      child = spawn(process.execPath, [await program], {
        env: {
          ...process.env,
          STORE: target.store,
          CONNECTION: JSON.stringify({ ...target.connection, host: '127.0.0.1', port: proxy.port }),
          NAMESPACE: namespace,
          STORE_TIMEOUT: String(STORE_TIMEOUT),
          STATEMENT_TIMEOUT: String(Math.round(STORE_TIMEOUT / 4))
        },
        stdio: ['ignore', 'pipe', 'pipe']
      })
      let output = ''
      child.stderr!.on('data', (chunk: Buffer) => { output += chunk.toString() })
      const exited = new Promise<number | null>((resolve) => { child!.once('exit', (code) => resolve(code)) })
      const port = await new Promise<number>((resolve, reject) => {
        createInterface({ input: child!.stdout! }).on('line', (line) => { if (line.startsWith('LISTENING ')) resolve(Number(line.slice(10))) })
        void exited.then((code) => reject(new Error(`the app exited (${code}) before it listened: ${output}`)))
      })
      const post = async (): Promise<HttpAnswer> => await postWithKey(`http://127.0.0.1:${port}/orders`, newKey(), { a: 1 })
      expect((await post()).status).toBe(201)

      proxy.hang()
      const started = Date.now()
      expect((await post()).status).toBe(503)
      expect(Date.now() - started).toBeLessThan(STORE_TIMEOUT * 9 / 8 + scaled(1000))
      // The statement's cancel went out on a connection of its own, which hangs too.
      if (target.cancels) await proxy.held(1)
      proxy.cut()
      proxy.restore()

      expect((await resendWhile([503], post, { attempts: 50, pause: 100 })).status).toBe(201)
      expect(child.exitCode).toBeNull()
      expect(output).not.toMatch(/Unhandled|uncaught/i)
      child.kill('SIGTERM')
      expect(await exited).toBe(0)
    }, scaled(60_000))
  })
}
