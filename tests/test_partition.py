"""The shard map: splitting, deterministic balanced assignment and message grouping."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrt.errors import ConfigError, ProtocolError
from psrt.partition import (
    MAX_CHUNKS_PER_MESSAGE,
    MIN_PIECE_BYTES,
    NETWORK_PIECE_BYTES,
    PIPELINE_PIECES,
    Chunk,
    PartitionMap,
    busiest_shard,
    joined,
)

MiB = 1 << 20
HSETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
shapes = st.lists(st.integers(0, 14), max_size=2).map(tuple) | st.tuples(st.integers(0, 300))
dtypes = st.sampled_from([np.dtype(np.float32), np.dtype(np.float64)])
spec_maps = st.dictionaries(names, st.tuples(shapes, dtypes), min_size=1, max_size=8)
partition_sizes = st.integers(8, 2400)


def assert_exact_cover(pmap: PartitionMap, specs) -> None:
    """Each tensor's chunks are contiguous, in part order, near-equal, within partition_bytes, and cover it once."""
    for name, (shape, dtype) in specs.items():
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        chunks = pmap.chunks_of([name])
        assert [c.part for c in chunks] == list(range(len(chunks)))
        start = 0
        for c in chunks:
            assert (c.name, c.dtype) == (name, dtype)
            assert c.start == start
            assert c.count >= 0
            assert 0 <= c.shard < pmap.num_shards
            assert c.key == (name, c.part)
            assert c.nbytes == c.count * dtype.itemsize
            start += c.count
        assert start == count
        counts = [c.count for c in chunks]
        assert max(counts) - min(counts) <= 1  # near-equal
        if count * dtype.itemsize <= pmap.partition_bytes:
            assert len(chunks) == 1
        else:
            assert all(c.nbytes <= pmap.partition_bytes for c in chunks)
            # the fewest chunks that respect the limit
            per_chunk = pmap.partition_bytes // dtype.itemsize
            assert len(chunks) == -(-count // per_chunk)


def assignment(pmap: PartitionMap) -> dict[tuple[str, int], tuple[int, int, int]]:
    return {c.key: (c.start, c.count, c.shard) for chunks in pmap.chunks.values() for c in chunks}


def assert_balanced(pmap: PartitionMap) -> None:
    all_chunks = [c for chunks in pmap.chunks.values() for c in chunks]
    loads = [0] * pmap.num_shards
    for c in all_chunks:
        loads[c.shard] += c.nbytes
    assert loads == pmap.shard_bytes
    largest = max((c.nbytes for c in all_chunks), default=0)
    assert max(loads) <= min(loads) + largest


# ---------------------------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "dtype", "partition_bytes", "expected_counts"),
    [
        (10, np.float32, 40, [10]),  # exactly partition_bytes: one chunk
        (11, np.float32, 40, [6, 5]),  # just above: two near-equal chunks
        (21, np.float32, 40, [7, 7, 7]),
        (23, np.float32, 40, [8, 8, 7]),
        (0, np.float32, 40, [0]),
        (1, np.float64, 8, [1]),
        (3, np.float64, 8, [1, 1, 1]),
        (3, np.float32, 10, [2, 1]),  # partition_bytes not a multiple of the item size
        (1000, np.float64, 4096, [500, 500]),
    ],
)
def test_split_counts(count, dtype, partition_bytes, expected_counts):
    pmap = PartitionMap(1, partition_bytes)
    chunks = pmap.add({"t": ((count,), dtype)})
    assert [c.count for c in sorted(chunks, key=lambda c: c.part)] == expected_counts
    assert_exact_cover(pmap, {"t": ((count,), dtype)})


@HSETTINGS
@given(specs=spec_maps, num_shards=st.integers(1, 7), partition_bytes=partition_sizes)
def test_chunks_cover_every_tensor_exactly_once(specs, num_shards, partition_bytes):
    pmap = PartitionMap(num_shards, partition_bytes)
    out = pmap.add(specs)
    assert sorted(c.key for c in out) == sorted(assignment(pmap))
    assert_exact_cover(pmap, specs)
    assert_balanced(pmap)


