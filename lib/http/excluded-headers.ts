/**
 * Response headers that are never stored nor replayed, whatever the options, by reason
 * (docs/headers.md and docs/security.md explain each).
 */
export const ALWAYS_EXCLUDED_HEADERS: readonly string[] = [
  // Hop-by-hop: they describe one connection, not the response.
  'connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'proxy-connection',
  'te', 'trailer', 'transfer-encoding', 'upgrade',
  // One transmission: recomputed for the replay (content-length, date), or kept apart (content-type).
  'content-length', 'date', 'content-type',
  // Per request: set by the current request's own hooks (CORS for its origin, its id, its trace,
  // its rate limit), which a replay must not overwrite with the first request's.
  'access-control-allow-origin', 'access-control-allow-credentials', 'access-control-allow-methods',
  'access-control-allow-headers', 'access-control-expose-headers', 'access-control-max-age',
  'x-request-id', 'request-id', 'x-correlation-id', 'traceparent', 'tracestate', 'server-timing',
  'x-response-time', 'ratelimit', 'ratelimit-policy', 'ratelimit-limit', 'ratelimit-remaining',
  'ratelimit-reset', 'x-ratelimit-limit', 'x-ratelimit-remaining', 'x-ratelimit-reset',
  // Credentials: a response header that carries one must never reach another request.
  'authorization', 'x-api-key', 'x-auth-token', 'x-csrf-token', 'x-xsrf-token'
]
