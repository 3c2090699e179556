/**
 * The client's errors: one root class, so that `catch (e) { if (e instanceof CalmqError) }`
 * takes everything this package throws, and the API's problem+json fields kept as sent.
 */

/** The root of every error this package throws. */
export class CalmqError extends Error {
  override name = "CalmqError";
}

/** A problem+json answer of the API: `status` and the stable `code` as the API sent them. */
export class ApiError extends CalmqError {
  override name = "ApiError";
  readonly status: number;
  readonly code: string;
  readonly title: string | undefined;
  readonly type: string | undefined;
  /** How long (ms) the API asked to wait before trying again (its `Retry-After`), if any. */
  readonly retryAfterMs: number | undefined;

  constructor(status: number, code: string, detail: string,
              extra: { title?: string; type?: string; retryAfterMs?: number } = {}) {
    super(detail);
    this.status = status;
    this.code = code;
    this.title = extra.title;
    this.type = extra.type;
    this.retryAfterMs = extra.retryAfterMs;
  }
}

/** A webhook whose signature, timestamp or headers do not verify. */
export class WebhookVerificationError extends CalmqError {
  override name = "WebhookVerificationError";
}
