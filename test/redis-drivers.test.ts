/**
 * What each RedisStorage driver takes for Redis's own answer (and so for a command that ran) and
 * what for its own failure (a command that may or may not have run), without a server: the
 * errors each client library makes.
 */
import { describe, expect, it } from 'vitest'
import { ReplyError } from 'ioredis'
import { ErrorReply, SimpleError } from '@redis/client'
import { RequestError, ClosingError, TimeoutError } from '@valkey/valkey-glide'
import { driverFor } from '../lib/storage/redis/driver.js'

const ioredis = driverFor({ defineCommand () {}, evalsha () {}, pipeline: () => ({ echo () {}, _queue: [] }), options: {} })!
const nodeRedis = driverFor({ sendCommand () {}, withTypeMapping () {} })!
const glide = driverFor({ customCommand () {}, invokeScript () {} })!

describe('Redis drivers', () => {
  it('are chosen by what the client is, and none for anything else', () => {
    expect([ioredis.family, nodeRedis.family, glide.family]).toEqual(['ioredis', 'node-redis', 'Valkey GLIDE'])
    for (const other of [null, undefined, 'redis://', {}, { sendCommand () {} }]) expect(driverFor(other)).toBeNull()
    // node-redis 4's client: commandOptions, and no withTypeMapping.
    expect(() => driverFor({ sendCommand () {}, commandOptions () {} })).toThrow(/node-redis 4 is not supported/)
  })

  it('read a Redis error by its first word, and find none in a failure of their own', () => {
    expect(ioredis.replyCode(new ReplyError('OOM command not allowed'))).toBe('OOM')
    expect(ioredis.replyCode(new Error('Command timed out'))).toBeNull()
    expect(nodeRedis.replyCode(new SimpleError('NOSCRIPT No matching script'))).toBe('NOSCRIPT')
    expect(nodeRedis.replyCode(new ErrorReply('WRONGTYPE Operation against a key'))).toBe('WRONGTYPE')
    expect(nodeRedis.replyCode(new Error('The client is closed'))).toBeNull()
    expect(nodeRedis.replyCode('not an error')).toBeNull()
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - NoScriptError: No matching script. Please use EVAL.'))).toBe('NOSCRIPT')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - ResponseError: OOM command not allowed'))).toBe('OOM')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - ExtensionError: OOM: command not allowed'))).toBe('OOM')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - ResponseError: something else'))).toBe('ResponseError')
    expect(glide.replyCode(new RequestError('WRONGTYPE: Operation against a key holding the wrong kind of value'))).toBe('WRONGTYPE')
    expect(glide.replyCode(new RequestError("An error was signalled by the server: - PermissionDenied: this user has no permissions to run the 'evalsha' command"))).toBe('NOPERM')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - ReadOnly: You can\'t write against a read only replica.'))).toBe('READONLY')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - BusyLoadingError: Redis is loading the dataset in memory'))).toBe('LOADING')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - MasterDown: Link with MASTER is down'))).toBe('MASTERDOWN')
    expect(glide.replyCode(new RequestError('An error was signalled by the server: - IoError: broken pipe'))).toBeNull()
    expect(glide.replyCode(new RequestError('connection refused'))).toBeNull()
    expect(glide.replyCode(new ClosingError('the client is closed'))).toBeNull()
    expect(glide.replyCode(new TimeoutError('timed out'))).toBeNull()
  })
})
