// Command results-consumer is a downstream consumer of calmq.results: franz-go for Kafka, its
// pkg/sr client for the schema registry, hamba/avro to decode. It prints one JSON line per job
// result and exits after -max-messages results or -idle-timeout without a message. Every flag
// also reads an environment variable (see -help); the defaults reach the Docker Compose stack
// from its host (docker-compose.kafka.yml).
//
//	go build -o results-consumer . && ./results-consumer -api-key "$CALMQ_API_KEY"
//
// A secured cluster: -config FILE, a properties file with the other examples' keys:
// security.protocol (SSL, SASL_SSL, SASL_PLAINTEXT), sasl.mechanism (PLAIN, SCRAM-SHA-256,
// SCRAM-SHA-512), sasl.username, sasl.password, ssl.ca.location (a PEM CA), and
// schema.registry.basic.auth.user.info (USER:PASSWORD), schema.registry.ssl.ca.location.
package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"github.com/twmb/franz-go/pkg/sr"
)

// JobResult holds the fields of job.result this service uses; hamba/avro skips the others.
type JobResult struct {
	JobID    string    `avro:"job_id"`
	TenantID string    `avro:"tenant_id"`
	Status   string    `avro:"status"` // completed, dead_letter or cancelled
	Artifact *Artifact `avro:"artifact"`
	Error    *JobError `avro:"error"`
	// v2 fields: they stay nil when the writer schema (v1) has none.
	Metadata        *string `avro:"metadata"` // the submit's metadata, JSON text
	WorkflowVersion *int    `avro:"workflow_version"`
	Usage           *Usage  `avro:"usage"`
}

type Artifact struct {
	URI    string `avro:"uri"`
	SHA256 string `avro:"sha256"`
}

type JobError struct {
	Code  string `avro:"code"`
	Class string `avro:"class"`
}

type Usage struct {
	InputTokens  int64   `avro:"input_tokens" json:"input_tokens"`
	OutputTokens int64   `avro:"output_tokens" json:"output_tokens"`
	CostUSD      float64 `avro:"cost_usd" json:"cost_usd"`
	Lane         string  `avro:"lane" json:"lane"`
}

// Line is what this example prints for each result.
type Line struct {
	JobID           string          `json:"job_id"`
	Status          string          `json:"status"`
	ArtifactSHA256  *string         `json:"artifact_sha256"`
	ErrorCode       *string         `json:"error_code"`
	Metadata        json.RawMessage `json:"metadata"`
	EventID         string          `json:"event_id"`
	WorkflowVersion *int            `json:"workflow_version"`
	Usage           *Usage          `json:"usage"`
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func main() {
	bootstrap := flag.String("bootstrap", env("CALMQ_KAFKA_BOOTSTRAP", "localhost:29092"), "Kafka bootstrap servers")
	registry := flag.String("registry", env("CALMQ_SCHEMA_REGISTRY_URL", "http://localhost:8081/apis/ccompat/v7"), "Confluent-compatible registry URL")
	api := flag.String("api", env("CALMQ_API_URL", "http://localhost:8080"), "calmq API URL")
	topic := flag.String("topic", env("CALMQ_RESULTS_TOPIC", "calmq.results"), "calmq.results, or a tenant's own")
	config := flag.String("config", env("CALMQ_CONSUMER_CONFIG", ""), "a properties file for a secured cluster")
	apiKey := flag.String("api-key", env("CALMQ_API_KEY", ""), "calmq API key")
	group := flag.String("group", env("CALMQ_CONSUMER_GROUP", "results-example-go"), "consumer group")
	tenant := flag.String("tenant-id", env("CALMQ_TENANT_ID", ""), "print only this tenant's results")
	maxMessages, _ := strconv.Atoi(env("CALMQ_MAX_MESSAGES", "0"))
	flag.IntVar(&maxMessages, "max-messages", maxMessages, "exit after this many results (0: no limit)")
	idleSeconds, _ := strconv.ParseFloat(env("CALMQ_IDLE_TIMEOUT", "30"), 64)
	flag.Float64Var(&idleSeconds, "idle-timeout", idleSeconds, "exit after this many seconds without a message")
	flag.Parse()

	props, err := readProperties(*config)
	if err != nil {
		log.Fatal(err)
	}
	kafkaOpts, registryOpts, err := secured(props)
	if err != nil {
		log.Fatal(err)
	}
	rcl, err := sr.NewClient(append([]sr.ClientOpt{sr.URLs(*registry)}, registryOpts...)...)
	if err != nil {
		log.Fatal(err)
	}
	dec := &decoder{registry: rcl, schemas: map[int]avro.Schema{}}
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(strings.Split(*bootstrap, ",")...),
		kgo.ConsumerGroup(*group),
		kgo.ConsumeTopics(*topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), // a new group starts at the oldest
		kgo.DisableAutoCommit(),                           // commit after processing
	}, kafkaOpts...)...)
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close() // leaves the group at once, so its partitions move without a wait

	// Redelivery repeats an event with the same `id` header. An in-memory set is enough for
	// an example; a real service keeps processed ids in its database, with the result.
	seen := map[string]bool{}
	for printed := 0; maxMessages == 0 || printed < maxMessages; {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(idleSeconds*float64(time.Second)))
		fetches := cl.PollFetches(ctx)
		cancel()
		if fetches.NumRecords() == 0 && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return // idle
		}
		fetches.EachError(func(t string, p int32, err error) { log.Fatalf("fetch %s/%d: %v", t, p, err) })
		// One partition's records come in order, and a job's events share its key (the job
		// id) and so a partition: handled one by one, a job's results stay in order.
		for iter := fetches.RecordIter(); !iter.Done() && (maxMessages == 0 || printed < maxMessages); {
			rec := iter.Next()
			eventID, eventType := header(rec, "id"), header(rec, "eventType")
			if eventType == "job.result" && !seen[eventID] {
				var result JobResult
				if err := dec.decode(context.Background(), rec.Value, &result); err != nil {
					log.Fatalf("decode %s: %v", eventID, err)
				}
				if *tenant == "" || *tenant == result.TenantID {
					line, err := handle(*api, *apiKey, &result, eventID)
					if err != nil {
						log.Fatal(err)
					}
					out, _ := json.Marshal(line)
					fmt.Println(string(out))
					printed++
				}
				seen[eventID] = true
			}
			if err := cl.CommitRecords(context.Background(), rec); err != nil {
				log.Fatalf("commit: %v", err)
			}
		}
	}
}

