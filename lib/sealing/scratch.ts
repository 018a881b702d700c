/**
 * Text written as UTF-16LE into one reused buffer, for a call that reads it at once (a keyed hash,
 * a cipher's associated data): no Buffer is made per call, and a view of the buffer is made once
 * per length (keys of a service mostly have one or two lengths, and a keyed hash has one).
 */
export class Utf16Scratch {
  readonly #buffer: Buffer
  readonly #views: Buffer[] = []

  constructor (bytes: number) {
    this.#buffer = Buffer.allocUnsafeSlow(bytes)
  }

  /** `text` as UTF-16LE, valid until the next call; a Buffer of its own when it does not fit. */
  bytes (text: string): Buffer {
    if (text.length * 2 > this.#buffer.length) return Buffer.from(text, 'utf16le')
    const length = this.#buffer.write(text, 'utf16le')
    let view = this.#views[length]
    if (view === undefined) this.#views[length] = view = this.#buffer.subarray(0, length)
    return view
  }
}
