/**
 * One identity per error class across every copy of this package's code in a process.
 *
 * A process may hold several copies of a class: two versions of the package may share one app
 * (an application's and a dependency's), the command runs a store from the user's configuration,
 * which may come from another install, and the tests load the sources again. (One install's
 * entries and module formats share one build: tsup.config.ts.) A plain `instanceof` then fails
 * across copies: an entry the knex store cannot read would be taken
 * for a store outage (503, and with `failOpen` a second run of the handler) instead of the 409 it
 * is. So the classes that cross those boundaries answer `instanceof` by a brand, a symbol from the
 * global registry that every copy's instances carry, named by a stable id.
 */

const brands = new WeakMap<object, symbol>()
const nativeInstanceOf = Function.prototype[Symbol.hasInstance]

function hasBrand (this: object, value: unknown): boolean {
  const brand = brands.get(this)
  // A subclass that was not given an identity of its own is checked as usual.
  if (brand === undefined) return nativeInstanceOf.call(this, value)
  return typeof value === 'object' && value !== null && (value as Record<symbol, unknown>)[brand] === true
}

/**
 * Make `instanceof errorClass` true for instances of any copy of it, known by `id`. Every subclass
 * that needs its own identity calls this too (one that does not is checked natively).
 */
export function shareIdentity (errorClass: abstract new (...args: never[]) => Error, id: string): void {
  const brand = Symbol.for(`fastify-idempotency.${id}`)
  brands.set(errorClass, brand)
  Object.defineProperty(errorClass.prototype, brand, { value: true })
  Object.defineProperty(errorClass, Symbol.hasInstance, { value: hasBrand, configurable: true })
}
