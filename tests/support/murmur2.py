"""Kafka's Java ``Utils.murmur2`` and the default partitioner's formula, as a test reference.

Written from ``org.apache.kafka.common.utils.Utils.murmur2`` (seed 0x9747b28c, m 0x5bd1e995,
r 24, little-endian 4-byte words, the tail mixed with fall-through) so a test can say which
partition a Java producer, Kafka Connect or Debezium would choose for a key.
"""

from __future__ import annotations

__all__ = ["java_murmur2", "java_partition"]

_MASK = 0xFFFFFFFF


def java_murmur2(data: bytes) -> int:
    """``Utils.murmur2(data)`` as Java returns it: a signed 32-bit int."""
    length = len(data)
    m, r = 0x5BD1E995, 24
    h = (0x9747B28C ^ length) & _MASK
    for i in range(length // 4):
        k = int.from_bytes(data[i * 4:i * 4 + 4], "little")
        k = (k * m) & _MASK
        k ^= k >> r
        k = (k * m) & _MASK
        h = (h * m) & _MASK
        h ^= k
    tail = length & ~3
    rest = length % 4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & _MASK
    h ^= h >> 13
    h = (h * m) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, partitions: int) -> int:
    """``Utils.toPositive(Utils.murmur2(key)) % partitions``: the Java client's choice."""
    return (java_murmur2(key) & 0x7FFFFFFF) % partitions
