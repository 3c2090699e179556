/**
 * The client of calmq's intake API: submit, read, list, cancel, download, and follow a job
 * over server-sent events. Needs only `fetch` (Node 20.3+, browsers, Deno, Bun, edge).
 *
 * It rides out a bad minute the way calmq's Python client does: a read, or a submit that
 * carries an idempotency key, is tried again after a dropped connection or a 429/502/503/
 * 504, with jittered backoff and never sooner than the API's `Retry-After`; a submit
 * without a key is tried again only when the API refused it before writing anything (429,
 * 503), so a retry can never make a second job. The event stream reconnects with
 * `Last-Event-ID`, so across a dropped connection or an API restart no event is missed
 * and none is repeated.
 */

import { ApiError, CalmqError } from "./errors.js";
import { backoffMs, DEFAULT_RETRY, retryAfterMs, sleep, type RetryPolicy } from "./retry.js";
import { readEvents } from "./sse.js";
import type {
  Accepted, Answered, BulkJob, BulkResult, Job, JobPage, JobStreamEvent, OutputDeltaEvent,
  OutputResetEvent, OutputPiece, Priority, RerunAccepted, Status,
} from "./types.js";

export interface ClientOptions {
  /** The API's address, e.g. `http://127.0.0.1:8080`. */
  baseUrl: string;
  /** A tenant's API key (`calmq tenants create NAME` prints one). */
  apiKey: string;
  /** Overrides of the retry policy (DEFAULT_RETRY); `{ attempts: 1 }` turns retries off. */
  retry?: Partial<RetryPolicy>;
  /** A fetch to use instead of the global one. */
  fetch?: typeof fetch;
  /** A call whose answer has not come within this many ms is abandoned (and, where safe,
   * tried again). Default 30000. */
  timeoutMs?: number;
  /** An event stream that brings nothing for this long is reconnected. The API sends a
   * keep-alive every 15 s, so only a dead connection is this quiet. Default 45000. */
  streamIdleMs?: number;
}

export interface SubmitOptions {
  priority?: Priority;
  deadlineSeconds?: number;
  callbackUrl?: string;
  metadata?: Record<string, unknown>;
  /** An object already in the store (instead of `input`). */
  inputRef?: string;
  lane?: "online" | "batch";
  concurrencyKey?: string;
  /** The `Idempotency-Key`: the same key with the same body answers the same job. `true`
   * makes one for this call, so that it may also be retried after a dropped connection.
   * Without one a submit is retried only when the API refused it (429, 503). */
  idempotencyKey?: string | true;
  /** Seconds to wait for the job to finish in the same request (`Prefer: wait=N`; the API
   * holds it at most its api_prefer_wait_max_seconds). A job final by then is answered
   * whole, with `result`; otherwise the usual 202. */
  wait?: number;
  signal?: AbortSignal;
}

export interface RerunOptions {
  /** The input the rerun starts from, in place of the original's (its workflow's rules). */
  input?: Record<string, unknown>;
  priority?: Priority;
  /** The `Idempotency-Key`, as a submit's: the same key with the same arguments answers
   * the same new job (another call under it: 409 `idempotency_key_reused`). `true` makes
   * one for this call, so that it may also be retried after a dropped connection. */
  idempotencyKey?: string | true;
  signal?: AbortSignal;
}

export interface SubmitManyOptions {
  /** Jobs a request, 1 to 1000 (the API's api_bulk_max_jobs). Default 1000. */
  chunkSize?: number;
  /** Default true: an item without an `idempotency_key` gets one for this call, so a chunk
   * whose answer was lost is sent again without writing any job twice. `false` sends no
   * keys of its own: a chunk is then retried only when the API refused it (429, 503). */
  idempotent?: boolean;
  signal?: AbortSignal;
}

export interface ListFilters {
  /** One status or several (sent as a comma list). */
  status?: Status | Status[];
  workflow?: string;
  createdAfter?: string | Date;
  createdBefore?: string | Date;
  limit?: number;
  cursor?: string;
  /** Only jobs whose metadata holds each of these string values (`metadata.KEY=VALUE`). */
  metadata?: Record<string, string>;
  signal?: AbortSignal;
}

