"""KEDA: per pool, the ScaledObject that scales the pool's workers on its consumer lag.

KEDA's Kafka scaler adds replicas while the pool's consumer group lags. As KEDA's
maintainers advise for a group that reads several topics, there is one trigger per pool,
without ``topic``: the scaler then sums the lag over every topic and partition the group
has committed offsets on (a trigger per topic would have the HPA take the largest of them,
not their sum). Two things bound how many replicas help (docs/how-to/autoscaling.md):

- partitions: a consumer without a partition is idle, so never more replicas than the
  partitions of the pool's topics (and ``allowIdleConsumers: false`` tells KEDA the same);
- the token budget: a replica runs ``concurrency`` model calls at once; by Little's law
  the budget keeps ``tokens_per_minute / tokens_per_job * seconds_per_call / 60`` calls in
  flight, so more replicas than that many slots only wait on 429s.

``maxReplicaCount = min(partition count, token-budget cap)``. The budget is
``budget_tokens_per_minute`` (the one the gateway enforces; 0 means none, and then the
partitions alone bound the fleet); tokens per job and seconds per call are the
``keda_*`` estimates. These are computed once, into the chart's values
(calmq/tooling/kubernetes.py: ``default_values``), where a reader sees the numbers.

``lagThreshold`` is the worker's in-flight window (concurrency + an eighth, the jobs it
holds claimed and uncommitted), so a replica counts busy when that window is full, not when
one message waits (``lag_threshold``).

A Kafka that wants TLS or SASL: KEDA reads the lag with the credentials the pods use
(``kafka_auth``). The trigger's metadata says ``tls: enable`` and the ``sasl`` mode; a
``TriggerAuthentication`` per pool (named like its ScaledObject) gives KEDA's Kafka scaler
its parameters from the same places the pods get the settings: a secret setting or a file
from its Secret's key (``secretTargetRef``, the PEM text for ``ca``, ``cert`` and ``key``),
a setting of the ConfigMap from the worker container's variable (``env``, which KEDA
resolves through the container's ``envFrom``). A pool with an ``authenticationRef`` of its
own gets neither: that TriggerAuthentication then carries ``sasl`` and ``tls`` too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from calmq.errors import ConfigError
from calmq.jobs import Priority
from calmq.settings import Settings, claimed_window
from calmq.tooling.manifests import (
    And,
    Context,
    Dashed,
    Expr,
    FullName,
    Key,
    Not,
    Or,
    Printf,
    Spread,
    Text,
    Val,
    When,
    setting_text,
)
from calmq.workflows import Workflow, load_workflows

__all__ = ["API_VERSION", "HELPER", "BudgetCap", "KafkaAuth", "budget_cap", "kafka_auth",
           "lag_threshold", "min_replicas", "needs_trigger_authentication", "pool_scaling", "pools",
           "scaled_object", "trigger_authentication", "worker_name"]

API_VERSION = "keda.sh/v1alpha1"  # ScaledObject and TriggerAuthentication


@dataclass(frozen=True)
class BudgetCap:
    """The token budget's limit on replicas, with the figures it came from."""

    jobs_per_minute: float  # tokens_per_minute / tokens_per_job
    busy_slots: float  # jobs_per_minute * seconds_per_call / 60 (Little's law)
    replicas: int  # floor(busy_slots / concurrency), at least 1


def budget_cap(
    tokens_per_minute: int, tokens_per_job: int, seconds_per_call: float, concurrency: int
) -> BudgetCap:
    """How many replicas of ``concurrency`` slots the budget keeps busy (at least one)."""
    if min(tokens_per_minute, tokens_per_job, concurrency) < 1 or seconds_per_call <= 0:
        raise ConfigError("budget figures and concurrency must be positive")
    jobs_per_minute = tokens_per_minute / tokens_per_job
    busy_slots = jobs_per_minute * seconds_per_call / 60
    # Floor: a replica the budget cannot keep busy only adds 429s. One replica at least, so
    # that a small budget still drains its queue (more slowly).
    return BudgetCap(jobs_per_minute, busy_slots, max(1, math.floor(busy_slots / concurrency)))


