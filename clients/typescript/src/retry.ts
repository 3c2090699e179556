/**
 * How long the client keeps trying, and how long it pauses in between: the same policy as
 * calmq's Python client (exponential backoff with jitter, never sooner than the API's
 * `Retry-After`), so a fleet of clients does not come back in step after an outage.
 */

export interface RetryPolicy {
  /** Tries in all (1 turns retrying off). */
  attempts: number;
  /** Give up once this much time (ms) has passed since the first try. */
  maxElapsedMs: number;
  /** The first pause (ms); each later one doubles, up to `maxDelayMs`. */
  initialDelayMs: number;
  maxDelayMs: number;
  /** The statuses a retry may cure: the API or a proxy in front of it shed load. */
  statuses: ReadonlySet<number>;
}

export const DEFAULT_RETRY: RetryPolicy = Object.freeze({
  attempts: 8,
  maxElapsedMs: 120_000,
  initialDelayMs: 200,
  maxDelayMs: 10_000,
  statuses: new Set([429, 502, 503, 504]),
});

/** The pause before try `n + 1` after `n` failed tries: jittered over [half, whole] of the
 * exponential step, so that a later pause is never much shorter than an earlier one. */
export function backoffMs(policy: RetryPolicy, failures: number): number {
  const step = Math.min(policy.maxDelayMs,
                        policy.initialDelayMs * 2 ** Math.max(0, failures - 1));
  return step / 2 + Math.random() * (step / 2);
}

/** `Retry-After` in ms: delta-seconds or an HTTP date; undefined when absent or unreadable. */
export function retryAfterMs(value: string | null, now: number = Date.now()): number | undefined {
  if (value === null || value.trim() === "") return undefined;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const when = Date.parse(value);
  return Number.isNaN(when) ? undefined : Math.max(0, when - now);
}

/** Resolves after `ms`, or rejects at once when `signal` aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
