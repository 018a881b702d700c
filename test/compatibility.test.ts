/**
 * Which Fastify the plugin loads on. fastify-plugin's metadata (`fastify: '...'`) is checked by
 * Fastify itself when the plugin is registered, against the version the instance reports: a
 * range that leaves out 6.0.0 refuses to load on it the day it ships, whatever the code can do.
 * Each case registers the plugin on an instance that reports the version, so that Fastify's own
 * check runs; and the peer range of package.json says the same of releases. (Pre-releases of the
 * next major load through Fastify's own rule for them; npm's peer check leaves pre-releases out.)
 */
import { describe, expect, it } from 'vitest'
import { readFileSync } from 'node:fs'
import Fastify from 'fastify'
import semver from 'semver'
import idempotency from '../lib/index.js'

const peerRange = (JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')) as { peerDependencies: Record<string, string> }).peerDependencies.fastify!

async function registerOn (version: string): Promise<unknown> {
  const app = Fastify()
  Object.defineProperty(app, 'version', { value: version })
  try {
    await app.register(idempotency)
    await app.ready()
    return null
  } catch (error) {
    return error
  } finally {
    await app.close()
  }
}

describe('the Fastify versions the plugin loads on', () => {
  for (const version of ['5.0.0', '5.12.8', '6.0.0', '6.4.2']) {
    it(`loads on Fastify ${version}, which the peer range admits`, async () => {
      expect(await registerOn(version)).toBeNull()
      expect(semver.satisfies(version, peerRange)).toBe(true)
    })
  }

  for (const version of ['6.0.0-alpha.4', '6.0.0-rc.1']) {
    it(`loads on the pre-release Fastify ${version}`, async () => {
      expect(await registerOn(version)).toBeNull()
    })
  }

  for (const version of ['4.29.1', '7.0.0']) {
    it(`refuses Fastify ${version} (untested), as the peer range does`, async () => {
      expect(await registerOn(version)).toMatchObject({ code: 'FST_ERR_PLUGIN_VERSION_MISMATCH' })
      expect(semver.satisfies(version, peerRange)).toBe(false)
    })
  }
})
