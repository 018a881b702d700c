import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { isIdempotencyError, type IdempotencyError } from './errors.js'
import { transactionConflictOf } from './http/request-context.js'

/** An error handler as `setErrorHandler` takes it. */
export type ErrorHandler = (this: FastifyInstance, error: FastifyError, request: FastifyRequest, reply: FastifyReply) => unknown

/** Options of `idempotencyErrorHandler`. */
export interface IdempotencyErrorHandlerOptions {
  /** Handles every error that is not the plugin's. Without it, Fastify's own handling applies. */
  fallback?: ErrorHandler
}

/** The RFC 9457 problem details body for one of the plugin's errors. */
export interface IdempotencyProblem {
  /** The problem type: a URI naming the error, its section in docs/errors.md. */
  type: string
  /** A short summary, the same for every problem of the type. */
  title: string
  /** The HTTP status code, as sent. */
  status: number
  /** What happened to this request. */
  detail: string
  /** The client's `Idempotency-Key`, when the request had one. */
  idempotencyKey?: string
}

/** The media type of the plugin's answers, with the charset Fastify adds to a JSON body. */
const PROBLEM_CONTENT_TYPE = 'application/problem+json; charset=utf-8'

/**
 * The RFC 9457 body for one of the plugin's errors, for an error handler of your own that answers
 * in problem+json.
 */
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
    // A handler whose transaction conflicted with another (transaction mode) is answered as a failed commit.
    const problem = isIdempotencyError(error) ? error : transactionConflictOf(request)
    if (problem !== null) {
      // Bytes, with their media type: Fastify sends them as they are. An object would go through
      // the route's response schema for the status (a `409`, `4xx` or `default` of the route's own,
      // which would strip the problem's members), its serializer compiler or its type provider's
      // (zod's, which would fail on it): the plugin's answers are its own, whatever the route.
      return reply
        .code(problem.statusCode)
        .headers(problem.headers)
        .type(PROBLEM_CONTENT_TYPE)
        .send(Buffer.from(JSON.stringify(toProblem(problem))))
    }
    if (fallback !== undefined) return fallback.call(this, error, request, reply)
    // Sending the error from inside an error handler hands it to the parent handler, and at the
    // root to Fastify's default one (status, headers, logging), as if this handler were absent.
    return reply.send(error)
  }
}