export interface StreamOptions {
  /** An event id to resume after (an event's `id`). */
  after?: string;
  signal?: AbortSignal;
}

/** Which failures a call may be tried again after. */
type Retry = "safe" | "refused" | "never";

interface Call {
  body?: BodyInit;
  headers?: Record<string, string>;
  expect?: readonly number[];
  retry?: Retry;
  signal?: AbortSignal | undefined;
  timeoutMs?: number;
}

/** A try that may be repeated, and the least time (ms) to wait before the next. */
class Retryable extends Error {
  constructor(readonly failure: unknown, readonly waitMs = 0) {
    super(String(failure));
  }
}

/** Whether `submit` answered the whole job (it was final within `wait`). */
export function isAnswered(answer: Accepted | Answered): answer is Answered {
  return "result" in answer;
}

/** Whether a stream event is a piece of a streamed step's text. */
export function isOutputDelta(event: JobStreamEvent): event is OutputDeltaEvent {
  return event.type === "output.delta";
}

/** Whether a stream event says a new attempt of a step starts its text over. */
export function isOutputReset(event: JobStreamEvent): event is OutputResetEvent {
  return event.type === "reset";
}

export class CalmqClient {
  readonly baseUrl: string;
  readonly retry: RetryPolicy;
  readonly #apiKey: string;
  readonly #fetch: typeof fetch;
  readonly #timeoutMs: number;
  readonly #streamIdleMs: number;

