/**
 * How the option table (table.ts) is read. Each field of the settings names the options it is
 * made from, with their JSON Schema, and one function makes it from the options in force. The
 * plugin's options are one layer; a route's `config.idempotency` is a second layer over them, so
 * the plugin and a route go through the same function for every field, and a field no option of
 * the route's layer touches is the plugin's, as it is.
 */
import type { IdempotencyStorage } from '../storage/types.js'

/** A JSON Schema (Ajv checks it). */
export type Schema = object

/** What making a field knows besides the options in force. */
export interface FieldContext<O> {
  /** Whose options these are, for messages: `options`, or `config.idempotency of route POST /pay`. */
  readonly name: string
  /** The registration's store. */
  readonly storage: IdempotencyStorage
  /** Every layer, the plugin's first: for a field made by folding them (status codes added and removed). */
  readonly layers: readonly O[]
  /** The layer being normalized: the plugin's, or the route's. */
  readonly layer: O
}

/** The options a field reads: those it is made from, and those of other fields it depends on. */
type Read<O, S, U extends keyof O> = Pick<O, (keyof S & keyof O) | U>

export interface Field<O, S, U extends keyof O, T> {
  /** The options this field is made from, each with its JSON Schema, in the schema's order. */
  readonly options: S
  /** Options of other fields it reads too: a route that sets one makes this field again. */
  readonly uses: readonly U[]
  /** What JSON Schema cannot check of the layer being normalized (functions, the store), before any field is made. */
  readonly check?: (layer: Read<O, S, U>, context: FieldContext<Read<O, S, U>>) => void
  /** The field, from the options in force: of each, the innermost layer's value, if any sets it. */
  readonly normalize: (options: Read<O, S, U>, context: FieldContext<Read<O, S, U>>) => T
}

// `any` for the fields of a table, whose options and values differ from field to field.
type AnyField<O> = Field<O, any, any, unknown>
export type Fields<O> = Record<string, AnyField<O>>

/** The settings a table of fields makes. */
export type SettingsOf<F> = { [K in keyof F]: F[K] extends { normalize: (...args: never[]) => infer T } ? T : never }

type UnionToIntersection<U> = (U extends unknown ? (union: U) => void : never) extends (intersection: infer I) => void ? I : never
/** The JSON Schema properties of a table's options. */
export type PropertiesOf<F> = UnionToIntersection<{ [K in keyof F]: F[K] extends { options: infer S } ? S : never }[keyof F]>

/** The field maker for options of type `O`, which infers from each field what it reads and makes. */
export function fieldsOf<O> () {
  return <const S extends { [P in keyof O]?: Schema }, T, U extends keyof O = never>(field: {
    options: S
    uses?: readonly U[]
    check?: Field<O, S, U, T>['check']
    normalize: Field<O, S, U, T>['normalize']
  }): Field<O, S, U, T> => ({ ...field, uses: field.uses ?? [] })
}

/** The JSON Schema properties of a table's options, in its order. */
export function propertiesOf<F extends Fields<never>> (fields: F): PropertiesOf<F> {
  return Object.assign({}, ...Object.values(fields).map((field) => field.options))
}

function optionsRead (field: AnyField<unknown>): string[] {
  return [...Object.keys(field.options), ...field.uses as string[]]
}

/** Runs the checks JSON Schema cannot make of `layer`, field by field in the table's order. */
export function checkFields<O extends object> (fields: Fields<O>, layer: O, context: Omit<FieldContext<O>, 'layers' | 'layer'>): void {
  for (const field of Object.values(fields)) field.check?.(layer as never, { ...context, layers: [layer], layer } as never)
}

/**
 * Makes every field of `fields` from `layers` (the plugin's options, then a route's, if any). A
 * field the last layer sets none of the options of is `base`'s (the plugin's settings): made
 * again it would be equal, and keeping the same object keeps what is cached by it (the
 * fingerprint settings' candidates, fingerprint/record.ts) shared by the routes.
 */
export function normalizeFields<O extends object, F extends Fields<O>> (fields: F, layers: readonly O[], base: SettingsOf<F> | null, context: Omit<FieldContext<O>, 'layers' | 'layer'>): SettingsOf<F> {
  const layer = layers[layers.length - 1]!
  const fieldContext = { ...context, layers, layer }
  const settings: Record<string, unknown> = {}
  for (const [name, field] of Object.entries(fields)) {
    const read = optionsRead(field)
    if (base !== null && read.every((option) => (layer as Record<string, unknown>)[option] === undefined)) {
      settings[name] = base[name as keyof F]
      continue
    }
    settings[name] = field.normalize(inForce(layers, read) as never, fieldContext as never)
  }
  return settings as SettingsOf<F>
}

/** Of each option in `names`, the innermost layer's value (`undefined` when no layer sets it). */
function inForce<O extends object> (layers: readonly O[], names: string[]): O {
  const options: Record<string, unknown> = {}
  for (const name of names) {
    for (const layer of layers) {
      const value = (layer as Record<string, unknown>)[name]
      if (value !== undefined) options[name] = value
    }
  }
  return options as O
}