def test_multidimensional_and_scalar_shapes():
    pmap = PartitionMap(2, 64)
    specs = {"m": ((4, 5, 3), np.float32), "s": ((), np.float64), "e": ((0, 7), np.float32)}
    pmap.add(specs)
    assert_exact_cover(pmap, specs)
    assert pmap.tensors["m"] == ((4, 5, 3), np.dtype(np.float32))
    assert [c.count for c in pmap.chunks_of(["s"])] == [1]
    assert [c.count for c in pmap.chunks_of(["e"])] == [0]


# ---------------------------------------------------------------------------------------------------------------
# Deterministic assignment
# ---------------------------------------------------------------------------------------------------------------


@HSETTINGS
@given(specs=spec_maps, num_shards=st.integers(1, 5), partition_bytes=partition_sizes, seed=st.integers(0, 999))
def test_assignment_is_independent_of_insertion_order(specs, num_shards, partition_bytes, seed):
    items = list(specs.items())
    shuffled = items[:]
    random.Random(seed).shuffle(shuffled)
    a, b = PartitionMap(num_shards, partition_bytes), PartitionMap(num_shards, partition_bytes)
    a.add(dict(items))
    b.add(dict(shuffled))
    assert assignment(a) == assignment(b)
    assert a.shard_bytes == b.shard_bytes
    for name in specs:
        assert a.chunks_of([name]) == b.chunks_of([name])


def test_assignment_is_deterministic_across_instances():
    specs = {f"layer{i}.w": ((i * 37 + 5, 11), np.float32) for i in range(20)}
    specs["emb"] = ((3000, 16), np.float64)
    maps = [PartitionMap(3, 4096) for _ in range(3)]
    for m in maps:
        m.add(specs)
    assert assignment(maps[0]) == assignment(maps[1]) == assignment(maps[2])


def test_largest_first_lowest_shard_on_ties():
    pmap = PartitionMap(3, 1 << 20)
    pmap.add({"small": ((1,), np.float32), "big": ((100,), np.float32), "mid": ((10,), np.float32)})
    shards = {name: pmap.chunks_of([name])[0].shard for name in ("big", "mid", "small")}
    assert shards == {"big": 0, "mid": 1, "small": 2}
    pmap2 = PartitionMap(2, 1 << 20)
    pmap2.add({"b": ((5,), np.float32), "a": ((5,), np.float32)})  # equal sizes: by name
    assert pmap2.chunks_of(["a"])[0].shard == 0 and pmap2.chunks_of(["b"])[0].shard == 1


# ---------------------------------------------------------------------------------------------------------------
# Balance
# ---------------------------------------------------------------------------------------------------------------


@HSETTINGS
@given(
    batches=st.lists(spec_maps, min_size=1, max_size=3), num_shards=st.integers(1, 6),
    partition_bytes=partition_sizes,
)
def test_bytes_are_balanced_across_successive_adds(batches, num_shards, partition_bytes):
    pmap = PartitionMap(num_shards, partition_bytes)
    seen: dict = {}
    for batch in batches:
        batch = {k: v for k, v in batch.items() if k not in seen}
        if not batch:
            continue
        pmap.add(batch)
        seen.update(batch)
        assert_balanced(pmap)
    assert_exact_cover(pmap, seen)


