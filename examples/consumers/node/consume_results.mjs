// A downstream consumer of calmq.results: KafkaJS and its Confluent schema registry client
// (@kafkajs/confluent-schema-registry). Prints one JSON line per job result and exits after
// --max-messages results or --idle-timeout seconds without a message. Every flag also reads
// an environment variable (--help); the defaults reach the Docker Compose stack from its
// host (docker-compose.kafka.yml). For `calmq dev up`, `eval $(calmq dev env)` first.
//
//   npm ci && node consume_results.mjs --api-key "$CALMQ_API_KEY" --max-messages 10
//
// A secured cluster: --config FILE, a properties file with the other examples' keys:
// security.protocol (SSL, SASL_SSL, SASL_PLAINTEXT), sasl.mechanism (PLAIN, SCRAM-SHA-256,
// SCRAM-SHA-512), sasl.username, sasl.password, ssl.ca.location (a PEM CA), and
// schema.registry.basic.auth.user.info (USER:PASSWORD), schema.registry.ssl.ca.location.

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { Agent } from "node:https";
import { parseArgs } from "node:util";

// Both packages are CommonJS: their named exports come through the default import.
import kafkajs from "kafkajs";
import registryClient from "@kafkajs/confluent-schema-registry";

const { Kafka, logLevel } = kafkajs;
const { SchemaRegistry } = registryClient;

const env = process.env;
const { values: opt } = parseArgs({
  options: {
    bootstrap: { type: "string", default: env.CALMQ_KAFKA_BOOTSTRAP || "localhost:29092" },
    registry: { type: "string",
                default: env.CALMQ_SCHEMA_REGISTRY_URL || "http://localhost:8081/apis/ccompat/v7" },
    api: { type: "string", default: env.CALMQ_API_URL || "http://localhost:8080" },
    "api-key": { type: "string", default: env.CALMQ_API_KEY },
    topic: { type: "string", default: env.CALMQ_RESULTS_TOPIC || "calmq.results" },
    config: { type: "string", default: env.CALMQ_CONSUMER_CONFIG },
    group: { type: "string", default: env.CALMQ_CONSUMER_GROUP || "results-example-node" },
    "tenant-id": { type: "string", default: env.CALMQ_TENANT_ID },
    "max-messages": { type: "string", default: env.CALMQ_MAX_MESSAGES || "0" },
    "idle-timeout": { type: "string", default: env.CALMQ_IDLE_TIMEOUT || "30" },
    help: { type: "boolean", default: false },
  },
});
if (opt.help) {
  console.log("flags (and their environment variables): --bootstrap (CALMQ_KAFKA_BOOTSTRAP), " +
    "--registry (CALMQ_SCHEMA_REGISTRY_URL), --api (CALMQ_API_URL), --api-key (CALMQ_API_KEY), " +
    "--topic (CALMQ_RESULTS_TOPIC), --config (CALMQ_CONSUMER_CONFIG), --group " +
    "(CALMQ_CONSUMER_GROUP), --tenant-id (CALMQ_TENANT_ID), --max-messages " +
    "(CALMQ_MAX_MESSAGES, 0: no limit), --idle-timeout (CALMQ_IDLE_TIMEOUT, seconds)");
  process.exit(0);
}
const maxMessages = Number(opt["max-messages"]);
const idleMs = Number(opt["idle-timeout"]) * 1000;

/** A .properties file's key=value lines (blank lines and # or ! comments skipped). */
function readProperties(path) {
  const props = {};
  if (!path) return props;
  for (const raw of readFileSync(path, "utf8").split(/\r?\n/)) {
    const line = raw.trim();
    if (!line || line.startsWith("#") || line.startsWith("!")) continue;
    const at = line.indexOf("=");
    props[(at < 0 ? line : line.slice(0, at)).trim()] = at < 0 ? "" : line.slice(at + 1).trim();
  }
  return props;
}