def pools(settings: Settings, workflows: dict[str, Workflow] | None = None) -> list[str]:
    """The pools to render: ``keda_pools``, or every pool the workflows (built-in, entry
    points, ``workflow_modules``) route their steps to."""
    if settings.keda_pools.strip():
        return [p.strip() for p in settings.keda_pools.split(",") if p.strip()]
    registry = workflows if workflows is not None else load_workflows(settings)
    found = {step.pool or wf.pool for wf in registry.values() for step in wf.steps}
    return sorted(found)


def worker_name(pool: str) -> str:
    return f"calmq-worker-{pool}".replace("_", "-")


def lag_threshold(settings: Settings) -> int:
    """Messages of lag per replica: the worker's in-flight window unless set.

    KEDA's lag counts every uncommitted offset, and a worker keeps its whole window
    (``claimed_window(concurrency)``) claimed but uncommitted while it runs. A threshold
    below the window counts one busy replica as several and sends the pool to its
    maximum; at the window, a replica counts busy exactly when its window is full.
    """
    return settings.keda_lag_threshold or claimed_window(settings.concurrency)


def min_replicas(settings: Settings) -> int:
    """``keda_min_replicas``, or 1 for a pool that takes interactive work (a person waits
    for it: never a cold start from zero) and 0 for a bulk-only pool."""
    if settings.keda_min_replicas is not None:
        return settings.keda_min_replicas
    return 1 if Priority.INTERACTIVE in settings.priority_list else 0


def pool_scaling(settings: Settings) -> dict[str, Any]:
    """A pool's ``keda`` values, computed from the settings."""
    partitions = len(settings.priority_list) * settings.topic_partitions
    budget = settings.budget_tokens_per_minute
    cap = (budget_cap(budget, settings.keda_tokens_per_job, settings.keda_seconds_per_call,
                      settings.concurrency) if budget else None)
    most = min(partitions, cap.replicas) if cap else partitions
    least = min(min_replicas(settings), most)
    return {
        "enabled": True,
        "minReplicaCount": least,
        "maxReplicaCount": most,
        "lagThreshold": lag_threshold(settings),
        "pollingInterval": 15,
        # KEDA reads cooldownPeriod only for the last step, 1 -> 0 replicas: how long
        # the pool must have had no lag before its last worker stops.
        "cooldownPeriod": 300,
        # When KEDA cannot read the lag (Kafka away, bad credentials) this many times in a
        # row, it holds the pool at fallbackReplicas instead of guessing from nothing.
        "fallback": {"failureThreshold": 3, "replicas": max(least, min(2, most))},
        # A TriggerAuthentication of your own (empty: calmq renders one per pool when the
        # Kafka settings need credentials, from the same Secrets as the pods).
        "authenticationRef": "",
        # Every other scale-down is the HPA's, paced here: a replica stopping waits for
        # its slowest step (terminationGracePeriodSeconds), so shed one at a time and only
        # after the lag has stayed low for five minutes.
        "behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 300,
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            "scaleUp": {"stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]},
        },
    }


# KEDA's Kafka scaler (https://keda.sh/docs/2.16/scalers/apache-kafka/, "Authentication
# Parameters"; pkg/scalers/kafka_scaler.go: parseKafkaAuthParams): its sasl mode for each
# librdkafka mechanism, and each parameter with the calmq setting it comes from. The third
# field, when not empty, is the error for a parameter KEDA cannot do without.
KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256",
             "SCRAM-SHA-512": "scram_sha512", "OAUTHBEARER": "oauthbearer"}
