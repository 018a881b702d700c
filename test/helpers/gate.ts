/**
 * A handler that holds its request until the test lets it go: `entered` resolves when a request is
 * inside, `open()` lets every held request through. Tests synchronize on it instead of sleeping.
 */
export class Gate {
  #enter!: () => void
  #open!: () => void
  /** Resolves when the first request is being held. */
  readonly entered = new Promise<void>((resolve) => { this.#enter = resolve })
  readonly #opened = new Promise<void>((resolve) => { this.#open = resolve })

  /** Called by the handler: hold here until `open()`. */
  async hold (): Promise<void> {
    this.#enter()
    await this.#opened
  }

  open (): void {
    this.#open()
  }
}
