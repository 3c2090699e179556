/**
 * What the API answers, as docs/reference/openapi.json describes it. Written by hand (the
 * package has no build-time generator): tests/integration/test_openapi_file.py generates
 * types from that file with openapi-typescript and compiles them, and the client's own
 * tests read these shapes from the real API.
 */

export type Status =
  | "queued" | "running" | "retrying" | "awaiting_review"
  | "completed" | "dead_letter" | "cancelled";

/** The statuses a job never leaves. */
export const TERMINAL: ReadonlySet<Status> = new Set(["completed", "dead_letter", "cancelled"]);

export type Priority = "interactive" | "bulk";

export interface Artifact {
  uri: string;
  sha256: string;
  content_type: string;
  size: number;
  /** Where to fetch it: a presigned URL (no API key needed) or this API's artifact route. */
  download_url?: string | null;
  download_expires_at?: string | null;
}

export interface JobError {
  code: string;
  class: string;
  message: string;
}

export interface Usage {
  input_tokens: number;
  output_tokens: number;
  cost_usd: number;
  /** Of input_tokens: read from the provider's prompt cache (billed at the cached price). */
  cached_input_tokens?: number;
  /** Of input_tokens: written to the prompt cache (Anthropic's cache writes). */
  cache_write_tokens?: number;
  /** What the prompt cache saved against the same calls uncached. */
  cache_saved_usd?: number;
}

/** One entry of a job's history. */
export interface HistoryEntry {
  type: string;
  at: string;
  attempt: number;
  detail: Record<string, unknown>;
}

export interface JobSummary {
  job_id: string;
  workflow: string;
  status: Status;
  attempt: number;
  step: string;
  artifact: Artifact | null;
  error: JobError | null;
  created_at: string;
  updated_at: string;
  metadata?: Record<string, unknown>;
}

/** `GET /v1/jobs/{id}`: the same shape at every stage of the job. */
export interface Job extends JobSummary {
  usage: Usage;
  waiting_reason?: string | null;
  /** The job that started this one as its child (fan-out), if any. */
  parent_id?: string | null;
  /** The job this one runs again (`rerun`), if any. */
  rerun_of?: string | null;
  events: HistoryEntry[];
}

/** The 202 answer of `POST /v1/jobs/{id}/rerun`: a new job, linked to the original. */
export interface RerunAccepted {
  job_id: string;
  status: "queued";
  status_url: string;
  rerun_of: string;
  from_step: string;
}

/** The 202 answer of a submit. */
export interface Accepted {
  job_id: string;
  status: "queued";
  status_url: string;
}

/** The 200 answer of a submit with `wait`: the job was final in time; `result` is its
 * artifact's JSON when that is small JSON, else null (download it). */
export interface Answered extends Job {
  result: unknown;
}

/** One item of `submitMany`: a `POST /v1/jobs` body, with an optional idempotency key. */
export interface BulkJob {
  workflow: string;
  input?: Record<string, unknown>;
  input_ref?: string;
  priority?: Priority;
  lane?: "online" | "batch";
  deadline_seconds?: number;
  callback_url?: string;
  metadata?: Record<string, unknown>;
  concurrency_key?: string;
  idempotency_key?: string;
}

/** One item's answer of `POST /v1/jobs/bulk` (`index`: its place in the whole call). */
export interface BulkResult {
  index: number;
  status: "accepted" | "duplicate" | "refused";
  job_id?: string;
  status_url?: string;
  /** Why it was refused: the problem `POST /v1/jobs` would have answered. */
  problem?: { type: string; title: string; status: number; detail: string; code: string };
}

export interface JobPage {
  jobs: JobSummary[];
  next_cursor: string | null;
}

/** A history event on the event stream (`queued`, `running`, `completed`, ...). */
export interface HistoryEvent extends HistoryEntry {
  /** The stream position; pass as `after` to resume after this event. */
  id: string | undefined;
  job_id?: string;
}

/** A piece of a streamed step's text: the step's text is the concatenation of its deltas
 * (since the last `reset` of that step). */
export interface OutputDeltaEvent {
  id: string | undefined;
  type: "output.delta";
  job_id: string;
  step: string;
  attempt: number;
  /** 1, 2, ... within the attempt's stream. */
  seq: number;
  /** Where `text` starts in the attempt's text. */
  offset: number;
  text: string;
}

/** A new attempt of `step` starts over: drop the text its deltas gave so far. */
export interface OutputResetEvent {
  id: string | undefined;
  type: "reset";
  job_id: string;
  step: string | null;
  attempt: number;
}

export type JobStreamEvent = HistoryEvent | OutputDeltaEvent | OutputResetEvent;

/** What `output()` yields: a piece of a streamed step's text, or (`reset` true, no text)
 * word that a new attempt of `step` starts over: drop what that step's pieces gave so far.
 * The same fields as the Python client's `Delta`. */
export interface OutputPiece {
  text: string;
  step: string | null;
  attempt: number;
  reset: boolean;
  /** Where `text` starts in the attempt's text (each piece starts where the last ended). */
  offset: number;
  /** The event's id, to resume after. */
  id: string | undefined;
}
