/**
 * @calmq/client: the TypeScript client of calmq's intake API.
 *
 * ```ts
 * import { CalmqClient } from "@calmq/client";
 * const calmq = new CalmqClient({ baseUrl: process.env.CALMQ_API_URL!, apiKey });
 * const { job_id } = await calmq.submit("draft", { prompt: "..." });
 * let text = "";
 * for await (const piece of calmq.output(job_id)) {
 *   text = piece.reset ? "" : text + piece.text;
 * }
 * ```
 */

export { CalmqClient, isAnswered, isOutputDelta, isOutputReset } from "./client.js";
export type {
  ClientOptions, ListFilters, RerunOptions, StreamOptions, SubmitManyOptions, SubmitOptions,
} from "./client.js";
export { ApiError, CalmqError, WebhookVerificationError } from "./errors.js";
export { DEFAULT_RETRY } from "./retry.js";
export type { RetryPolicy } from "./retry.js";
export { readEvents, StreamIdleError } from "./sse.js";
export type { ServerSentEvent } from "./sse.js";
export { TERMINAL } from "./types.js";
export type {
  Accepted, Answered, Artifact, BulkJob, BulkResult, HistoryEntry, HistoryEvent, Job,
  JobError, JobPage,
  JobStreamEvent, JobSummary, OutputDeltaEvent, OutputResetEvent, OutputPiece, Priority,
  RerunAccepted, Status, Usage,
} from "./types.js";
export { verifyWebhook } from "./webhooks.js";
export type { VerifyOptions, WebhookEvent, WebhookEventType } from "./webhooks.js";
