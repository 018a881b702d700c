/**
 * What Redis itself spends per first request on the fence: instructions of a redis-server of this
 * script's own (under callgrind, on a free port), counted over a loop of first requests after a
 * warm-up, for each way of storing the response. Run as `sh bench/redis-fence.sh`; the server's
 * pid comes in REDIS_PID and its port in REDIS_PORT.
 *
 *   plain    SET key 'in-flight' PX NX, then SET key entry PX (the peer's: no fence)
 *   ours     SET key lease PX NX GET, then EVALSHA of the storage's END_LEASE script
 *   minimal  the same begin, then a script that only compares the fence and SETs (no waiters byte)
 *   function the minimal script as a Redis 7 function (FCALL)
 *
 * and two that need no script, to weigh them against the script (docs/benchmarks.md):
 *
 *   first-wins  a lease key apart from the response key: begin is GET response + SET lease NX GET
 *               (one round trip), complete is SET response NX PX: the first completion wins,
 *               whoever holds the lease (a holder whose lease lapsed is not fenced off)
 *   rename      a strict fence from commands alone: begin is MULTI, SET key lease NX GET PX, SET
 *               lease-token key PX (the same expiry), EXEC; complete is MULTI, GETRANGE of the
 *               lease (its waiters byte), SET lease-token key entry XX PX, RENAME it onto the key,
 *               EXEC: the entry lands only while the caller's token key lives, which it does only
 *               while its lease does
 */
import { execFileSync } from 'node:child_process'
import { readdirSync, readFileSync } from 'node:fs'
import { Redis } from 'ioredis'
import { RedisStorage } from '../lib/redis.js'

const port = Number(process.env.REDIS_PORT)
const pid = process.env.REDIS_PID!
const dir = process.env.CALLGRIND_DIR!
const count = Number(process.env.FENCE_COUNT ?? 5000)
const PER_TURN = 8
const entry = 'C1|f1|' + JSON.stringify([201, 'application/json; charset=utf-8', {}, 0, Date.now()]) + '{"id":"ord_1","status":"created","amount":4200,"currency":"eur"}'
const MINIMAL = "if redis.call('GETRANGE', KEYS[1], '0', '37') ~= ARGV[1] then return 0 end redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1"

function totals (): number {
  const files = readdirSync(dir).filter((name) => name.startsWith('cg.out')).sort((a, b) => Number(a.split('.').pop()) - Number(b.split('.').pop()))
  const text = readFileSync(`${dir}/${files.at(-1)}`, 'utf8')
  return Number(/^totals: (\d+)/m.exec(text)![1])
}

async function main (): Promise<void> {
  const client = new Redis({ port })
  const storage = new RedisStorage({ client, prefix: 'fence:' })
  const minimalSha = await client.script('LOAD', MINIMAL) as string
  await client.call('FUNCTION', 'LOAD', 'REPLACE', `#!lua name=fence\nredis.register_function('fence_end', function(keys, args) ${MINIMAL.replaceAll('KEYS', 'keys').replaceAll('ARGV', 'args')} end)`)
  let unique = 0
  const variants: Record<string, () => Promise<void>> = {
    plain: async () => {
      const key = `plain:{${++unique}}`
      await client.set(key, 'in-flight', 'PX', 60_000, 'NX')
      await client.set(key, entry, 'PX', 2000)
    },
    ours: async () => {
      const key = `k${++unique}`
      const lease = await storage.begin(key, 'f1', 60_000)
      if (lease.state !== 'acquired' || !await storage.complete(key, lease.token, { statusCode: 201, contentType: 'application/json; charset=utf-8', headers: {}, body: Buffer.from('{"id":"ord_1","status":"created","amount":4200,"currency":"eur"}') }, 2000)) throw new Error('not stored')
    },
    minimal: async () => {
      const key = `minimal:{${++unique}}`
      const lease = 'L' + String(unique).padStart(36, '0') + '-' + String(Date.now() + 60_000) + '|f1'
      await client.set(key, lease, 'PX', 60_000, 'NX', 'GET')
      if (await client.evalsha(minimalSha, 1, key, lease.slice(0, 38), entry, 2000) !== 1) throw new Error('not stored')
    },
    'first-wins': async () => {
      const id = ++unique
      const replies = await client.pipeline().get(`first:{${id}}:response`).set(`first:{${id}}`, 'L' + String(id).padStart(36, '0') + '-' + String(Date.now() + 60_000) + '|f1', 'PX', 60_000, 'NX', 'GET').exec() as Array<[Error | null, unknown]>
      const [[, stored], [, held]] = replies as [[Error | null, unknown], [Error | null, unknown]]
      if (stored !== null || held !== null) throw new Error('not free')
      if (await client.set(`first:{${id}}:response`, entry, 'PX', 2000, 'NX') !== 'OK') throw new Error('not stored')
    },
    rename: async () => {
      const id = ++unique
      const key = `rename:{${id}}`
      const token = String(id).padStart(36, '0')
      const lease = 'L' + token + '-' + String(Date.now() + 60_000) + '|f1'
      const begun = await client.multi().set(key, lease, 'PX', 60_000, 'NX', 'GET').set(`${key}:${token}`, '', 'PX', 60_000).exec() as Array<[Error | null, unknown]>
      if (begun[0]![1] !== null) throw new Error('not free')
      const ended = await client.multi().getrange(key, 0, 37).call('SET', `${key}:${token}`, entry, 'XX', 'PX', '2000').rename(`${key}:${token}`, key).exec() as Array<[Error | null, unknown]>
      if (ended[2]![0] !== null) throw new Error('not stored')
    },
    function: async () => {
      const key = `function:{${++unique}}`
      const lease = 'L' + String(unique).padStart(36, '0') + '-' + String(Date.now() + 60_000) + '|f1'
      await client.set(key, lease, 'PX', 60_000, 'NX', 'GET')
      if (await client.fcall('fence_end', 1, key, lease.slice(0, 38), entry, 2000) !== 1) throw new Error('not stored')
    }
  }
  for (const [name, once] of Object.entries(variants)) {
    const run = async (n: number): Promise<void> => {
      for (let done = 0; done < n; done += PER_TURN) await Promise.all(Array.from({ length: PER_TURN }, once))
    }
    await run(3000)
    execFileSync('callgrind_control', ['-z', pid], { stdio: 'ignore' })
    await run(count)
    execFileSync('callgrind_control', ['-d', pid], { stdio: 'ignore' })
    process.stdout.write(`${name}: ${Math.round(totals() / count)} Redis instructions per first request\n`)
  }
  await client.quit()
}

await main()
