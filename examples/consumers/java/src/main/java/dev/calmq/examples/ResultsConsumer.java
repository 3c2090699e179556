package dev.calmq.examples;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.apicurio.registry.serde.SerdeConfig;
import io.apicurio.registry.serde.avro.AvroKafkaDeserializer;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Duration;
import java.util.Collection;
import java.util.HashMap;
import java.util.HashSet;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRebalanceListener;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.StringDeserializer;

/**
 * A downstream consumer of calmq.results: Apache Kafka's client with Apicurio's Avro
 * deserializer. Prints one JSON line per job result and exits after --max-messages results or
 * --idle-timeout seconds without a message. Every flag also reads an environment variable;
 * the defaults reach the Docker Compose stack from its host (docker-compose.kafka.yml).
 *
 * <pre>mvn -q package && java -jar target/results-consumer.jar --api-key $CALMQ_API_KEY</pre>
 *
 * <p>A secured cluster: --config FILE, a properties file of Kafka consumer properties
 * (security.protocol, sasl.mechanism, sasl.jaas.config or sasl.username and sasl.password,
 * ssl.truststore.* or ssl.ca.location for a PEM CA) and of the registry's
 * (schema.registry.basic.auth.user.info=USER:PASSWORD, schema.registry.ssl.ca.location, or
 * Apicurio's own apicurio.* keys).
 */
public final class ResultsConsumer {
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final HttpClient HTTP = HttpClient.newHttpClient();