_NEEDS = "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs "
_HELD_IN = " (secretSettings.{0}: the secretName and key of the Secret that holds it)"
_SASL_PARAMS = (
    ("username", "kafka_sasl_username", _NEEDS + "config.kafka_sasl_username"),
    ("password", "kafka_sasl_password",
     _NEEDS + "kafka_sasl_password" + _HELD_IN.format("kafka_sasl_password")),
)
# OAUTHBEARER with a token endpoint: KEDA's username and password are the OAuth client's
# id and secret (client credentials), as librdkafka's oidc method uses them.
_OIDC_PARAMS = (
    ("username", "kafka_sasl_oauthbearer_client_id",
     _NEEDS + "config.kafka_sasl_oauthbearer_client_id"),
    ("password", "kafka_sasl_oauthbearer_client_secret",
     _NEEDS + "kafka_sasl_oauthbearer_client_secret"
     + _HELD_IN.format("kafka_sasl_oauthbearer_client_secret")),
    ("oauthTokenEndpointUri", "kafka_sasl_oauthbearer_token_endpoint_url",
     _NEEDS + "config.kafka_sasl_oauthbearer_token_endpoint_url"),
    ("scopes", "kafka_sasl_oauthbearer_scope", ""),
    ("oauthExtensions", "kafka_sasl_oauthbearer_extensions", ""),
)
# TLS: the CA and the client certificate and key as PEM text, from the Secret keys the pods
# mount (secretFiles); without a CA KEDA trusts the system's, as librdkafka does.
_TLS_PARAMS = (
    ("ca", "kafka_ssl_ca_location", ""),
    ("cert", "kafka_ssl_certificate_location", ""),
    ("key", "kafka_ssl_key_location", ""),
    ("keyPassword", "kafka_ssl_key_password", ""),
)
_MSK_REGION = ("config.kafka_sasl_oauthbearer_method is aws_msk_iam: KEDA's Kafka scaler "
               "needs config.kafka_sasl_oauthbearer_aws_region (its ScaledObject's awsRegion)")
# KEDA resolves an env parameter from this container of the ScaledObject's target.
_WORKER_CONTAINER = "worker"


