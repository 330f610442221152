"""The performance model's overlapped step (``Scenario.overlap``, :mod:`psrt.emulation.pipesim`), against values
worked out by hand: a step that overlaps its communication costs about max(compute, communication), not their sum."""

from __future__ import annotations

import dataclasses
import math

import pytest

from psrt.emulation import loadgen, perfmodel, pipesim
from psrt.emulation.models import model_tensors
from psrt.errors import ConfigError
from psrt.worker.overlap import DEFAULT_WINDOW

B = 1e5  # bytes/s of the shard link in the hand-worked cases: easy arithmetic


def layers(count: int, nbytes: int, shard: int = 0) -> list[list[tuple[int, int]]]:
    return [[(shard, nbytes)] for _ in range(count)]


def test_a_token_bucket_lets_its_burst_through_at_once_then_the_rate():
    link = pipesim.Link(rate=1000.0, burst=500.0)
    assert link.send(10.0, 400) == 10.0  # an idle link's full bucket takes 400 bytes at once
    assert link.send(10.0, 600) == pytest.approx(10.5)  # 100 left in the bucket, 500 at the rate
    assert link.send(20.0, 1500) == pytest.approx(21.0)  # refilled after 10 s idle: 500 at once, 1000 at the rate
    assert pipesim.Link(math.inf).send(3.0, 10**9) == 3.0  # unshaped
    assert link.busy == pytest.approx(2.5)


def test_one_tensor_cannot_overlap_its_push_and_pull_with_anything():
    # Forward C/3 (the parameters are in), backward 2C/3, then the push (W x 1000 bytes through the shard's
    # link), the round, the pull back: C + 2 W x / B, and each request's half round trip on top.
    for workers in (1, 4):
        out = pipesim.simulate(layers(1, 1000), 1, workers, 1.0, B, math.inf, steps=1)
        assert out.seconds == pytest.approx(1.0 + 2 * workers * 1000 / B)
    out = pipesim.simulate(layers(1, 1000), 1, 4, 1.0, B, math.inf, steps=1, latency_s=0.01)
    assert out.seconds == pytest.approx(1.0 + 2 * 4 * 1000 / B + 2 * 0.01)


def test_a_compute_bound_overlapped_step_exposes_only_the_first_layers_transfer():
    # 8 layers, each pushed while the backward computes the next; the next forward needs the first layer's
    # parameters first, and those are pushed last: C + its push and pull, 2 W m / B.
    workers, m, compute = 4, 1000, 2.0
    out = pipesim.simulate(layers(8, m), 1, workers, compute, B, math.inf)
    assert out.step_s == pytest.approx(compute + 2 * workers * m / B)
    assert out.server_in_s == pytest.approx(workers * 8 * m / B)  # every push crosses the shard's link once


