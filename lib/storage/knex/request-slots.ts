/**
 * How many request transactions a KnexStorage lets be open at once: one fewer than knex's pool has
 * connections, so that a connection is always left for what those requests need while they hold
 * theirs (a recovery point's record and transaction, the lease's renewals, other keys' `begin`).
 * When every connection was held by a request transaction, each request's step waited for a
 * connection only another request could free, and all of them waited for the plugin's timeout.
 * Requests beyond the bound wait here, in order of arrival, holding no connection.
 */
import type { Knex } from 'knex'

/** knex's pool size when its configuration gives none. */
const KNEX_DEFAULT_POOL = 10

/** The most connections knex's pool opens. */
export function poolSize (knex: Knex): number {
  const client = knex.client as { pool?: { max?: unknown }, config?: { pool?: { max?: unknown } } }
  const max = Number(client.pool?.max ?? client.config?.pool?.max ?? KNEX_DEFAULT_POOL)
  return Number.isSafeInteger(max) && max > 0 ? max : KNEX_DEFAULT_POOL
}

export class RequestSlots {
  #free: number
  readonly #waiting: Array<() => void> = []

  /** A pool of one (SQLite) still lets one request transaction open. */
  constructor (knex: Knex) {
    this.#free = Math.max(1, poolSize(knex) - 1)
  }

  /** Resolves with the slot's release (idempotent) once one is free. */
  async take (): Promise<() => void> {
    return this.takeFree() ?? await this.#wait()
  }

  /** A slot's release when one is free now, without waiting; `undefined` when none is. */
  takeFree (): (() => void) | undefined {
    if (this.#free === 0) return undefined
    this.#free--
    return this.#release()
  }

  async #wait (): Promise<() => void> {
    await new Promise<void>((resolve) => this.#waiting.push(resolve))
    return this.#release()
  }

  #release (): () => void {
    let released = false
    return () => {
      if (released) return
      released = true
      const next = this.#waiting.shift()
      if (next !== undefined) next()
      else this.#free++
    }
  }
}