const props = readProperties(opt.config);
const protocol = (props["security.protocol"] ?? "PLAINTEXT").toUpperCase();
const caOf = (path) => (path ? { ca: [readFileSync(path, "utf8")] } : {});
const kafkaSecurity = {};
if (protocol === "SSL" || protocol === "SASL_SSL") {
  kafkaSecurity.ssl = props["ssl.ca.location"] ? caOf(props["ssl.ca.location"]) : true;
}
if (protocol.startsWith("SASL_")) {
  kafkaSecurity.sasl = { mechanism: (props["sasl.mechanism"] ?? "PLAIN").toLowerCase(),
                         username: props["sasl.username"], password: props["sasl.password"] };
}
const registryOptions = { host: opt.registry };
const userInfo = props["schema.registry.basic.auth.user.info"];
if (userInfo) {
  const at = userInfo.indexOf(":");
  registryOptions.auth = { username: userInfo.slice(0, at), password: userInfo.slice(at + 1) };
}
if (props["schema.registry.ssl.ca.location"]) {
  registryOptions.agent = new Agent(caOf(props["schema.registry.ssl.ca.location"]));
}

const registry = new SchemaRegistry(registryOptions);
const kafka = new Kafka({ clientId: opt.group, brokers: opt.bootstrap.split(","),
                          logLevel: logLevel.ERROR, ...kafkaSecurity });
const consumer = kafka.consumer({ groupId: opt.group });

/** The artifact's bytes through the API: its URI (file://, s3://) names calmq's storage. */
async function fetchArtifact(jobId) {
  const answer = await fetch(`${opt.api}/v1/jobs/${jobId}/artifact`,
                             { headers: { Authorization: `Bearer ${opt["api-key"]}` } });
  if (answer.status !== 200) throw new Error(`GET artifact of ${jobId}: HTTP ${answer.status}`);
  return Buffer.from(await answer.arrayBuffer());
}

/** What a service does with one result; here, the line this example prints. */
async function handle(result, eventId) {
  let sha256 = null;
  if (result.artifact) {
    sha256 = createHash("sha256").update(await fetchArtifact(result.job_id)).digest("hex");
    if (sha256 !== result.artifact.sha256) {
      throw new Error(`artifact of ${result.job_id} does not match its digest`);
    }
  }
  // v2 fields: undefined in a v1 event (its writer schema has none of them).
  const metadata = result.metadata ?? null;
  return {
    job_id: result.job_id,
    status: result.status,
    artifact_sha256: sha256,
    error_code: result.error ? result.error.code : null,
    metadata: metadata === null ? null : JSON.parse(metadata),
    event_id: eventId,
    workflow_version: result.workflow_version ?? null,
    usage: result.usage ?? null,
  };
}

// Redelivery repeats an event with the same `id` header. An in-memory set is enough for an
// example; a real service keeps processed ids in its database, with the result.
const seen = new Set();
let printed = 0;
let lastMessage = Date.now();
let done;
const finished = new Promise((resolve, reject) => { done = { resolve, reject }; });

// The idle clock starts once the group is joined: joining takes a few seconds of its own.
let joined = false;
consumer.on(consumer.events.GROUP_JOIN, () => {
  joined = true;
  lastMessage = Date.now();
});
await consumer.connect();
// fromBeginning: a new group starts at the oldest retained result.
await consumer.subscribe({ topic: opt.topic, fromBeginning: true });
await consumer.run({
  autoCommit: false, // commit after processing: at-least-once delivery
  // One partition's messages come in order, one at a time, and a job's events share its key
  // (the job id) and so a partition: a job's later result always comes after its earlier.
  eachMessage: async ({ topic, partition, message }) => {
    if (maxMessages && printed >= maxMessages) return;
    lastMessage = Date.now();
    try {
      const header = (name) => message.headers?.[name]?.toString();
      const eventId = header("id");
      if (header("eventType") === "job.result" && !seen.has(eventId)) {
        const result = await registry.decode(message.value);
        if (!opt["tenant-id"] || opt["tenant-id"] === result.tenant_id) {
          console.log(JSON.stringify(await handle(result, eventId)));
          printed += 1;
        }
        seen.add(eventId);
      }
      await consumer.commitOffsets([{ topic, partition,
                                      offset: (BigInt(message.offset) + 1n).toString() }]);
      if (maxMessages && printed >= maxMessages) done.resolve();
    } catch (error) {
      done.reject(error);
    }
  },
});
const idle = setInterval(() => {
  if (joined && Date.now() - lastMessage > idleMs) done.resolve();
}, 200);
try {
  await finished;
} finally {
  clearInterval(idle);
  await consumer.disconnect(); // leaves the group at once, so its partitions move without a wait
}