// handle is what a service does with one result; here, the line this example prints.
func handle(api, key string, r *JobResult, eventID string) (*Line, error) {
	line := &Line{JobID: r.JobID, Status: r.Status, EventID: eventID,
		WorkflowVersion: r.WorkflowVersion, Usage: r.Usage}
	if r.Artifact != nil {
		body, err := fetchArtifact(api, key, r.JobID)
		if err != nil {
			return nil, err
		}
		sum := sha256.Sum256(body)
		digest := hex.EncodeToString(sum[:])
		if digest != r.Artifact.SHA256 {
			return nil, fmt.Errorf("artifact of %s does not match its digest", r.JobID)
		}
		line.ArtifactSHA256 = &digest
	}
	if r.Error != nil {
		line.ErrorCode = &r.Error.Code
	}
	if r.Metadata != nil {
		line.Metadata = json.RawMessage(*r.Metadata)
	}
	return line, nil
}

// fetchArtifact reads the artifact through the API: its URI (file://, s3://) names calmq's storage.
func fetchArtifact(api, key, jobID string) ([]byte, error) {
	req, err := http.NewRequest(http.MethodGet, api+"/v1/jobs/"+jobID+"/artifact", nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET artifact of %s: HTTP %d", jobID, resp.StatusCode)
	}
	return io.ReadAll(resp.Body)
}

func header(rec *kgo.Record, key string) string {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// readProperties reads a .properties file's key=value lines ("" reads nothing).
func readProperties(path string) (map[string]string, error) {
	props := map[string]string{}
	if path == "" {
		return props, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	lines := bufio.NewScanner(f)
	for lines.Scan() {
		line := strings.TrimSpace(lines.Text())
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "!") {
			continue
		}
		key, value, _ := strings.Cut(line, "=")
		props[strings.TrimSpace(key)] = strings.TrimSpace(value)
	}
	return props, lines.Err()
}

// secured turns the properties into franz-go's and the registry client's options.
func secured(props map[string]string) ([]kgo.Opt, []sr.ClientOpt, error) {
	var kafka []kgo.Opt
	var registry []sr.ClientOpt
	protocol := strings.ToUpper(props["security.protocol"])
	if protocol == "SSL" || protocol == "SASL_SSL" {
		conf, err := tlsConfig(props["ssl.ca.location"])
		if err != nil {
			return nil, nil, err
		}
		kafka = append(kafka, kgo.DialTLSConfig(conf))
	}
	if strings.HasPrefix(protocol, "SASL_") {
		user, pass := props["sasl.username"], props["sasl.password"]
		switch strings.ToUpper(props["sasl.mechanism"]) {
		case "SCRAM-SHA-512":
			kafka = append(kafka, kgo.SASL(scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()))
		case "SCRAM-SHA-256":
			kafka = append(kafka, kgo.SASL(scram.Auth{User: user, Pass: pass}.AsSha256Mechanism()))
		case "PLAIN", "":
			kafka = append(kafka, kgo.SASL(plain.Auth{User: user, Pass: pass}.AsMechanism()))
		default:
			return nil, nil, fmt.Errorf("sasl.mechanism %q: this example knows PLAIN and SCRAM", props["sasl.mechanism"])
		}
	}
	if info, ok := props["schema.registry.basic.auth.user.info"]; ok {
		user, pass, _ := strings.Cut(info, ":")
		registry = append(registry, sr.BasicAuth(user, pass))
	}
	if ca, ok := props["schema.registry.ssl.ca.location"]; ok {
		conf, err := tlsConfig(ca)
		if err != nil {
			return nil, nil, err
		}
		registry = append(registry, sr.HTTPClient(&http.Client{
			Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: conf}}))
	}
	return kafka, registry, nil
}

// tlsConfig trusts the PEM CA at path besides the system's ("": the system's alone).
func tlsConfig(path string) (*tls.Config, error) {
	conf := &tls.Config{MinVersion: tls.VersionTLS12}
	if path == "" {
		return conf, nil
	}
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s holds no PEM certificate", path)
	}
	conf.RootCAs = pool
	return conf, nil
}

// decoder reads the Confluent wire format (magic byte 0, 4-byte schema id, Avro body),
// fetching each writer schema from the registry once by its id.
type decoder struct {
	registry *sr.Client
	schemas  map[int]avro.Schema
}

func (d *decoder) decode(ctx context.Context, value []byte, v any) error {
	id, body, err := (&sr.ConfluentHeader{}).DecodeID(value)
	if err != nil {
		return err
	}
	schema, ok := d.schemas[id]
	if !ok {
		s, err := d.registry.SchemaByID(ctx, id)
		if err != nil {
			return err
		}
		if schema, err = avro.Parse(s.Schema); err != nil {
			return err
		}
		d.schemas[id] = schema
	}
	return avro.Unmarshal(schema, body, v)
}
