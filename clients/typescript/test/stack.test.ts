// The client against a real calmq stack (the API, Kafka, PostgreSQL, a worker and the fake
// provider). tests/integration/test_typescript_client.py runs this file with:
//   CALMQ_API_URL, CALMQ_API_KEY                the stack's API and a new tenant's key
//   CALMQ_TEST_RESTARTABLE_API_URL              an API of the test's own, on a fixed port,
//   CALMQ_TEST_RESTART_URL                      and where to POST to kill -9 and restart it
//   CALMQ_TEST_WEBHOOK_API_URL, _API_KEY, _SECRET  an API that may call back to 127.0.0.1,
//                                               a tenant of it and its webhook secret
// Without them the tests are skipped (the pytest test asserts that none was).
import assert from "node:assert/strict";
import { createServer, type IncomingHttpHeaders } from "node:http";
import type { AddressInfo } from "node:net";
import { describe, test } from "node:test";

import {
  ApiError, CalmqClient, isAnswered, isOutputDelta, isOutputReset, TERMINAL, verifyWebhook,
  type JobStreamEvent, type OutputDeltaEvent,
} from "@calmq/client";

const env = process.env;
const stack = env.CALMQ_API_URL && env.CALMQ_API_KEY
  ? { baseUrl: env.CALMQ_API_URL, apiKey: env.CALMQ_API_KEY } : undefined;
const TIMEOUT = 120_000;

function client(): CalmqClient {
  return new CalmqClient({ ...stack!, retry: { initialDelayMs: 100, maxDelayMs: 1000 } });
}