def kafka_auth(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """KEDA's view of the values' Kafka security: ``metadata`` (the trigger's ``tls``,
    ``sasl`` and, for MSK IAM, ``saslTokenProvider`` and ``awsRegion``) and ``spec`` (the
    TriggerAuthentication's ``secretTargetRef``, ``env`` and ``podIdentity``; empty when
    KEDA needs no credentials). The chart's ``calmq.kedaKafkaAuth`` helper (``HELPER``)
    computes the same. Raises ConfigError when KEDA would lack a parameter it needs."""
    config = values.get("config") or {}
    secrets = values.get("secretSettings") or {}
    files = values.get("secretFiles") or {}

    def text(name: str) -> str:
        return setting_text(config.get(name, ""))

    protocol, mechanism = text("kafka_security_protocol"), text("kafka_sasl_mechanism")
    meta: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    params: list[tuple[str, str, str]] = []
    tls = protocol in ("SSL", "SASL_SSL")
    if tls:
        meta["tls"] = "enable"
    sasl = KEDA_SASL.get(mechanism, "")
    if protocol.startswith("SASL_") and sasl:
        meta["sasl"] = sasl
        if mechanism != "OAUTHBEARER":
            params += _SASL_PARAMS
        elif text("kafka_sasl_oauthbearer_method") == "aws_msk_iam":
            # KEDA signs with the worker's own AWS role (IRSA on its ServiceAccount).
            region = config.get("kafka_sasl_oauthbearer_aws_region")
            if region is None or region == "":
                raise ConfigError(_MSK_REGION, code="invalid_values")
            meta.update({"saslTokenProvider": "aws_msk_iam", "awsRegion": region})
            spec["podIdentity"] = {"provider": "aws", "identityOwner": "workload"}
        else:
            params += _OIDC_PARAMS
    if tls:
        params += _TLS_PARAMS
    refs: list[dict[str, Any]] = []
    env: list[dict[str, Any]] = []
    for parameter, setting, missing in params:
        # A file setting's file is a Secret's key (secretFiles); any other setting is read
        # from a Secret's key as a variable (secretSettings) or as a file (secretFiles, its
        # _FILE variable), else from the ConfigMap.
        is_file = setting.endswith("_location")
        ref: Any = files.get(setting)
        if not is_file and _names_a_secret(secrets.get(setting)):
            ref = secrets[setting]
        if _names_a_secret(ref):
            refs.append({"parameter": parameter, "name": ref["secretName"],
                         "key": ref.get("key")})
        elif not is_file and text(setting):
            env.append({"parameter": parameter, "name": f"CALMQ_{setting.upper()}",
                        "containerName": _WORKER_CONTAINER})
        elif missing:
            raise ConfigError(missing, code="invalid_values")
    if refs:
        spec["secretTargetRef"] = refs
    if env:
        spec["env"] = env
    return {"metadata": meta, "spec": spec}


def _names_a_secret(entry: Any) -> bool:
    return isinstance(entry, Mapping) and bool(entry.get("secretName"))


def _go_params(params: tuple[tuple[str, str, str], ...]) -> str:
    return "(list " + " ".join(
        f"(list {json.dumps(p)} {json.dumps(s)} {json.dumps(m)})" for p, s, m in params) + ")"


# The Go twin of kafka_auth, for the chart's _helpers.tpl: the same tables, the same steps.
HELPER = """\
{{/* KEDA's view of the Kafka security settings (calmq/tooling/keda.py: kafka_auth):
JSON {"metadata": trigger metadata, "spec": TriggerAuthentication spec}. */}}
{{- define "calmq.kedaKafkaAuth" -}}
{{- $config := .Values.config | default dict -}}
{{- $secrets := .Values.secretSettings | default dict -}}
{{- $files := .Values.secretFiles | default dict -}}
{{- $protocol := include "calmq.text" (get $config "kafka_security_protocol") -}}
{{- $mechanism := include "calmq.text" (get $config "kafka_sasl_mechanism") -}}
{{- $meta := dict -}}
{{- $spec := dict -}}
{{- $params := list -}}
{{- $tls := has $protocol (list "SSL" "SASL_SSL") -}}
{{- if $tls -}}{{- $_ := set $meta "tls" "enable" -}}{{- end -}}
{{- $sasl := get (dict @SASL@) $mechanism -}}
{{- if and (hasPrefix "SASL_" $protocol) $sasl -}}
{{- $_ := set $meta "sasl" $sasl -}}
{{- if ne $mechanism "OAUTHBEARER" -}}
{{- $params = @SASL_PARAMS@ -}}
{{- else if eq (include "calmq.text" (get $config "kafka_sasl_oauthbearer_method")) \
"aws_msk_iam" -}}
{{- $_ := set $meta "saslTokenProvider" "aws_msk_iam" -}}
{{- $_ := set $meta "awsRegion" \
(required @MSK_REGION@ (get $config "kafka_sasl_oauthbearer_aws_region")) -}}
{{- $_ := set $spec "podIdentity" (dict "provider" "aws" "identityOwner" "workload") -}}
{{- else -}}
{{- $params = @OIDC_PARAMS@ -}}
{{- end -}}
{{- end -}}
{{- if $tls -}}{{- $params = concat $params @TLS_PARAMS@ -}}{{- end -}}
{{- $refs := list -}}
{{- $env := list -}}
{{- range $params -}}
{{- $file := hasSuffix "_location" (index . 1) -}}
{{- $ref := get $files (index . 1) -}}
{{- if not $file -}}
{{- $secret := get $secrets (index . 1) -}}
{{- if and (kindIs "map" $secret) (dig "secretName" "" $secret) -}}{{- $ref = $secret -}}{{- end -}}
{{- end -}}
{{- if and (kindIs "map" $ref) (dig "secretName" "" $ref) -}}
{{- $refs = append $refs \
(dict "parameter" (index . 0) "name" $ref.secretName "key" (dig "key" nil $ref)) -}}
{{- else if and (not $file) (include "calmq.text" (get $config (index . 1))) -}}
{{- $env = append $env (dict "parameter" (index . 0) \
"name" (printf "CALMQ_%s" (upper (index . 1))) "containerName" @CONTAINER@) -}}
{{- else if index . 2 -}}
{{- fail (index . 2) -}}
{{- end -}}
{{- end -}}
{{- if $refs -}}{{- $_ := set $spec "secretTargetRef" $refs -}}{{- end -}}
{{- if $env -}}{{- $_ := set $spec "env" $env -}}{{- end -}}
{{- toJson (dict "metadata" $meta "spec" $spec) -}}
{{- end -}}
"""
for _name, _text in (
        ("@SASL@", " ".join(f"{json.dumps(k)} {json.dumps(v)}" for k, v in KEDA_SASL.items())),
        ("@SASL_PARAMS@", _go_params(_SASL_PARAMS)), ("@OIDC_PARAMS@", _go_params(_OIDC_PARAMS)),
        ("@TLS_PARAMS@", _go_params(_TLS_PARAMS)), ("@MSK_REGION@", json.dumps(_MSK_REGION)),
        ("@CONTAINER@", json.dumps(_WORKER_CONTAINER))):
    HELPER = HELPER.replace(_name, _text)


@dataclass(frozen=True)
class KafkaAuth(Expr):
    """``kafka_auth``'s ``metadata`` or ``spec`` for the values (Go: the chart's helper)."""

    part: str

    def evaluate(self, ctx: Context) -> Any:
        return kafka_auth(ctx.values)[self.part]

    def go(self) -> str:
        return f'(get (include "calmq.kedaKafkaAuth" $ | fromJson) {json.dumps(self.part)})'


def _worker_name() -> Printf:
    return Printf("%s-worker-%s", FullName(), Dashed(Key("pool")))


def _own_auth_name() -> Any:
    """The pool's TriggerAuthentication, when KEDA needs credentials and the pool names
    none of its own."""
    return And((KafkaAuth("spec"), _worker_name()))


def trigger_authentication(meta: Any) -> dict[str, Any]:
    """The TriggerAuthentication of the pool bound to the scope ``pool``: the credentials
    KEDA's Kafka scaler reads the lag with (``kafka_auth``)."""
    return {"apiVersion": API_VERSION, "kind": "TriggerAuthentication",
            "metadata": meta, "spec": KafkaAuth("spec")}


def needs_trigger_authentication() -> Any:
    """Whether the pool bound to ``pool`` gets ``trigger_authentication``."""
    return And((Not(Val(("keda", "authenticationRef"), "pool")), KafkaAuth("spec")))


def scaled_object(meta: Any) -> dict[str, Any]:
    """The ScaledObject of the pool bound to the scope ``pool`` (``meta`` makes its
    metadata); every number is the pool's ``keda`` value."""

    def pool(*path: str, block: bool = False) -> Val:
        return Val(("keda", *path), "pool", block=block)

    name = _worker_name()
    auth = Or((pool("authenticationRef"), _own_auth_name()))
    return {
        "apiVersion": API_VERSION,
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": pool("minReplicaCount"),
            "maxReplicaCount": pool("maxReplicaCount"),
            "pollingInterval": pool("pollingInterval"),
            "cooldownPeriod": pool("cooldownPeriod"),
            "fallback": {"failureThreshold": pool("fallback", "failureThreshold"),
                         "replicas": pool("fallback", "replicas")},
            "advanced": {"horizontalPodAutoscalerConfig": {
                "behavior": pool("behavior", block=True)}},
            "triggers": [{
                "type": "kafka",
                "metadata": {
                    "bootstrapServers": Text(Val(("config", "kafka_bootstrap"))),
                    # The group processors/worker.py joins; no topic: the lag of every
                    # topic the group reads (calmq.<pool>.interactive and .bulk), summed.
                    # Behind the environment's name_prefix, as calmq.topics names it.
                    "consumerGroup": Printf(
                        "%scalmq.%s", Text(Or((Val(("config", "name_prefix")), ""))),
                        Key("pool")),
                    "lagThreshold": Text(pool("lagThreshold")),
                    "offsetResetPolicy": "earliest",
                    "allowIdleConsumers": "false",
                    # tls and sasl, unless the pool's own TriggerAuthentication says them
                    # (KEDA refuses them in both places).
                    Spread(And((Not(pool("authenticationRef")), KafkaAuth("metadata")))): None,
                },
                "authenticationRef": When(auth, {"name": auth}),
            }],
        },
    }