@pytest.mark.parametrize("compute", [0.5, 1.0, 2.0, 4.0])
def test_an_overlapped_step_costs_about_the_larger_of_compute_and_communication(compute):
    # 16 layers, a window of one layer (the first layers overtake the queued later ones): the step takes
    # max(C, T) and a little, T = W M / B the shard link's time for a round, far below C + T.
    workers, model = 16, 8000
    comm = workers * model / B  # 1.28 s
    out = pipesim.simulate(layers(16, model // 16), 1, workers, compute, B, math.inf, window=model // 16)
    assert max(compute, comm) <= out.step_s <= 1.2 * max(compute, comm)
    assert out.step_s < 0.85 * (compute + comm)


def test_a_worker_host_link_is_shared_by_the_workers_it_hosts():
    # An unshaped shard link: only the worker host's link counts, carrying `hosted` workers' bytes.
    one = pipesim.simulate(layers(1, 1000), 1, 4, 1.0, math.inf, B, hosted=1, steps=1)
    four = pipesim.simulate(layers(1, 1000), 1, 4, 1.0, math.inf, B, hosted=4, steps=1)
    assert one.seconds == pytest.approx(1.0 + 2 * 1000 / B)
    assert four.seconds == pytest.approx(1.0 + 2 * 4 * 1000 / B)


def test_a_shard_cpu_serves_each_of_the_w_messages():
    # Link free, CPU not: a push's W messages take W x (o + bytes / R) at the shard, each pull W x o.
    workers, o = 10, 0.01
    out = pipesim.simulate(layers(1, 1000), 1, workers, 1.0, math.inf, math.inf, steps=1, msg_overhead_s=o)
    assert out.seconds == pytest.approx(1.0 + workers * o + workers * o)
    assert out.server_cpu_s == pytest.approx(2 * workers * o)


def test_shards_split_a_layer_and_their_links_work_side_by_side():
    one = pipesim.simulate([[(0, 4000)]], 1, 4, 1.0, B, math.inf, steps=1)
    four = pipesim.simulate([[(s, 1000) for s in range(4)]], 4, 4, 1.0, B, math.inf, steps=1)
    assert one.seconds == pytest.approx(1.0 + 2 * 4 * 4000 / B)
    assert four.seconds == pytest.approx(1.0 + 2 * 4 * 1000 / B)


# ---------------------------------------------------------------------------------------------- through predict()

CAL = perfmodel.Calibration(agg_bytes_per_s=5e9, msg_overhead_s=50e-6, rtt_s=200e-6)


def overlapped(workers: int, servers: int = 1, compute: float = 1.0, steps: int = 0, window: int = DEFAULT_WINDOW,
               cal: perfmodel.Calibration = CAL) -> tuple[perfmodel.Prediction, perfmodel.Scenario]:
    tensors = model_tensors("256KB", layers=8)
    sc = perfmodel.scenario_for(workers, servers, tensors, math.inf, compute, "sync", 8192,
                                server_link_bits=8 * B * 10, overlap=True, window=window, steps=steps)
    return perfmodel.predict(sc, cal), sc


def test_predict_follows_the_overlapped_step_and_keeps_the_serial_model_otherwise():
    layer = 256_000 // 8
    pred, sc = overlapped(16, compute=4.0, window=layer)
    assert sc.overlap and len(sc.layout) == 8 and pred.step_s > 0
    serial = perfmodel.predict(dataclasses.replace(sc, overlap=False), CAL)
    # The serial step computes, then communicates (4 s and 4.3 s); overlapped, about the larger of the two.
    assert serial.step_s > 8.0
    assert pred.step_s < 0.7 * serial.step_s
    assert pred.steps_per_s == pytest.approx(16 / pred.step_s)
    assert pred.terms["server_in_s"] == pytest.approx(16 * sc.model_bytes * sc.wire_overhead / sc.server_link)
    assert overlapped(1, compute=5.0)[0].bottleneck == "compute"
    assert overlapped(256, compute=0.1)[0].bottleneck == "server link"


def test_predict_counts_the_load_generators_timed_window():
    # `steps` timed steps from a quiet start: the first forward waits for nothing, the last step's pulls end it.
    steady, _ = overlapped(16, compute=4.0, window=32_000)
    three, sc = overlapped(16, compute=4.0, window=32_000, steps=3)
    assert three.terms["window_s"] == pytest.approx(3 * three.step_s)
    assert three.steps_per_s != pytest.approx(steady.steps_per_s, rel=1e-6)
    assert sc.steps == 3


def test_the_overlapped_step_is_modelled_for_sync_jobs_with_a_layout():
    tensors = model_tensors("64KB", layers=2)
    with pytest.raises(ConfigError, match="sync"):
        perfmodel.scenario_for(4, 1, tensors, 1e9, 0.1, "async", overlap=True)
    sc = perfmodel.scenario_for(4, 1, tensors, 1e9, 0.1)
    with pytest.raises(ConfigError, match="layout"):
        dataclasses.replace(sc, overlap=True)
    with pytest.raises(ConfigError, match="window"):
        dataclasses.replace(sc, window=0)


def test_the_layout_is_the_partition_maps():
    tensors = [("a", (4096,)), ("b", (1024,))]  # 16 kB and 4 kB
    layout = perfmodel.tensor_layout(tensors, 2, 8192)
    assert layout[0] == ((0, 8192), (1, 8192))  # a's two chunks, one to each shard
    assert len(layout[1]) == 1 and layout[1][0][1] == 4096


def test_the_link_efficiency_slows_shared_links_only_and_is_solved_from_a_run():
    lone, _ = overlapped(1, compute=0.05)
    cal = dataclasses.replace(CAL, link_efficiency=0.7)
    assert overlapped(1, compute=0.05, cal=cal)[0].steps_per_s == pytest.approx(lone.steps_per_s)
    fast, sc = overlapped(64, compute=0.5, steps=2)
    slow = overlapped(64, compute=0.5, steps=2, cal=cal)[0]
    assert slow.steps_per_s < 0.85 * fast.steps_per_s
    # A measured rate round-trips to the efficiency that predicts it.
    assert perfmodel.efficiency_from_run(sc, CAL, slow.steps_per_s) == pytest.approx(0.7, abs=1e-3)
    assert perfmodel.efficiency_from_run(sc, CAL, 2 * fast.steps_per_s) == 1.0  # faster than the model: all of it
    with pytest.raises(ConfigError, match="overlapped"):
        perfmodel.efficiency_from_run(dataclasses.replace(sc, overlap=False, layout=()), CAL, 1.0)


def test_the_overlapped_plateau_is_one_direction_of_the_shard_link():
    _, sc = overlapped(4)
    knee, plateau = perfmodel.saturation_point(sc, CAL)
    assert plateau == pytest.approx(sc.server_link / (sc.shard_bytes * sc.wire_overhead))
    assert knee == pytest.approx(plateau * overlapped(1)[0].step_s)
    assert overlapped(4096, compute=0.2)[0].steps_per_s < plateau


def test_the_model_uses_the_load_generators_own_constants():
    # Scenario's defaults mirror psrt.worker.overlap and the load generator, which the model does not import.
    sc = perfmodel.scenario_for(1, 1, model_tensors("64KB"), 1e9, 0.1)
    assert sc.window == DEFAULT_WINDOW
    assert loadgen.FORWARD_SHARE == pytest.approx(1 / 3)


def test_the_window_is_shared_out_per_shard_so_a_shard_with_credit_is_not_kept_idle():
    # Two tensors on two shards, queued at once (no compute), a window of one tensor: each shard's credit is
    # half of it, at least one push each, so both pushes leave together, and the step takes one tensor's
    # transfer, not two one after the other (what one window over both shards did).
    m, workers = 10_000, 4
    two = pipesim.simulate([[(0, m)], [(1, m)]], 2, workers, 0.0, B, math.inf, window=m, steps=1)
    alone = pipesim.simulate([[(0, m)]], 1, workers, 0.0, B, math.inf, window=m, steps=1)
    assert two.seconds == pytest.approx(alone.seconds)
    # On one shard the same window sends them one after the other, as before: the second push after the first's
    # ack, beside the first's pull (three transfers where a tensor alone takes two).
    one = pipesim.simulate([[(0, m)], [(0, m)]], 1, workers, 0.0, B, math.inf, window=m, steps=1)
    assert one.seconds == pytest.approx(1.5 * alone.seconds)