def test_ten_million_float32_over_two_shards_lands_half_on_each():
    n = 10_000_000
    pmap = PartitionMap(2, 4 * MiB)
    chunks = pmap.add({"big": ((n,), np.float32)})
    assert len(chunks) == 2 * PIPELINE_PIECES == 32, "more than the 10 of 4 MiB: PIPELINE_PIECES on each shard"
    assert all(c.nbytes <= 4 * MiB and c.pieces == 32 for c in chunks)
    total = n * 4
    assert sum(pmap.shard_bytes) == total
    assert pmap.shard_bytes == [total // 2, total // 2]
    assert sum(1 for c in chunks if c.shard == 0) == sum(1 for c in chunks if c.shard == 1) == 16


def test_many_equal_tensors_spread_evenly():
    pmap = PartitionMap(4, 1 << 20)
    pmap.add({f"t{i:02d}": ((256,), np.float32) for i in range(40)})
    assert pmap.shard_bytes == [10 * 1024] * 4


def placed_one_by_one(pmap: PartitionMap, specs, loads: list[int]) -> dict[tuple[str, int], int]:
    """The rule itself, slowly: every piece in turn, largest first (then name, part), to the shard holding the
    fewest bytes, ties to the lowest index; ``loads`` are the shards' bytes before, and are updated."""
    probe = PartitionMap(pmap.num_shards, pmap.partition_bytes)
    pieces = sorted(probe.add(specs), key=lambda c: (-c.nbytes, c.name, c.part))  # its cuts, not its shards
    where = {}
    for c in pieces:
        shard = min(range(len(loads)), key=lambda s: (loads[s], s))
        loads[shard] += c.nbytes
        where[c.key] = shard
    return where


# Many equal pieces (ResNet/BERT-like layers cut into MIN_PIECE_BYTES pieces), a few odd sizes and empty tensors,
# over up to 40 shards: the sizes where the assignment's shortcuts (a new map's first round, rounds of equal
# pieces) apply, and where they must not (shards that differ by a piece or more, pieces of no bytes).
equal_piece_specs = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.tuples(st.sampled_from([(0,), (1,), (7,), (65536,), (262144,), (262145,), (1 << 20,), (3 << 20,)]),
              st.just(np.dtype(np.float32))),
    min_size=1, max_size=24)


@HSETTINGS
@given(batches=st.lists(equal_piece_specs, min_size=1, max_size=2), num_shards=st.integers(1, 40),
       partition_bytes=st.sampled_from([65536, 1 << 20, 4 << 20]))
def test_assignment_follows_the_rule_piece_by_piece(batches, num_shards, partition_bytes):
    pmap = PartitionMap(num_shards, partition_bytes)
    loads = [0] * num_shards
    seen: set = set()
    for batch in batches:
        batch = {k: v for k, v in batch.items() if k not in seen}
        if not batch:
            continue
        expected = placed_one_by_one(pmap, batch, loads)
        pmap.add(batch)
        seen |= set(batch)
        assert {c.key: c.shard for c in pmap.chunks_of(sorted(batch))} == expected
        assert pmap.shard_bytes == loads


@HSETTINGS
@given(specs=equal_piece_specs, num_shards=st.integers(1, 40),
       partition_bytes=st.sampled_from([65536, 1 << 20, 4 << 20]))
def test_busiest_shard_is_the_maps_busiest(specs, num_shards, partition_bytes):
    pmap = PartitionMap(num_shards, partition_bytes)
    pmap.add(specs)
    busiest = max(range(num_shards), key=lambda s: pmap.shard_bytes[s])  # the first of equals
    held = [c for name in sorted(specs) for c in pmap.chunks_of([name]) if c.shard == busiest]
    assert busiest_shard(specs, num_shards, partition_bytes) == held
    assert sum(c.nbytes for c in held) == max(pmap.shard_bytes)


def test_busiest_shard_of_a_thousand_shards():
    # 24 tensors of 1 MiB are 192 pieces of NETWORK_PIECE_BYTES at any S > 24: one each on shards 0..191.
    specs = {f"t{i:02d}": ((1 << 18,), np.float32) for i in range(24)}
    (chunk,) = busiest_shard(specs, 1000, 4 << 20)
    assert (chunk.name, chunk.part, chunk.shard, chunk.nbytes) == ("t00", 0, 0, NETWORK_PIECE_BYTES)
    # With every shard on the workers' host, pieces of MIN_PIECE_BYTES: 96, on shards 0..95.
    (chunk,) = busiest_shard(specs, 1000, 4 << 20, network=False)
    assert (chunk.name, chunk.part, chunk.shard, chunk.nbytes) == ("t00", 0, 0, MIN_PIECE_BYTES)
    with pytest.raises(ConfigError, match="at least one shard"):
        busiest_shard(specs, 0, 4 << 20)


# ---------------------------------------------------------------------------------------------------------------
# messages()
# ---------------------------------------------------------------------------------------------------------------