  constructor(options: ClientOptions) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.#apiKey = options.apiKey;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#timeoutMs = options.timeoutMs ?? 30_000;
    this.#streamIdleMs = options.streamIdleMs ?? 45_000;
  }

  /** `POST /v1/jobs`: the 202 `{job_id, status, status_url}`, or with `wait` and a job
   * final in time, the job itself with `result` (see `isAnswered`). */
  async submit(workflow: string, input?: Record<string, unknown>,
               options: SubmitOptions = {}): Promise<Accepted | Answered> {
    const body: Record<string, unknown> = { workflow };
    if (input !== undefined) body.input = input;
    if (options.inputRef !== undefined) body.input_ref = options.inputRef;
    if (options.priority !== undefined) body.priority = options.priority;
    if (options.deadlineSeconds !== undefined) body.deadline_seconds = options.deadlineSeconds;
    if (options.callbackUrl !== undefined) body.callback_url = options.callbackUrl;
    if (options.metadata !== undefined) body.metadata = options.metadata;
    if (options.lane !== undefined) body.lane = options.lane;
    if (options.concurrencyKey !== undefined) body.concurrency_key = options.concurrencyKey;
    const headers: Record<string, string> = { "Content-Type": "application/json" };
    const key = options.idempotencyKey === true ? crypto.randomUUID() : options.idempotencyKey;
    if (key !== undefined) headers["Idempotency-Key"] = key;
    let timeoutMs = this.#timeoutMs;
    if (options.wait !== undefined && options.wait > 0) {
      const seconds = Math.ceil(options.wait);
      headers.Prefer = `wait=${seconds}`;
      timeoutMs += seconds * 1000; // the answer may take the wait itself
    }
    const response = await this.#call("POST", "/v1/jobs", {
      body: JSON.stringify(body), headers, expect: [200, 202],
      retry: key !== undefined ? "safe" : "refused", signal: options.signal, timeoutMs,
    });
    return (await response.json()) as Accepted | Answered;
  }

  /** `POST /v1/jobs/bulk`, `chunkSize` items a request, each chunk written in one
   * transaction: one result per item, in input order. A bad item is refused in its result
   * (`problem`) and never refuses the others. */
  async submitMany(items: Iterable<BulkJob>, options: SubmitManyOptions = {}
                   ): Promise<BulkResult[]> {
    const size = options.chunkSize ?? 1000;
    if (!Number.isInteger(size) || size < 1 || size > 1000) {
      throw new RangeError("chunkSize is 1 to 1000");
    }
    const run = options.idempotent === false ? undefined : crypto.randomUUID();
    const results: BulkResult[] = [];
    let chunk: BulkJob[] = [];
    let start = 0;
    let index = 0;
    const send = async (): Promise<void> => {
      const safe = chunk.every((job) => job.idempotency_key !== undefined);
      const response = await this.#call("POST", "/v1/jobs/bulk", {
        body: JSON.stringify({ jobs: chunk }), headers: { "Content-Type": "application/json" },
        retry: safe ? "safe" : "refused", signal: options.signal,
      });
      const answer = (await response.json()) as { results: BulkResult[] };
      for (const result of answer.results) results.push({ ...result, index: start + result.index });
      start += chunk.length;
      chunk = [];
    };
    for (const item of items) {
      chunk.push(run !== undefined && item.idempotency_key === undefined
        ? { ...item, idempotency_key: `${run}-${index}` } : item);
      index += 1;
      if (chunk.length === size) await send();
    }
    if (chunk.length > 0) await send();
    return results;
  }

  /** `GET /v1/jobs/{id}`: the job's view (status, attempt, step, artifact, error, events). */
  async get(jobId: string, options: { signal?: AbortSignal } = {}): Promise<Job> {
    const response = await this.#call("GET", `/v1/jobs/${encodeURIComponent(jobId)}`,
                                      { signal: options.signal });
    return (await response.json()) as Job;
  }

  /** `GET /v1/jobs`: one page, newest first; pass `next_cursor` as `cursor` for the next. */
  async list(filters: ListFilters = {}): Promise<JobPage> {
    const query = new URLSearchParams();
    const { status, workflow, createdAfter, createdBefore, limit, cursor } = filters;
    if (status !== undefined) query.set("status", [status].flat().join(","));
    if (workflow !== undefined) query.set("workflow", workflow);
    if (createdAfter !== undefined) query.set("created_after", time(createdAfter));
    if (createdBefore !== undefined) query.set("created_before", time(createdBefore));
    if (limit !== undefined) query.set("limit", String(limit));
    if (cursor !== undefined) query.set("cursor", cursor);
    for (const [key, value] of Object.entries(filters.metadata ?? {})) {
      query.set(`metadata.${key}`, value);
    }
    const suffix = query.toString() ? `?${query.toString()}` : "";
    const response = await this.#call("GET", `/v1/jobs${suffix}`, { signal: filters.signal });
    return (await response.json()) as JobPage;
  }

  /** Every job the filters match, page after page. */
  async *listAll(filters: Omit<ListFilters, "cursor"> = {}): AsyncGenerator<JobPage["jobs"][number]> {
    let cursor: string | null | undefined;
    do {
      const page = await this.list(cursor ? { ...filters, cursor } : filters);
      yield* page.jobs;
      cursor = page.next_cursor;
    } while (cursor);
  }

  /** `POST /v1/jobs/{id}/cancel`: the cancelled job. Not retried: a cancel whose answer
   * was lost would come back as a 409 (job_terminal). */
  async cancel(jobId: string, options: { signal?: AbortSignal } = {}): Promise<Job> {
    const response = await this.#call("POST", `/v1/jobs/${encodeURIComponent(jobId)}/cancel`,
                                      { retry: "never", signal: options.signal });
    return (await response.json()) as Job;
  }

  /** `POST /v1/jobs/{id}/rerun`: a new job that runs a job that ended again from
   * `fromStep` (the recorded outputs of the steps before it are reused, not run again),
   * linked to the original (`rerun_of`). Each call makes a new job, so it is retried only
   * when the API refused it (429, 503), never after an answer that may have been lost;
   * with `idempotencyKey`, like a keyed submit, after any failure a retry may cure. */
  async rerun(jobId: string, fromStep: string, options: RerunOptions = {}
  ): Promise<RerunAccepted> {
    const body: Record<string, unknown> = { from_step: fromStep };
    if (options.input !== undefined) body.input = options.input;
    if (options.priority !== undefined) body.priority = options.priority;
    const headers: Record<string, string> = { "Content-Type": "application/json" };
    const key = options.idempotencyKey === true ? crypto.randomUUID() : options.idempotencyKey;
    if (key !== undefined) headers["Idempotency-Key"] = key;
    const response = await this.#call("POST", `/v1/jobs/${encodeURIComponent(jobId)}/rerun`, {
      body: JSON.stringify(body), headers, expect: [202],
      retry: key !== undefined ? "safe" : "refused", signal: options.signal,
    });
    return (await response.json()) as RerunAccepted;
  }

  /** `DELETE /v1/jobs/{id}`: purge the job's objects and redact its record. */
  async delete(jobId: string, options: { signal?: AbortSignal } = {}): Promise<void> {
    await this.#call("DELETE", `/v1/jobs/${encodeURIComponent(jobId)}`,
                     { expect: [204], retry: "never", signal: options.signal });
  }

  /** The artifact's bytes as a stream (for a large one: nothing is held whole). */
  async artifactStream(jobId: string, options: { signal?: AbortSignal } = {}
  ): Promise<ReadableStream<Uint8Array>> {
    const response = await this.#call(
      "GET", `/v1/jobs/${encodeURIComponent(jobId)}/artifact`,
      { signal: options.signal, timeoutMs: 0 });
    if (response.body === null) throw new CalmqError("the artifact answer has no body");
    return response.body;
  }

  /** The artifact's bytes. */
  async artifact(jobId: string, options: { signal?: AbortSignal } = {}): Promise<Uint8Array> {
    const response = await this.#call("GET", `/v1/jobs/${encodeURIComponent(jobId)}/artifact`,
                                      { signal: options.signal });
    return new Uint8Array(await response.arrayBuffer());
  }

  /** The artifact parsed as JSON (a `summarize` job's `{summary}`, a `draft`'s `{text}`). */
  async artifactJson<T = unknown>(jobId: string, options: { signal?: AbortSignal } = {}
  ): Promise<T> {
    return JSON.parse(new TextDecoder().decode(await this.artifact(jobId, options))) as T;
  }

  /**
   * The job's events as the API streams them, until the job is terminal: its history
   * (`queued`, `running`, `completed`, ...) and, for a streamed step, `output.delta` (the
   * step's text is the deltas' concatenation) and `reset` (a new attempt of the step
   * starts over: drop what that step's deltas gave so far).
   *
   * A stream cut by the network or an API restart is opened again with `Last-Event-ID`
   * (the id of the last event yielded): no event is missed and none is repeated. The
   * retry policy's count starts over whenever an event arrives. Breaking out of the loop
   * closes the connection.
   */
  async *events(jobId: string, options: StreamOptions = {}): AsyncGenerator<JobStreamEvent> {
    let last = options.after ?? "0";
    let started = Date.now();
    let failures = 0;
    for (;;) {
      try {
        for await (const event of this.#eventStream(jobId, last, options.signal)) {
          if (event.id !== undefined) last = event.id;
          failures = 0;
          started = Date.now();
          yield event;
        }
        return;
      } catch (error) {
        if (!(error instanceof Retryable)) throw error;
        failures += 1;
        const pause = Math.max(backoffMs(this.retry, failures), error.waitMs);
        if (failures >= this.retry.attempts
            || Date.now() - started + pause > this.retry.maxElapsedMs) {
          throw error.failure;
        }
        await sleep(pause, options.signal);
      }
    }
  }

  /**
   * A streamed step's text as it is written (of `step`, or of every step), until the job
   * is final; resumed across a dropped connection like `events()`. A piece with `reset`
   * true says a new attempt starts that step's text over:
   * `text = piece.reset ? "" : text + piece.text`. Read `get()` afterwards for how the job
   * ended.
   */
  async *output(jobId: string, options: StreamOptions & { step?: string } = {}
  ): AsyncGenerator<OutputPiece> {
    for await (const event of this.events(jobId, options)) {
      if (options.step !== undefined && "step" in event && event.step !== options.step) continue;
      if (isOutputDelta(event)) {
        yield { text: event.text, step: event.step, attempt: event.attempt, reset: false,
                offset: event.offset, id: event.id };
      } else if (isOutputReset(event)) {
        yield { text: "", step: event.step, attempt: event.attempt, reset: true, offset: 0,
                id: event.id };
      }
    }
  }

  async *#eventStream(jobId: string, after: string, signal: AbortSignal | undefined
  ): AsyncGenerator<JobStreamEvent> {
    const headers: Record<string, string> = { Accept: "text/event-stream" };
    if (after !== "0") headers["Last-Event-ID"] = after;
    // No timeout: the stream lasts as long as the job; the idle watchdog ends a dead one.
    const response = await this.#once("GET", `/v1/jobs/${encodeURIComponent(jobId)}/events`,
                                      { headers, signal, retry: "safe", timeoutMs: 0 });
    if (response.body === null) throw new Retryable(new CalmqError("no event stream"));
    try {
      for await (const sse of readEvents(response.body, this.#streamIdleMs)) {
        if (sse.event === "end") return;
        const data = JSON.parse(sse.data) as Record<string, unknown>;
        yield { ...data, id: sse.id, type: (data.type as string | undefined) ?? sse.event
              } as JobStreamEvent;
      }
    } catch (error) {
      if (signal?.aborted) throw error;
      throw new Retryable(error);
    }
    // The server closed the stream without its "end" event: an API going away.
    throw new Retryable(new CalmqError("the event stream ended before the job finished"));
  }

  /** One call, tried again per `retry` and the policy. */
  async #call(method: string, path: string, call: Call = {}): Promise<Response> {
    const started = Date.now();
    for (let tries = 1; ; tries++) {
      try {
        return await this.#once(method, path, call);
      } catch (error) {
        if (!(error instanceof Retryable)) throw error;
        const pause = Math.max(backoffMs(this.retry, tries), error.waitMs);
        if (tries >= this.retry.attempts || Date.now() - started + pause > this.retry.maxElapsedMs) {
          throw error.failure;
        }
        await sleep(pause, call.signal);
      }
    }
  }

  /** One try: the response of an expected status, or an ApiError, or a Retryable. */
  async #once(method: string, path: string, call: Call): Promise<Response> {
    const retry = call.retry ?? "safe";
    const timeoutMs = call.timeoutMs ?? this.#timeoutMs;
    const signals = [call.signal, timeoutMs > 0 ? AbortSignal.timeout(timeoutMs) : undefined]
      .filter((s): s is AbortSignal => s !== undefined);
    const init: RequestInit = {
      method,
      headers: { Authorization: `Bearer ${this.#apiKey}`, ...call.headers },
    };
    if (call.body !== undefined) init.body = call.body;
    if (signals.length > 0) init.signal = AbortSignal.any(signals);
    let response: Response;
    try {
      response = await this.#fetch(this.baseUrl + path, init);
    } catch (error) {
      // The caller's own abort ends the call; a dropped connection or our timeout may
      // be tried again where that is safe (the request may have been received).
      if (call.signal?.aborted || retry !== "safe") throw error;
      throw new Retryable(error);
    }
    if ((call.expect ?? [200]).includes(response.status)) return response;
    const error = await problem(response);
    const retryable = retry === "safe"
      ? this.retry.statuses.has(response.status)
      : retry === "refused" && (response.status === 429 || response.status === 503);
    if (retryable) throw new Retryable(error, error.retryAfterMs ?? 0);
    throw error;
  }
}

async function problem(response: Response): Promise<ApiError> {
  const text = await response.text().catch(() => "");
  const after = retryAfterMs(response.headers.get("Retry-After"));
  const extra = after === undefined ? {} : { retryAfterMs: after };
  try {
    const body = JSON.parse(text) as Record<string, unknown>;
    return new ApiError(response.status, String(body.code ?? "http_error"),
                        String(body.detail ?? response.statusText), {
                          ...extra,
                          ...(typeof body.title === "string" ? { title: body.title } : {}),
                          ...(typeof body.type === "string" ? { type: body.type } : {}),
                        });
  } catch {
    return new ApiError(response.status, "http_error", text.slice(0, 500) || response.statusText,
                        extra);
  }
}

function time(value: string | Date): string {
  return value instanceof Date ? value.toISOString() : value;
}
