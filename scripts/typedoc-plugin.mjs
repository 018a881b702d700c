// @ts-check
/**
 * The API reference's one local rule: `optionsSchema` and `routeConfigSchema` are JSON Schema
 * objects whose literal types spell out every option a second time. The reference lists them as
 * objects (with their doc comments, pointing to the options page), not as hundreds of nested
 * properties that would each need a comment of their own.
 */
import { Converter, IntrinsicType, ReflectionKind, ReflectionType } from 'typedoc'

const SCHEMAS = new Set(['optionsSchema', 'routeConfigSchema'])

/** @param {import('typedoc').Application} app */
export function load (app) {
  app.converter.on(Converter.EVENT_RESOLVE_BEGIN, (context) => {
    for (const variable of context.project.getReflectionsByKind(ReflectionKind.Variable)) {
      if (!SCHEMAS.has(variable.name) || !('type' in variable) || !(variable.type instanceof ReflectionType)) continue
      context.project.removeReflection(variable.type.declaration)
      variable.type = new IntrinsicType('object')
    }
  })
}
