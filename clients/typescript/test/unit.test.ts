// What needs no calmq: the SSE reader, webhook verification against calmq's signing scheme,
// and the retry policy against a small HTTP server of the test's own.
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { describe, test } from "node:test";

import {
  ApiError, CalmqClient, readEvents, verifyWebhook, WebhookVerificationError,
} from "@calmq/client";

function body(...chunks: string[]): ReadableStream<Uint8Array> {
  const encoder = new TextEncoder();
  return new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(encoder.encode(chunk));
      controller.close();
    },
  });
}

async function all<T>(items: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const item of items) out.push(item);
  return out;
}

describe("readEvents", () => {
  test("parses events split anywhere, with CRLF, comments and multi-line data", async () => {
    const events = await all(readEvents(body(
      ": keep-alive\r\n\r\nid: 1:0:0:0\r", "\nevent: queued\r\ndata: {\"a\":", "1}\r\n\r\n",
      "id: 2\nevent: output.delta\ndata: one\ndata: two\n\n", "data: unterminated")));
    assert.deepEqual(events, [
      { id: "1:0:0:0", event: "queued", data: "{\"a\":1}" },
      { id: "2", event: "output.delta", data: "one\ntwo" },
    ]);
  });
});

// calmq's signing (producers/webhooks.py): base64 HMAC-SHA256 over "<id>.<timestamp>.<body>"
// keyed with the UTF-8 of the tenant's secret.
function sign(secret: string, id: string, timestamp: number, payload: string): string {
  const mac = createHmac("sha256", Buffer.from(secret, "utf8"))
    .update(`${id}.${timestamp}.${payload}`).digest("base64");
  return `v1,${mac}`;
}

describe("verifyWebhook", () => {
  const secret = "tenant-secret-1234";
  const payload = JSON.stringify({ type: "job.completed", timestamp: "2026-12-07T06:00:00+00:00",
                                   data: { job_id: "j1" } });
  const now = Math.floor(Date.now() / 1000);
  const headers = {
    "webhook-id": "d1", "webhook-timestamp": String(now),
    "webhook-signature": sign(secret, "d1", now, payload),
  };

  test("a body signed the way calmq signs verifies, raw or whsec_ secret, and is parsed",
       async () => {
    assert.deepEqual(await verifyWebhook(secret, headers, payload), JSON.parse(payload));
    const whsec = `whsec_${Buffer.from(secret).toString("base64")}`;
    assert.deepEqual(await verifyWebhook(whsec, new Headers(headers),
                                         new TextEncoder().encode(payload)),
                     JSON.parse(payload));
  });

  test("a version 1 body ({event, job}) is returned in the standard's shape", async () => {
    const old = JSON.stringify({ event: "dead_lettered", job: { job_id: "j2" } });
    const signed = { ...headers, "webhook-signature": sign(secret, "d1", now, old) };
    assert.deepEqual(await verifyWebhook(secret, signed, old), {
      type: "job.dead_lettered", timestamp: new Date(now * 1000).toISOString(),
      data: { job_id: "j2" },
    });
  });

  test("during a rotation any one of the signatures verifies", async () => {
    const both = { ...headers, "webhook-signature":
      `${sign("new-secret", "d1", now, payload)} ${sign(secret, "d1", now, payload)}` };
    assert.ok(await verifyWebhook(secret, both, payload));
    assert.ok(await verifyWebhook("new-secret", both, payload));
  });

  test("a changed body, another secret, an old timestamp or a missing header is refused",
       async () => {
    const refused = async (promise: Promise<unknown>): Promise<void> => {
      await assert.rejects(promise, WebhookVerificationError);
    };
    await refused(verifyWebhook(secret, headers, payload + " "));
    await refused(verifyWebhook("another-tenants-secret", headers, payload));
    await refused(verifyWebhook(secret, headers, payload, { now: now + 301 }));
    await refused(verifyWebhook(secret, { ...headers, "webhook-id": "d2" }, payload));
    await refused(verifyWebhook(secret, { "webhook-id": "d1" }, payload));
  });
});

async function server(handler: (req: IncomingMessage, res: ServerResponse) => void
): Promise<{ url: string; close: () => Promise<void> }> {
  const srv = createServer(handler);
  await new Promise<void>((resolve) => srv.listen(0, "127.0.0.1", resolve));
  const { port } = srv.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    close: () => new Promise((resolve) => { srv.closeAllConnections(); srv.close(() => resolve()); }),
  };
}