def assert_messages_ok(pmap: PartitionMap, chunks: list[Chunk]) -> dict[int, list[list[Chunk]]]:
    msgs = pmap.messages(chunks)
    flat = [c for shard_msgs in msgs.values() for msg in shard_msgs for c in msg]
    assert sorted(flat, key=lambda c: c.key) == sorted(chunks, key=lambda c: c.key)  # each chunk exactly once
    for shard, shard_msgs in msgs.items():
        for msg in shard_msgs:
            assert msg, "no empty messages"
            assert all(c.shard == shard for c in msg)
            assert len(msg) <= MAX_CHUNKS_PER_MESSAGE
            size = sum(c.nbytes for c in msg)
            assert size <= pmap.partition_bytes or len(msg) == 1
        # order within a shard is the order the chunks were given in
        given_order = [c.key for c in chunks if c.shard == shard]
        assert [c.key for msg in shard_msgs for c in msg] == given_order
    return msgs


@HSETTINGS
@given(specs=spec_maps, num_shards=st.integers(1, 5), partition_bytes=partition_sizes)
def test_messages_group_chunks_within_partition_bytes(specs, num_shards, partition_bytes):
    pmap = PartitionMap(num_shards, partition_bytes)
    pmap.add(specs)
    chunks = pmap.chunks_of(sorted(specs))
    msgs = assert_messages_ok(pmap, chunks)
    # a split tensor's chunks never share a message (any two of them exceed partition_bytes together)
    for shard_msgs in msgs.values():
        for msg in shard_msgs:
            names_in_msg = [c.name for c in msg]
            for name in set(names_in_msg):
                if len(pmap.chunks[name]) > 1:
                    assert names_in_msg.count(name) == 1


def test_small_tensors_share_a_message():
    pmap = PartitionMap(1, 100)
    pmap.add({f"t{i}": ((5,), np.float32) for i in range(10)})  # 20 bytes each
    msgs = assert_messages_ok(pmap, pmap.chunks_of(sorted(pmap.tensors)))
    assert [len(m) for m in msgs[0]] == [5, 5]


def test_message_chunk_count_is_capped():
    n = MAX_CHUNKS_PER_MESSAGE + 10
    pmap = PartitionMap(1, 1 << 30)
    pmap.add({f"t{i:05d}": ((0,), np.float32) for i in range(n)})  # zero bytes each: only the count limit binds
    msgs = assert_messages_ok(pmap, pmap.chunks_of(sorted(pmap.tensors)))
    assert [len(m) for m in msgs[0]] == [MAX_CHUNKS_PER_MESSAGE, 10]


def test_long_names_split_a_message_before_its_header_exceeds_the_limit():
    from psrt import wire

    limit = 1 << 20
    pmap = PartitionMap(1, 1 << 30, limit)
    names = {f"{i:04d}" + "x" * 1020: ((2,), np.float32) for i in range(4096)}  # 4,096 names of 1,024 characters
    pmap.add(names)
    msgs = assert_messages_ok(pmap, pmap.chunks_of(sorted(pmap.tensors)))[0]
    assert len(msgs) > 1
    for msg in msgs:
        entries = [wire.tensor_entry(c.name, c.part, c.dtype, (c.count,)) for c in msg]
        frames = wire.encode_push(1, 0, 2**62, 2**62, entries, [np.zeros(2, np.float32)] * len(msg), True, 2**62)
        assert len(frames[0]) <= limit // 2 + 4096  # one header frame: 4.2 MB before


def test_messages_of_nothing():
    assert PartitionMap(2, 64).messages([]) == {}


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_shards", "partition_bytes"), [(0, 64), (-1, 64), (1, 7), (1, 0)])
def test_bad_construction_raises_config_error(num_shards, partition_bytes):
    with pytest.raises(ConfigError) as info:
        PartitionMap(num_shards, partition_bytes)
    assert isinstance(info.value, ValueError)


def test_adding_a_name_twice_raises():
    pmap = PartitionMap(2, 64)
    pmap.add({"a": ((4,), np.float32)})
    with pytest.raises(ConfigError, match="'a' is already initialized"):
        pmap.add({"a": ((4,), np.float32)})


def test_failed_add_leaves_the_map_unchanged():
    # add() must be all-or-nothing: a rejected batch may not leave some of its tensors half-registered
    # (in ``tensors`` but without chunks), or a later add()/chunks_of() of those names misbehaves.
    pmap = PartitionMap(2, 64)
    pmap.add({"b": ((4,), np.float32)})
    before = (dict(pmap.tensors), assignment(pmap), list(pmap.shard_bytes))
    with pytest.raises(ConfigError, match="'b' is already initialized"):
        pmap.add({"a": ((4,), np.float32), "b": ((4,), np.float32)})
    assert (dict(pmap.tensors), assignment(pmap), list(pmap.shard_bytes)) == before
    pmap.add({"a": ((4,), np.float32)})  # "a" was never added, so this must work
    assert [c.count for c in pmap.chunks_of(["a"])] == [4]


