import { shareIdentity } from './error-identity.js'

/**
 * What a store throws from `begin` when the value under a key is one it cannot read: written in a
 * layout of another version (an older or a newer release), or damaged. The plugin answers 409
 * (IdempotencyStoredResponseUnreadableError) without running the handler, even with `failOpen`,
 * and nothing writes over the value: the operation it records may well have happened. Encryption
 * throws it too, for an entry it cannot open.
 */
export class UnreadableEntryError extends Error {
  constructor (message: string, options?: ErrorOptions) {
    super(message, options)
    this.name = 'UnreadableEntryError'
  }
}
shareIdentity(UnreadableEntryError, 'UnreadableEntryError')
