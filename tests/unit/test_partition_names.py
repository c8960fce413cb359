"""Partition names, the route -> partition function, the per-partition stream keys and ledger ids."""

from __future__ import annotations

import pytest

from magpie.config import ConfigError, load_settings
from magpie.queue.keys import fnv1a_32
from magpie.queue.partitioned import tag_of
from magpie.queue.partitions import (
    dead_stream_key, partition_names, partition_of, results_stream_key, stream_pairs,
)
from magpie.queue.streams import id_parts, ledger_id, stream_space


def test_one_partition_is_todays_layout_and_more_are_tagged_p0_on():
    assert partition_names(1) == ["default"]
    assert partition_names(3) == ["p0", "p1", "p2"]
    with pytest.raises(ValueError, match="MAGPIE_SCHEDULE_PARTITIONS"):
        partition_names(0)
    with pytest.raises(ValueError):
        partition_names(1025)


def test_partition_of_is_stable_and_independent_of_the_shard():
    hashes = [f"{i:024x}" for i in range(8)]
    assert [partition_of(h, 4) for h in hashes] == [3, 2, 0, 1, 2, 2, 1, 0]  # fixed forever: stored layouts
    assert all(partition_of(h, 1) == 0 for h in hashes)
    many = [f"{i * 7919:024x}" for i in range(16_000)]
    cells: dict[tuple[int, int], int] = {}
    for h in many:
        cell = (partition_of(h, 4), fnv1a_32(h.encode()) % 16)
        cells[cell] = cells.get(cell, 0) + 1
    assert len(cells) == 64  # every partition uses every shard
    assert max(cells.values()) < 1.3 * 16_000 / 64 and min(cells.values()) > 0.7 * 16_000 / 64


def test_stream_keys_keep_todays_names_untagged_and_take_the_tag_otherwise():
    assert results_stream_key("m:", "default", False) == "m:stats:results"
    assert dead_stream_key("m:", "default", False) == "m:stats:dead"
    assert results_stream_key("m:", "p3", True) == "m:{p3}:stats:results"
    assert results_stream_key("m:", "default", True) == "m:{default}:stats:results"  # a cluster forces it
    assert stream_pairs("m:", 1) == [("m:stats:results", "m:stats:dead")]
    pairs = stream_pairs("m:", 2)
    assert pairs[0] == ("m:stats:results", "m:stats:dead") and pairs[3] == ("m:{p1}:stats:results",
                                                                          "m:{p1}:stats:dead")
    assert pairs[1][0] == "m:{default}:stats:results"  # old-partition leases completed during a repartition
    assert stream_pairs("m:", 1, tagged=True) == [("m:stats:results", "m:stats:dead"),
                                                  ("m:{default}:stats:results", "m:{default}:stats:dead")]
    assert stream_pairs("m:", 1, tagged=True, cluster=True) == [("m:{default}:stats:results", "m:{default}:stats:dead")]
    assert tag_of("m:{p12}:proxy_queue:3") == "p12" and tag_of("m:stats:results") is None


def test_ledger_ids_of_partition_streams_never_collide_and_keep_their_order():
    assert ledger_id("17-3", stream_space("m:stats:results")) == "17-3"
    a = ledger_id("17-3", stream_space("m:{p0}:stats:results"))
    b = ledger_id("17-3", stream_space("m:{p1}:stats:results"))
    c = ledger_id("17-3", stream_space("m:{default}:stats:results"))
    assert len({a, b, c, "17-3"}) == 4
    assert id_parts(ledger_id("17-3", 2)) < id_parts(ledger_id("17-4", 2)) < id_parts(ledger_id("18-0", 2))


def test_a_bad_partition_count_is_a_one_line_configuration_error():
    for bad in (0, 1025):
        with pytest.raises(ConfigError) as err:
            load_settings(schedule_partitions=bad)
        assert "MAGPIE_SCHEDULE_PARTITIONS" in str(err.value) and "\n" not in str(err.value)
    assert load_settings(schedule_partitions=8).schedule.partitions == 8