def test_chunks_of_unknown_name_raises():
    pmap = PartitionMap(1, 64)
    with pytest.raises(ConfigError, match="'nope' was never initialized"):
        pmap.chunks_of(["nope"])


def test_a_large_tensor_keeps_every_shard_busy():
    """For a network, a tensor of at least two NETWORK_PIECE_BYTES pieces is cut into PIPELINE_PIECES per shard, a
    multiple of the shard count, where its pieces stay that large."""
    four_mib = PartitionMap(2, 4 << 20).add({"w": ((1 << 20,), np.dtype(np.float32))})
    assert [sum(c.shard == s for c in four_mib) for s in range(2)] == [16, 16]
    assert {c.nbytes for c in four_mib} == {NETWORK_PIECE_BYTES}
    # 4,000,000 bytes hold 30 whole pieces of NETWORK_PIECE_BYTES: 15 on each shard.
    four_mb = PartitionMap(2, 4 << 20).add({"w": ((1_000_000,), np.dtype(np.float32))})
    assert [sum(c.shard == s for c in four_mb) for s in range(2)] == [15, 15]
    assert min(c.nbytes for c in four_mb) >= NETWORK_PIECE_BYTES
    forty_mb = PartitionMap(3, 4 << 20).add({"w": ((10_000_000,), np.dtype(np.float32))})
    assert len(forty_mb) == 48 and [sum(c.shard == s for c in forty_mb) for s in range(3)] == [16, 16, 16]
    # Pieces never shrink below NETWORK_PIECE_BYTES to reach every shard, and one shard takes a tensor whole.
    small = PartitionMap(4, 4 << 20).add({"w": ((75_000,), np.dtype(np.float32))})  # 300 KB
    assert len(small) == 2 and min(c.nbytes for c in small) >= NETWORK_PIECE_BYTES
    assert len(PartitionMap(1, 4 << 20).add({"w": ((50_000,), np.dtype(np.float32))})) == 1  # 200 KB: whole
    # One shard pipelines too: a 4 MB tensor is 16 pieces of 250 KB.
    one = PartitionMap(1, 4 << 20).add({"w": ((1_000_000,), np.dtype(np.float32))})
    assert len(one) == PIPELINE_PIECES and {c.count for c in one} == {62_500}
    # A partition size smaller than the pipeline's pieces is kept (PSRT_PARTITION_BYTES is the user's word).
    assert len(PartitionMap(2, 64 << 10).add({"w": ((1_000_000,), np.dtype(np.float32))})) == 62