async function waitFor<T>(what: string, check: () => Promise<T | undefined>,
                          timeoutMs = 60_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const found = await check();
    if (found !== undefined) return found;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/** The deltas of one attempt follow on from each other: each starts at the offset where
 * the one before ended (none lost, none repeated), numbered upwards. A resume after the
 * step finished gets the rest as one compacted delta, numbered as the last chunk. */
function checkContiguous(deltas: OutputDeltaEvent[]): void {
  let seq = 0;
  let offset = 0;
  for (const d of deltas) {
    assert.ok(d.seq > seq, `delta ${d.seq} after ${seq}`);
    assert.equal(d.offset, offset, `delta ${d.seq} at offset ${d.offset}, not ${offset}`);
    seq = d.seq;
    offset += d.text.length;
  }
}

describe("against the stack", { skip: stack ? false : "CALMQ_API_URL and CALMQ_API_KEY unset" },
         () => {
  test("a streamed draft's output concatenates to the stored artifact", { timeout: TIMEOUT },
       async () => {
    const calmq = client();
    const accepted = await calmq.submit("draft", {
      prompt: "queues carry slow work", tokens: 40, tokens_per_second: 100 });
    assert.equal(accepted.status, "queued");
    let text = "";
    let pieces = 0;
    for await (const piece of calmq.output(accepted.job_id)) {
      assert.equal(piece.reset, false);
      assert.equal(piece.offset, text.length);
      text += piece.text;
      pieces += 1;
    }
    assert.ok(pieces > 1, `only ${pieces} piece(s): the step did not stream`);
    const job = await calmq.get(accepted.job_id);
    assert.equal(job.status, "completed");
    const artifact = await calmq.artifactJson<{ text: string }>(accepted.job_id);
    assert.equal(text, artifact.text);
    assert.equal(job.artifact?.size, (await calmq.artifact(accepted.job_id)).length);
  });

  test("events end with the job's completion, the deltas in order before it",
       { timeout: TIMEOUT }, async () => {
    const calmq = client();
    const { job_id } = await calmq.submit("draft", { prompt: "in order", tokens: 20,
                                                     tokens_per_second: 200 });
    const events: JobStreamEvent[] = [];
    for await (const event of calmq.events(job_id)) events.push(event);
    const types = events.map((e) => e.type);
    // A job that finished before the stream opened sends its text first, then its history.
    assert.ok(types.includes("queued") && types.includes("running"), types.join(" "));
    assert.equal(types.at(-1), "completed");
    const deltas = events.filter(isOutputDelta);
    assert.ok(deltas.length > 0);
    checkContiguous(deltas);
    assert.ok(types.indexOf("completed") > types.lastIndexOf("output.delta"));
    // Resuming after a delta yields the rest: the same text (for a final job, compacted
    // into one delta) and the same history events.
    const middle = deltas[Math.floor(deltas.length / 2)]!;
    const rest: JobStreamEvent[] = [];
    for await (const event of calmq.events(job_id, { after: middle.id! })) rest.push(event);
    const tail = events.slice(events.indexOf(middle) + 1);
    const textOf = (es: JobStreamEvent[]): string =>
      es.filter(isOutputDelta).map((d) => d.text).join("");
    const historyOf = (es: JobStreamEvent[]): string[] =>
      es.filter((e) => !isOutputDelta(e)).map((e) => e.type);
    assert.equal(textOf(rest), textOf(tail));
    assert.deepEqual(historyOf(rest), historyOf(tail));
  });

  test("submit with wait answers a fast job whole, with its result", { timeout: TIMEOUT },
       async () => {
    const answer = await client().submit("summarize", { text: "waited for", mode: "success" },
                                         { wait: 30, priority: "interactive" });
    assert.ok(isAnswered(answer), `answered ${answer.status}: not within the wait`);
    assert.equal(answer.status, "completed");
    assert.equal(typeof (answer.result as { summary: string }).summary, "string");
  });

  test("submitMany answers each item in order, and list finds them by metadata",
       { timeout: TIMEOUT }, async () => {
    const calmq = client();
    const tag = crypto.randomUUID();
    const items = [0, 1, 2, 3, 4].map((n) => ({
      workflow: "summarize", input: { text: `bulk ${n}`, mode: "success" },
      metadata: { batch: tag } }));
    items[2] = { workflow: "summarize", input: { wrong: true } as never,
                 metadata: { batch: tag } };
    const results = await calmq.submitMany(items, { chunkSize: 2 });
    assert.deepEqual(results.map((r) => r.index), [0, 1, 2, 3, 4]);
    assert.deepEqual(results.map((r) => r.status),
                     ["accepted", "accepted", "refused", "accepted", "accepted"]);
    assert.equal(results[2]!.problem!.code, "invalid_input");
    const listed = await calmq.list({ metadata: { batch: tag }, limit: 200 });
    assert.deepEqual(listed.jobs.map((j) => j.job_id).sort(),
                     results.filter((r) => r.status === "accepted").map((r) => r.job_id).sort());
  });

  test("rerun makes a new job linked to the original; an unknown step is a 422",
       { timeout: TIMEOUT }, async () => {
    const calmq = client();
    const final = (id: string) => waitFor(`job ${id} to end`, async () => {
      const job = await calmq.get(id);
      return TERMINAL.has(job.status) ? job : undefined;
    });
    const { job_id } = await calmq.submit("summarize", { text: "rerun me", mode: "success" });
    assert.equal((await final(job_id)).status, "completed");
    const again = await calmq.rerun(job_id, "summarize",
                                    { input: { text: "rerun me again", mode: "success" } });
    assert.equal(again.rerun_of, job_id);
    assert.equal(again.from_step, "summarize");
    assert.notEqual(again.job_id, job_id);
    const rerun = await final(again.job_id);
    assert.equal(rerun.status, "completed");
    assert.equal(rerun.rerun_of, job_id);
    await assert.rejects(calmq.rerun(job_id, "nope"), (error: unknown) =>
      error instanceof ApiError && error.status === 422 && error.code === "unknown_step");
    // Keyed: the same key and arguments answer the same new job; other arguments a 409.
    const idempotencyKey = `ts-rerun-${crypto.randomUUID()}`;
    const keyed = await calmq.rerun(job_id, "summarize", { idempotencyKey });
    assert.notEqual(keyed.job_id, again.job_id);
    assert.equal((await calmq.rerun(job_id, "summarize", { idempotencyKey })).job_id,
                 keyed.job_id);
    await assert.rejects(calmq.rerun(job_id, "summarize", { idempotencyKey, priority: "bulk" }),
      (error: unknown) => error instanceof ApiError && error.status === 409
        && error.code === "idempotency_key_reused");
  });

  test("get, list with filters, cancel, and a second cancel's 409", { timeout: TIMEOUT },
       async () => {
    const calmq = client();
    const { job_id } = await calmq.submit("draft", {
      prompt: "a long one", tokens: 100, tokens_per_second: 10 }, { idempotencyKey: true });
    const job = await calmq.get(job_id);
    assert.equal(job.job_id, job_id);
    assert.equal(job.workflow, "draft");
    const cancelled = await calmq.cancel(job_id);
    assert.equal(cancelled.status, "cancelled");
    assert.ok(TERMINAL.has(cancelled.status));
    await assert.rejects(calmq.cancel(job_id), (error: unknown) =>
      error instanceof ApiError && error.status === 409 && error.code === "job_terminal");
    const page = await calmq.list({ status: "cancelled", workflow: "draft", limit: 50 });
    assert.ok(page.jobs.some((j) => j.job_id === job_id));
    const seen: string[] = [];
    for await (const j of calmq.listAll({ workflow: "draft", limit: 1 })) seen.push(j.job_id);
    assert.ok(seen.includes(job_id));
    assert.equal(new Set(seen).size, seen.length);
    await assert.rejects(calmq.get("00000000-0000-4000-8000-000000000000"),
                         (error: unknown) => error instanceof ApiError && error.status === 404);
  });

  test("the stream resumes across a kill -9 of the API with no delta lost or repeated",
       { timeout: TIMEOUT, skip: env.CALMQ_TEST_RESTART_URL ? false : "no restartable API" },
       async () => {
    let connections = 0;
    const counting: typeof fetch = (input, init) => {
      if (String(input).endsWith("/events")) connections += 1;
      return fetch(input, init);
    };
    const calmq = new CalmqClient({
      baseUrl: env.CALMQ_TEST_RESTARTABLE_API_URL!, apiKey: stack!.apiKey, fetch: counting,
      retry: { attempts: 60, maxElapsedMs: 90_000, initialDelayMs: 100, maxDelayMs: 1000 } });
    const { job_id } = await calmq.submit("draft", {
      prompt: "survive a restart", tokens: 120, tokens_per_second: 30 });
    const events: JobStreamEvent[] = [];
    let restart: Promise<Response> | undefined;
    let text = "";
    for await (const event of calmq.events(job_id)) {
      events.push(event);
      if (isOutputReset(event)) text = "";
      if (isOutputDelta(event)) {
        text += event.text;
        // Kill the API under the open stream at its first delta; the restart runs in the
        // test process while this loop keeps reading (and reconnecting).
        restart ??= fetch(env.CALMQ_TEST_RESTART_URL!, { method: "POST" });
      }
    }
    assert.ok(restart, "no delta arrived");
    const restarted = await restart;
    assert.equal(restarted.status, 200, await restarted.text());
    assert.ok(connections >= 2, `${connections} connection(s): the stream was never cut`);
    assert.equal(events.at(-1)?.type, "completed");
    assert.equal(events.filter(isOutputReset).length, 0);
    checkContiguous(events.filter(isOutputDelta));
    const ids = events.map((e) => e.id);
    assert.equal(new Set(ids).size, ids.length, "an event came twice");
    const artifact = await calmq.artifactJson<{ text: string }>(job_id);
    assert.equal(text, artifact.text);
  });

  test("a real webhook delivery verifies with the tenant's secret", {
    timeout: TIMEOUT, skip: env.CALMQ_TEST_WEBHOOK_API_URL ? false : "no webhook API" },
       async () => {
    const received: { headers: IncomingHttpHeaders; body: Buffer }[] = [];
    const receiver = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (chunk: Buffer) => chunks.push(chunk));
      req.on("end", () => {
        received.push({ headers: req.headers, body: Buffer.concat(chunks) });
        res.writeHead(204).end();
      });
    });
    await new Promise<void>((resolve) => receiver.listen(0, "127.0.0.1", resolve));
    try {
      const { port } = receiver.address() as AddressInfo;
      const calmq = new CalmqClient({ baseUrl: env.CALMQ_TEST_WEBHOOK_API_URL!,
                                      apiKey: env.CALMQ_TEST_WEBHOOK_API_KEY! });
      // No worker reads that API's database: cancelling ends the job (a terminal event).
      const { job_id } = await calmq.submit("summarize", { text: "call me back" },
                                            { callbackUrl: `http://127.0.0.1:${port}/hook` });
      await calmq.cancel(job_id);
      const delivery = await waitFor("the callback",
                                     async () => received[0]);
      const secret = env.CALMQ_TEST_WEBHOOK_SECRET!;
      const payload = await verifyWebhook(secret, delivery.headers, delivery.body);
      // The Standard Webhooks body (payload version 2, the default).
      assert.equal(payload.type, "job.cancelled");
      assert.equal(payload.data.job_id, job_id);
      assert.equal(payload.data.status, "cancelled");
      assert.ok(!Number.isNaN(Date.parse(payload.timestamp)));
      assert.deepEqual(Object.keys(JSON.parse(delivery.body.toString()) as object).sort(),
                       ["data", "timestamp", "type"]);
      await assert.rejects(verifyWebhook(secret, delivery.headers,
                                         Buffer.concat([delivery.body, Buffer.from(" ")])));
    } finally {
      receiver.closeAllConnections();
      await new Promise((resolve) => receiver.close(resolve));
    }
  });
});
