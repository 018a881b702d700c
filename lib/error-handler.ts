import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { isIdempotencyError, type IdempotencyError } from './errors.js'

/** An error handler as `setErrorHandler` takes it. */
export type ErrorHandler = (this: FastifyInstance, error: FastifyError, request: FastifyRequest, reply: FastifyReply) => unknown

export interface IdempotencyErrorHandlerOptions {
  /** Handles every error that is not the plugin's. Without it, Fastify's own handling applies. */
  fallback?: ErrorHandler
}

/** The RFC 9457 problem details body for one of the plugin's errors. */
export interface IdempotencyProblem {
  type: string
  title: string
  status: number
  detail: string
  idempotencyKey?: string
}

export function toProblem (error: IdempotencyError): IdempotencyProblem {
  const problem: IdempotencyProblem = { type: error.type, title: error.title, status: error.statusCode, detail: error.message }
  if (error.idempotencyKey !== undefined) problem.idempotencyKey = error.idempotencyKey
  return problem
}

/**
 * A Fastify error handler that answers the plugin's errors with `application/problem+json`
 * (`type`, `title`, `status`, `detail`, `idempotencyKey`) and passes every other error on:
 *
 *   app.setErrorHandler(idempotencyErrorHandler())
 *   app.setErrorHandler(idempotencyErrorHandler({ fallback: myHandler }))
 *
 * The plugin never installs it itself: error handlers are encapsulated and one per context.
 */
export function idempotencyErrorHandler (options: IdempotencyErrorHandlerOptions = {}): ErrorHandler {
  const { fallback } = options
  return function handleIdempotencyError (this: FastifyInstance, error: FastifyError, request: FastifyRequest, reply: FastifyReply) {
    if (isIdempotencyError(error)) {
      return reply
        .code(error.statusCode)
        .headers(error.headers)
        .type('application/problem+json')
        .send(toProblem(error))
    }
    if (fallback !== undefined) return fallback.call(this, error, request, reply)
    // Sending the error from inside an error handler hands it to the parent handler, and at the
    // root to Fastify's default one (status, headers, logging), as if this handler were absent.
    return reply.send(error)
  }
}