describe("retries", () => {
  test("a 429 is retried no sooner than its Retry-After", async () => {
    const seen: number[] = [];
    const api = await server((_req, res) => {
      seen.push(Date.now());
      if (seen.length === 1) {
        res.writeHead(429, { "Content-Type": "application/problem+json", "Retry-After": "1" });
        res.end(JSON.stringify({ type: "about:blank", title: "Too Many Requests", status: 429,
                                 detail: "slow down", code: "rate_limited" }));
        return;
      }
      res.writeHead(200, { "Content-Type": "application/json" });
      res.end(JSON.stringify({ jobs: [], next_cursor: null }));
    });
    try {
      const client = new CalmqClient({ baseUrl: api.url, apiKey: "k",
                                       retry: { initialDelayMs: 10 } });
      assert.deepEqual(await client.list(), { jobs: [], next_cursor: null });
      assert.equal(seen.length, 2);
      assert.ok(seen[1]! - seen[0]! >= 1000, `retried after ${seen[1]! - seen[0]!} ms`);
    } finally {
      await api.close();
    }
  });

  test("a submit without a key is not sent again after a dropped connection", async () => {
    let calls = 0;
    const api = await server((req) => {
      calls += 1;
      req.socket.destroy(); // the answer is lost: the job may or may not exist
    });
    try {
      const client = new CalmqClient({ baseUrl: api.url, apiKey: "k",
                                       retry: { initialDelayMs: 10 } });
      await assert.rejects(client.submit("summarize", { text: "x" }), TypeError);
      assert.equal(calls, 1);
      await assert.rejects(client.submit("summarize", { text: "x" }, {
        idempotencyKey: true, }), TypeError);
      assert.equal(calls, 1 + client.retry.attempts);
    } finally {
      await api.close();
    }
  });

  test("a bulk chunk whose answer was lost is sent again with the same keys", async () => {
    const bodies: string[] = [];
    const api = await server((req, res) => {
      let text = "";
      req.on("data", (piece: Buffer) => { text += piece.toString(); });
      req.on("end", () => {
        bodies.push(text);
        if (bodies.length === 1) {
          req.socket.destroy(); // sent, never answered
          return;
        }
        const jobs = (JSON.parse(text) as { jobs: unknown[] }).jobs;
        res.writeHead(200, { "Content-Type": "application/json" });
        res.end(JSON.stringify({ results: jobs.map((_j, index) => (
          { index, status: "duplicate", job_id: `j${index}` })) }));
      });
    });
    try {
      const client = new CalmqClient({ baseUrl: api.url, apiKey: "k",
                                       retry: { initialDelayMs: 10 } });
      const results = await client.submitMany([
        { workflow: "summarize", input: { text: "a" } },
        { workflow: "summarize", input: { text: "b" }, idempotency_key: "mine-1" },
        { workflow: "summarize", input: { text: "c" } }], { chunkSize: 2 });
      assert.deepEqual(results.map((r) => r.index), [0, 1, 2]);
      const [first, second] = bodies.map((b) => (JSON.parse(b) as {
        jobs: { idempotency_key?: string }[] }).jobs);
      assert.deepEqual(first, second);
      assert.equal(first![1]!.idempotency_key, "mine-1");
      assert.ok(first![0]!.idempotency_key);
      assert.equal(bodies.length, 3);
    } finally {
      await api.close();
    }
  });

  test("a problem answer becomes an ApiError with its code and status", async () => {
    const api = await server((_req, res) => {
      res.writeHead(404, { "Content-Type": "application/problem+json" });
      res.end(JSON.stringify({ type: "about:blank", title: "Not Found", status: 404,
                               detail: "no such job", code: "not_found" }));
    });
    try {
      const client = new CalmqClient({ baseUrl: api.url, apiKey: "k" });
      await assert.rejects(client.get("x"), (error: unknown) =>
        error instanceof ApiError && error.status === 404 && error.code === "not_found");
    } finally {
      await api.close();
    }
  });
});

describe("events", () => {
  test("a stream gone quiet is reopened with Last-Event-ID and carries on", async () => {
    const asked: (string | undefined)[] = [];
    const api = await server((req, res) => {
      asked.push(req.headers["last-event-id"] as string | undefined);
      res.writeHead(200, { "Content-Type": "text/event-stream" });
      if (asked.length === 1) {
        // One event, then silence: a connection whose peer vanished.
        res.write("id: 1:0:0:0\nevent: queued\ndata: {\"type\": \"queued\"}\n\n");
        return;
      }
      res.end("id: 2:0:0:0\nevent: completed\ndata: {\"type\": \"completed\"}\n\n"
              + "event: end\ndata: {\"status\": \"completed\"}\n\n");
    });
    try {
      const client = new CalmqClient({ baseUrl: api.url, apiKey: "k", streamIdleMs: 300,
                                       retry: { initialDelayMs: 10 } });
      const events = await all(client.events("j1"));
      assert.deepEqual(events.map((e) => [e.id, e.type]),
                       [["1:0:0:0", "queued"], ["2:0:0:0", "completed"]]);
      assert.deepEqual(asked, [undefined, "1:0:0:0"]);
    } finally {
      await api.close();
    }
  });
});