@given(count=st.integers(1, 40_000_000), servers=st.integers(1, 40), partition=st.sampled_from([64 << 10, 4 << 20]))
@settings(max_examples=300, deadline=None)
def test_pieces_are_never_smaller_than_network_piece_bytes_nor_fewer_than_the_partition_size_asks(count, servers,
                                                                                            partition):
    chunks = PartitionMap(servers, partition).add({"w": ((count,), np.dtype(np.float32))})
    nbytes, parts = 4 * count, len(chunks)
    by_partition = -(-count // (partition // 4))
    assert parts >= by_partition and max(c.nbytes for c in chunks) <= max(partition, 4)
    if parts > by_partition:  # cut further for the network: pieces stay large, PIPELINE_PIECES per shard at most
        assert min(c.nbytes for c in chunks) >= NETWORK_PIECE_BYTES
        assert parts <= max(-(-by_partition // servers) * servers, PIPELINE_PIECES * servers)
        if nbytes // NETWORK_PIECE_BYTES >= servers:
            assert parts % servers == 0 and len({c.shard for c in chunks}) == servers
    assert all(c.pieces == parts for c in chunks)


def test_with_every_shard_on_this_host_tensors_are_cut_only_to_spread_them():
    """network=False (every endpoint ipc:// or loopback): nothing pipelines, so no piece is cut for it."""
    def cut(servers, count):
        return PartitionMap(servers, 4 << 20, network=False).add({"w": ((count,), np.dtype(np.float32))})

    ten = cut(2, 10_000_000)
    assert len(ten) == 10 and [sum(c.shard == s for c in ten) for s in range(2)] == [5, 5]
    assert sorted(c.shard for c in cut(2, 1_000_000)) == [0, 1]
    assert len(cut(3, 10_000_000)) == 12
    assert len(cut(1, 1_000_000)) == 1
    assert len(cut(4, 150_000)) == 2  # 600 KB: two pieces of at least MIN_PIECE_BYTES


def test_a_sockets_messages_carry_one_piece_each_and_a_lanes_group_them():
    """Over a socket a split tensor's pieces travel apart (a shard answers each as its round completes); over a
    lane they share messages up to partition_bytes, as before the tensor was cut for the network; small whole
    tensors share messages either way."""
    pmap = PartitionMap(2, 4 << 20)
    pmap.add({"w": ((1 << 20,), np.dtype(np.float32)), "b1": ((100,), np.dtype(np.float32)),
              "b2": ((100,), np.dtype(np.float32))})
    chunks = pmap.chunks_of(["b1", "w", "b2"])
    socket, lane = pmap.messages(chunks), pmap.messages(chunks, pipelined=False)
    for shard in (0, 1):
        pieces = [m for m in socket[shard] if m[0].name == "w"]
        assert len(pieces) == PIPELINE_PIECES and all(len(m) == 1 for m in pieces)
        assert sum(len(m) for m in lane[shard]) == sum(len(m) for m in socket[shard])
    assert len(lane[0]) + len(lane[1]) == 2, "a lane's: one message per shard, the biases with the pieces"
    pmap.add({f"c{i}": ((100,), np.dtype(np.float32)) for i in range(6)})
    socket = pmap.messages(pmap.chunks_of([f"c{i}" for i in range(6)]))
    assert sorted(len(socket[shard]) for shard in socket) == [1, 1], "a shard's small tensors share one message"


def test_over_a_network_small_tensors_share_messages_of_at_most_min_piece_bytes():
    """A model of many small tensors (here 16 of 125 KB, none cut) crosses a network in messages of at most
    MIN_PIECE_BYTES, so the shard answers one while the next arrives (in one message of partition_bytes, the
    model crossed the link one way, then the other); over a lane, or in a map cut for one host, they share
    messages up to partition_bytes as before. Every chunk once, in order, either way."""
    specs = {f"t{i:02d}": ((32_000,), np.dtype(np.float32)) for i in range(16)}
    network, one_host = PartitionMap(1, 4 << 20), PartitionMap(1, 4 << 20, network=False)
    for pmap in (network, one_host):
        pmap.add(specs)
    names = sorted(specs)
    socket = network.messages(network.chunks_of(names))[0]
    assert [len(m) for m in socket] == [2] * 8 and all(sum(c.nbytes for c in m) <= MIN_PIECE_BYTES for m in socket)
    assert [c for m in socket for c in m] == network.chunks_of(names)
    assert joined(socket, 4 << 20) == socket, "a call that is not paced sends them as they are"
    assert [len(m) for m in network.messages(network.chunks_of(names), pipelined=False)[0]] == [16]
    assert [len(m) for m in one_host.messages(one_host.chunks_of(names))[0]] == [16]
    # A partition size below MIN_PIECE_BYTES still bounds them.
    small = PartitionMap(1, 200_000)
    small.add(specs)
    assert [len(m) for m in small.messages(small.chunks_of(names))[0]] == [1] * 16




def test_calls_that_are_not_paced_send_a_tensors_pieces_joined():
    """joined: successive pieces of one tensor share a message until it holds MIN_PIECE_BYTES, within
    partition_bytes, a short end joining the message before it; a small tensor's message and pieces of different
    tensors stay apart."""
    pmap = PartitionMap(1, 4 << 20)
    pmap.add({"a": ((1_000_000,), np.dtype(np.float32)), "b": ((75_000,), np.dtype(np.float32)),
              "c": ((10,), np.dtype(np.float32))})
    msgs = pmap.messages(pmap.chunks_of(["a", "b", "c"]))[0]
    assert [len(m) for m in msgs] == [1] * 18 + [1], "16 pieces of a (250 KB), 2 of b (150 KB), then c alone"
    together = joined(msgs, 4 << 20)
    assert [[(c.name, c.part) for c in m] for m in together] == (
        [[("a", 2 * i), ("a", 2 * i + 1)] for i in range(8)] + [[("b", 0), ("b", 1)]] + [[("c", 0)]])
    assert joined(msgs, 290_000) == msgs, "two pieces of 250 KB (or 150 KB) do not fit in 290 KB: each alone"
    odd = PartitionMap(2, 4 << 20)
    odd.add({"w": ((1_000_000,), np.dtype(np.float32))})  # 15 pieces of 133 KB a shard: 6 pairs and a triple
    for shard_msgs in odd.messages(odd.chunks_of(["w"])).values():
        sizes = [sum(c.nbytes for c in m) for m in joined(shard_msgs, 4 << 20)]
        assert [len(m) for m in joined(shard_msgs, 4 << 20)] == [2] * 6 + [3]
        assert min(sizes) >= MIN_PIECE_BYTES and sum(sizes) == 2_000_000
    # Every piece once, in order, whatever the sizes.
    for shard_msgs in odd.messages(odd.chunks_of(["w"])).values():
        assert [c for m in joined(shard_msgs, 300_000) for c in m] == [m[0] for m in shard_msgs]


# ---------------------------------------------------------------------------------------------- the job's cut
def test_a_client_cuts_as_the_schedulers_table_says_whatever_endpoints_it_was_given():
    from psrt.worker.plans import cuts_for_network

    loopback, remote = ["tcp://127.0.0.1:5001", "ipc:///tmp/s1"], ["tcp://127.0.0.1:5001", "tcp://10.9.0.2:5002"]
    # No table: the client's own list decides (every worker listing the same endpoints decides alike).
    assert cuts_for_network("auto", None, loopback) is False
    assert cuts_for_network("auto", None, remote) is True
    # A shard moved to another host after the job formed on this one: a worker joining now cuts as the first did.
    assert cuts_for_network("auto", "host", remote) is False
    assert cuts_for_network("auto", "network", loopback) is True
    # An explicit setting is the user's: it wins over the job's.
    assert cuts_for_network("on", "host", loopback) is True
    assert cuts_for_network("off", "network", remote) is False


def test_the_scheduler_decides_the_cut_once_from_the_endpoints_the_job_formed_with():
    import threading

    from _helpers import scheduling

    from psrt import transport, wire
    from psrt.cluster.stats import job_table
    from psrt.config import ClientConfig
    from psrt.control.link import SchedulerLink

    for endpoints, expected in ((["tcp://127.0.0.1:1", "ipc:///tmp/psrt-nowhere"], "host"),
                                (["tcp://127.0.0.1:1", "tcp://192.0.2.7:2"], "network")):
        with scheduling(2, 1) as sched:
            assert job_table(sched.endpoint, ClientConfig()).cut is None  # not formed: nothing decided yet
            ctx = transport.new_context()
            links = [SchedulerLink(ctx, sched.endpoint) for _ in range(3)]
            tables: list = [None] * 3
            roles = [("server", endpoints[0]), ("server", endpoints[1]), ("worker", "")]

            def register(i: int, links=links, roles=roles, tables=tables) -> None:
                tables[i] = links[i].register(*roles[i], timeout=20.0)
            try:
                threads = [threading.Thread(target=register, args=(i,)) for i in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert [t.cut for t in tables] == [expected] * 3
                assert job_table(sched.endpoint, ClientConfig()).cut == expected
            finally:
                for link in links:
                    link.close()
                ctx.term()
    # On the wire: an optional field, checked; a table without it is an older scheduler's (the client decides).
    frames = wire.encode_table(1, 0, 1, 1, "sync", ["tcp://127.0.0.1:1"], cut="network")
    assert wire.decode_control_reply(frames).cut == "network"
    assert wire.decode_control_reply(wire.encode_table(1, 0, 1, 1, "sync", ["tcp://127.0.0.1:1"])).cut is None
    with pytest.raises(ProtocolError, match="cut"):
        wire.decode_control_reply(wire.encode_table(1, 0, 1, 1, "sync", ["tcp://127.0.0.1:1"], cut="everywhere"))
