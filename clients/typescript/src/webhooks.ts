/**
 * Standard Webhooks verification (https://www.standardwebhooks.com), as calmq signs its
 * callbacks (producers/webhooks.py): `webhook-id`, `webhook-timestamp` (unix seconds) and
 * `webhook-signature`, a space-separated list of `v1,<base64 HMAC-SHA256>` over
 * `<webhook-id>.<webhook-timestamp>.<raw body>`. During a secret rotation's grace calmq
 * sends one signature per valid secret; any one that verifies is enough.
 *
 * Web Crypto only, so the same function runs in Node, Deno, Bun, edge runtimes and
 * browsers.
 *
 * The body is the standard's shape, `{type, timestamp, data}` (calmq's webhook payload
 * version 2, the default). calmq's first body, `{event, job}` (`CALMQ_WEBHOOK_PAYLOAD_VERSION=1`,
 * kept for one release), is returned in the same shape, so a receiver moved to this one
 * works before and after the server switches.
 */

import { WebhookVerificationError } from "./errors.js";
import type { Job } from "./types.js";

/** The terminal events a callback is sent for. */
export type WebhookEventType = "job.completed" | "job.dead_lettered" | "job.cancelled";

/** A verified callback: Standard Webhooks' `{type, timestamp, data}`. */
export interface WebhookEvent {
  type: WebhookEventType;
  /** ISO 8601: when the job's terminal event was recorded (the same on every retry). */
  timestamp: string;
  /** The job's status document, as `GET /v1/jobs/{id}` answers it then. */
  data: Job;
}

export interface VerifyOptions {
  /** How far (seconds) the timestamp may be from now, either way: replays older than
   * this are refused. Default 300, as the standard's libraries. */
  toleranceSeconds?: number;
  /** "Now" in unix seconds, for tests. */
  now?: number;
}

type HeaderSource = Headers | Record<string, string | string[] | undefined>;

const encoder = new TextEncoder();

/**
 * Checks a received callback and returns its body as a {@link WebhookEvent}; throws
 * WebhookVerificationError when a header is missing, the timestamp is outside the
 * tolerance, or no signature verifies.
 *
 * `secret`: the tenant's webhook secret as `calmq tenants webhook-secret NAME` prints it,
 * or in the standard's `whsec_<base64 key>` form. `body`: the raw bytes received, before
 * any JSON parsing (a re-serialised body does not verify).
 */
export async function verifyWebhook(secret: string, headers: HeaderSource,
                                    body: string | Uint8Array | ArrayBuffer,
                                    options: VerifyOptions = {}): Promise<WebhookEvent> {
  const id = header(headers, "webhook-id");
  const timestamp = header(headers, "webhook-timestamp");
  const signatures = header(headers, "webhook-signature");
  if (!id || !timestamp || !signatures) {
    throw new WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature");
  }
  if (!/^\d{1,15}$/.test(timestamp)) {
    throw new WebhookVerificationError("webhook-timestamp is not unix seconds");
  }
  const now = options.now ?? Math.floor(Date.now() / 1000);
  const tolerance = options.toleranceSeconds ?? 300;
  if (Math.abs(now - Number(timestamp)) > tolerance) {
    throw new WebhookVerificationError("webhook-timestamp is outside the tolerance");
  }
  const raw = bytes(body);
  const signed = concat(encoder.encode(`${id}.${timestamp}.`), raw);
  const key = await crypto.subtle.importKey("raw", keyBytes(secret),
                                            { name: "HMAC", hash: "SHA-256" }, false,
                                            ["verify"]);
  for (const entry of signatures.split(" ")) {
    const [version, value] = entry.split(",", 2);
    if (version !== "v1" || !value) continue;
    let given: Uint8Array<ArrayBuffer>;
    try {
      given = fromBase64(value);
    } catch {
      continue;
    }
    // subtle.verify compares in constant time.
    if (await crypto.subtle.verify("HMAC", key, given, signed)) {
      return asEvent(JSON.parse(new TextDecoder().decode(raw)) as Record<string, unknown>,
                     Number(timestamp));
    }
  }
  throw new WebhookVerificationError("no signature matches");
}

function asEvent(body: Record<string, unknown>, sentAt: number): WebhookEvent {
  if (typeof body.type === "string") return body as unknown as WebhookEvent;
  // Payload version 1: {"event": "completed", "job": {...}}. It carried no event time; the
  // signed send time stands in for it.
  return {
    type: `job.${String(body.event)}` as WebhookEventType,
    timestamp: new Date(sentAt * 1000).toISOString(),
    data: body.job as Job,
  };
}

function header(headers: HeaderSource, name: string): string | undefined {
  if (typeof (headers as Headers).get === "function") {
    return (headers as Headers).get(name) ?? undefined;
  }
  const record = headers as Record<string, string | string[] | undefined>;
  for (const [key, value] of Object.entries(record)) {
    if (key.toLowerCase() === name) return Array.isArray(value) ? value.join(" ") : value;
  }
  return undefined;
}

function keyBytes(secret: string): Uint8Array<ArrayBuffer> {
  // whsec_: the standard's form, base64 of the key; otherwise the key is the secret's
  // UTF-8, as calmq stores and prints it (producers.webhooks.standard_secret).
  return secret.startsWith("whsec_") ? fromBase64(secret.slice(6)) : encoder.encode(secret);
}

function bytes(body: string | Uint8Array | ArrayBuffer): Uint8Array<ArrayBuffer> {
  if (typeof body === "string") return encoder.encode(body);
  if (body instanceof ArrayBuffer) return new Uint8Array(body);
  return new Uint8Array(body);
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(a.length + b.length);
  out.set(a, 0);
  out.set(b, a.length);
  return out;
}

function fromBase64(text: string): Uint8Array<ArrayBuffer> {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}