    public static void main(String[] argv) throws Exception {
        Map<String, String> opt = options(argv);
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, opt.get("bootstrap"));
        if (opt.get("config") != null) secured(props, opt.get("config"));
        props.put(ConsumerConfig.GROUP_ID_CONFIG, opt.get("group"));
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest"); // a new group starts at the oldest
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, false); // commit after processing
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class);
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, AvroKafkaDeserializer.class);
        // Apicurio's serde speaks the registry's own API (/apis/registry/v2). calmq writes the
        // Confluent wire format (magic byte, 4-byte id), whose ids the registry's ccompat API
        // hands out as content ids: read the 4-byte id as a content id.
        props.put(SerdeConfig.REGISTRY_URL, opt.get("registry").replace("/apis/ccompat/v7", "/apis/registry/v2"));
        props.put(SerdeConfig.ENABLE_CONFLUENT_ID_HANDLER, true);
        props.put(SerdeConfig.USE_ID, "contentId");

        int max = Integer.parseInt(opt.get("max-messages"));
        long idleMillis = (long) (Double.parseDouble(opt.get("idle-timeout")) * 1000);
        String tenant = opt.get("tenant-id");
        // Redelivery repeats an event with the same `id` header. An in-memory set is enough for
        // an example; a real service keeps processed ids in its database, with the result.
        Set<String> seen = new HashSet<>();
        int printed = 0;
        // The idle clock starts once partitions are assigned: joining the group takes seconds
        // of its own (more on a loaded machine), and must not count as idle.
        long[] lastMessage = {System.currentTimeMillis()};
        boolean[] assigned = {false};
        try (KafkaConsumer<String, GenericRecord> consumer = new KafkaConsumer<>(props)) {
            consumer.subscribe(List.of(opt.get("topic")), new ConsumerRebalanceListener() {
                @Override
                public void onPartitionsRevoked(Collection<TopicPartition> partitions) { }

                @Override
                public void onPartitionsAssigned(Collection<TopicPartition> partitions) {
                    assigned[0] = true;
                    lastMessage[0] = System.currentTimeMillis();
                }
            });
            while (max == 0 || printed < max) {
                var records = consumer.poll(Duration.ofSeconds(1));
                if (records.isEmpty()) {
                    if (assigned[0] && System.currentTimeMillis() - lastMessage[0] > idleMillis) break;
                    continue;
                }
                lastMessage[0] = System.currentTimeMillis();
                // One partition's records come in order, and a job's events share its key (the
                // job id) and so a partition: handled one by one, a job's results stay in order.
                for (ConsumerRecord<String, GenericRecord> rec : records) {
                    if (max != 0 && printed >= max) break;
                    String eventId = header(rec, "id");
                    GenericRecord result = rec.value();
                    if ("job.result".equals(header(rec, "eventType")) && seen.add(eventId)
                            && (tenant == null || tenant.equals(result.get("tenant_id").toString()))) {
                        System.out.println(JSON.writeValueAsString(handle(opt, result, eventId)));
                        printed++;
                    }
                    consumer.commitSync(Map.of(new TopicPartition(rec.topic(), rec.partition()),
                            new OffsetAndMetadata(rec.offset() + 1)));
                }
            }
        }
    }

    /** What a service does with one result; here, the line this example prints. */
    static Map<String, Object> handle(Map<String, String> opt, GenericRecord result, String eventId)
            throws Exception {
        String jobId = result.get("job_id").toString();
        GenericRecord artifact = (GenericRecord) result.get("artifact");
        GenericRecord error = (GenericRecord) result.get("error");
        String sha256 = null;
        if (artifact != null) {
            byte[] body = fetchArtifact(opt, jobId);
            sha256 = HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(body));
            if (!sha256.equals(artifact.get("sha256").toString())) {
                throw new IllegalStateException("artifact of " + jobId + " does not match its digest");
            }
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("job_id", jobId);
        out.put("status", result.get("status").toString());
        out.put("artifact_sha256", sha256);
        out.put("error_code", error == null ? null : error.get("code").toString());
        // v2 fields: a v1 event's writer schema has none of them (hasField is false).
        Object metadata = result.hasField("metadata") ? result.get("metadata") : null;
        out.put("metadata", metadata == null ? null : JSON.readTree(metadata.toString()));
        out.put("event_id", eventId);
        out.put("workflow_version", result.hasField("workflow_version") ? result.get("workflow_version") : null);
        GenericRecord usage = result.hasField("usage") ? (GenericRecord) result.get("usage") : null;
        out.put("usage", usage == null ? null : Map.of(
                "input_tokens", usage.get("input_tokens"), "output_tokens", usage.get("output_tokens"),
                "cost_usd", usage.get("cost_usd"), "lane", usage.get("lane").toString()));
        return out;
    }

    /** The artifact's bytes through the API: its URI (file://, s3://) names calmq's storage. */
    static byte[] fetchArtifact(Map<String, String> opt, String jobId) throws Exception {
        HttpRequest req = HttpRequest.newBuilder(URI.create(opt.get("api") + "/v1/jobs/" + jobId + "/artifact"))
                .header("Authorization", "Bearer " + opt.get("api-key"))
                .timeout(Duration.ofSeconds(30))
                .build();
        HttpResponse<byte[]> resp = HTTP.send(req, HttpResponse.BodyHandlers.ofByteArray());
        if (resp.statusCode() != 200) {
            throw new IllegalStateException("GET artifact of " + jobId + ": HTTP " + resp.statusCode());
        }
        return resp.body();
    }

    static String header(ConsumerRecord<?, ?> rec, String name) {
        Header h = rec.headers().lastHeader(name);
        return h == null ? null : new String(h.value(), StandardCharsets.UTF_8);
    }

    /** --name value flags, each defaulting to an environment variable. */
    static Map<String, String> options(String[] argv) {
        Map<String, String> opt = new HashMap<>();
        opt.put("bootstrap", env("CALMQ_KAFKA_BOOTSTRAP", "localhost:29092"));
        opt.put("registry", env("CALMQ_SCHEMA_REGISTRY_URL", "http://localhost:8081/apis/ccompat/v7"));
        opt.put("api", env("CALMQ_API_URL", "http://localhost:8080"));
        opt.put("topic", env("CALMQ_RESULTS_TOPIC", "calmq.results")); // or a tenant's own
        opt.put("config", env("CALMQ_CONSUMER_CONFIG", null)); // a properties file
        opt.put("api-key", env("CALMQ_API_KEY", null));
        opt.put("group", env("CALMQ_CONSUMER_GROUP", "results-example-java"));
        opt.put("tenant-id", env("CALMQ_TENANT_ID", null));
        opt.put("max-messages", env("CALMQ_MAX_MESSAGES", "0")); // 0: no limit
        opt.put("idle-timeout", env("CALMQ_IDLE_TIMEOUT", "30")); // seconds
        for (int i = 0; i + 1 < argv.length; i += 2) {
            String name = argv[i].replaceFirst("^--", "");
            if (!opt.containsKey(name)) throw new IllegalArgumentException("unknown flag " + argv[i]);
            opt.put(name, argv[i + 1]);
        }
        return opt;
    }

    /** The properties file's Kafka keys as they are; librdkafka's names the other examples
     * share (sasl.username/password, ssl.ca.location) and schema.registry.* in Java's terms. */
    static void secured(Properties props, String path) throws Exception {
        Properties file = new Properties();
        try (var in = java.nio.file.Files.newBufferedReader(java.nio.file.Path.of(path))) {
            file.load(in);
        }
        for (String key : file.stringPropertyNames()) {
            String value = file.getProperty(key);
            switch (key) {
                case "sasl.username", "sasl.password" -> { } // below, as a JAAS line
                case "ssl.ca.location" -> {
                    props.put("ssl.truststore.type", "PEM");
                    props.put("ssl.truststore.location", value);
                }
                case "schema.registry.basic.auth.user.info" -> {
                    String[] pair = value.split(":", 2);
                    props.put(SerdeConfig.AUTH_USERNAME, pair[0]);
                    props.put(SerdeConfig.AUTH_PASSWORD, pair.length > 1 ? pair[1] : "");
                }
                case "schema.registry.ssl.ca.location" -> {
                    props.put("apicurio.registry.request.ssl.truststore.type", "PEM");
                    props.put("apicurio.registry.request.ssl.truststore.location", value);
                }
                default -> props.put(key, value);
            }
        }
        String user = file.getProperty("sasl.username");
        if (user != null && !props.containsKey("sasl.jaas.config")) {
            String module = String.valueOf(props.get("sasl.mechanism")).startsWith("SCRAM")
                    ? "org.apache.kafka.common.security.scram.ScramLoginModule"
                    : "org.apache.kafka.common.security.plain.PlainLoginModule";
            props.put("sasl.jaas.config", module + " required username=\"" + user
                    + "\" password=\"" + file.getProperty("sasl.password", "") + "\";");
        }
    }

    static String env(String name, String fallback) {
        String v = System.getenv(name);
        return v == null || v.isEmpty() ? fallback : v;
    }
}
