"""Producer configuration: Java-compatible partitioning and a compression every client reads."""

from __future__ import annotations

import pytest

from calmq.kafka import COMPRESSIONS, DEFAULT_COMPRESSION, producer_config
from calmq.settings import Settings
from tests.support.murmur2 import java_murmur2


@pytest.mark.parametrize(("key", "expected"), [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
])
def test_reference_murmur2_matches_kafkas_own_test_vectors(key: bytes, expected: int) -> None:
    """The test reference gives the values Kafka's UtilsTest.testMurmur2 asserts for Java."""
    assert java_murmur2(key) == expected


def test_producers_partition_keys_as_the_java_client_does() -> None:
    """calmq's producers use librdkafka's murmur2 partitioner, the Java client's formula."""
    assert producer_config("k:9092")["partitioner"] == "murmur2_random"


def test_default_compression_is_one_every_mainstream_client_reads() -> None:
    """Records are uncompressed by default (kafkajs needs no plugin), and the setting agrees."""
    assert DEFAULT_COMPRESSION == "none"
    assert producer_config("k:9092")["compression.type"] == "none"
    assert Settings.model_fields["kafka_compression"].default == DEFAULT_COMPRESSION


def test_compression_is_a_setting_and_lz4_stays_available() -> None:
    """CALMQ_KAFKA_COMPRESSION=lz4 reaches the producer; an unknown codec is a config error."""
    s = Settings.load(environ={"CALMQ_KAFKA_COMPRESSION": "lz4"})
    assert producer_config("k:9092", compression=s.kafka_compression)["compression.type"] == "lz4"
    assert set(COMPRESSIONS) == {"none", "gzip", "snappy", "lz4", "zstd"}
    with pytest.raises(ValueError, match="brotli"):
        producer_config("k:9092", compression="brotli")
