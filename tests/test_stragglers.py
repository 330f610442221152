"""Backup workers (``--backup-workers b``): a sync round closes on its first W - b pushes, a late push is dropped
(counted, never applied) and answered with the newest parameters; ``client.round`` is the job's global step; each
shard measures how late each worker's pushes come."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Optional

import numpy as np
import pytest
from _helpers import BENCH, RawPeer, needs_shm, serving

import psrt
from psrt import wire
from psrt.config import ClientConfig, ClusterConfig, ServerConfig
from psrt.control.metrics import per_worker
from psrt.control.process import psrt_command
from psrt.control.scheduler import Scheduler
from psrt.errors import ConfigError, ProtocolError
from psrt.shard.server import Server
from psrt.shard.stragglers import Lateness

LR = 0.5
G = np.full(8, 1.0, np.float32)
CFG = ClientConfig(timeout=20, shm=False)


def _server(workers: int = 3, backup: int = 1, **kw) -> ServerConfig:
    return ServerConfig(bind="tcp://127.0.0.1:*", num_workers=workers, backup_workers=backup, shm=False, **kw)


def _clients(server: Server, workers: int = 3, config: ClientConfig = CFG) -> list[psrt.Client]:
    clients = [psrt.Client([server.endpoint], rank=r, num_workers=workers, config=config) for r in range(workers)]
    for c in clients:
        c.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=LR))
    return clients


def _round_of(clients: list[psrt.Client], ranks: list[int]) -> list[dict]:
    """The push_pulls of ``ranks`` together (one round's quorum), waited for."""
    handles = [clients[r].push_pull_async({"w": G}) for r in ranks]
    return [h.wait(20) for h in handles]


def test_a_round_closes_on_w_minus_b_pushes_and_a_late_push_is_dropped_and_answered_with_the_newest():
    with serving(_server()) as server:
        clients = _clients(server)
        try:
            for c in clients:
                assert c.round == 0
            # Round 0: workers 0 and 1 are enough (W - b = 2); the step is their mean, g.
            for got in _round_of(clients, [0, 1]):
                np.testing.assert_array_equal(got["w"], -LR * G)
            assert clients[0].round == clients[1].round == 1
            # Worker 2 computed from version 0: too late. Nothing applied; it gets version 1 at once.
            got = clients[2].push_pull({"w": 100 * G})
            np.testing.assert_array_equal(got["w"], -LR * G)
            assert clients[2].round == 1
            # It rejoins: round 1 by workers 2 and 0; worker 1's push for round 1 comes late.
            for got in _round_of(clients, [2, 0]):
                np.testing.assert_array_equal(got["w"], -2 * LR * G)
            got = clients[1].push_pull({"w": 100 * G})
            np.testing.assert_array_equal(got["w"], -2 * LR * G)
            assert [c.round for c in clients] == [2, 2, 2]
            stats = server.stats()
            assert stats["dropped_pushes"] == 2 and stats["rounds"] == 2 and stats["backup_workers"] == 1
            workers = per_worker(stats)
            assert {r: w["dropped"] for r, w in workers.items()} == {0: 0, 1: 1, 2: 1}
            assert {r: w["pushes"] for r, w in workers.items()} == {0: 2, 1: 2, 2: 2}
            assert all(w["late_p99_s"] >= w["late_p50_s"] >= 0 for w in workers.values())
            assert {w["host"] for w in workers.values()} == {"127.0.0.1"}  # where their connections come from
        finally:
            for c in clients:
                c.close()


def test_a_second_push_from_the_same_parameters_is_dropped_and_its_pull_waits_for_the_open_round():
    with serving(_server()) as server:
        clients = _clients(server)
        try:
            clients[0].push({"w": G})  # joins round 0
            late = clients[0].push_pull_async({"w": 100 * G})  # the same parameters again: dropped at once
            clients[1].push({"w": G})  # round 0 completes with workers 0 and 1
            np.testing.assert_array_equal(late.wait(20)["w"], -LR * G)  # answered once the open round closed
            np.testing.assert_array_equal(clients[1].pull()["w"], -LR * G)
            assert server.stats()["dropped_pushes"] == 1
        finally:
            for c in clients:
                c.close()


def _train(server: Server, clients: list[psrt.Client], rounds: int, pause) -> tuple[list[int], list[list]]:
    """Every client on a thread, ``while client.round < rounds: push_pull(g)``, sleeping ``pause(rank)`` seconds
    before each step; returns each one's steps and (round, parameters) after each."""
    steps, seen, errors = [0] * len(clients), [[] for _ in clients], []

    def loop(rank: int) -> None:
        c = clients[rank]
        try:
            while c.round < rounds:
                threading.Event().wait(pause(rank))
                got = c.push_pull({"w": G})["w"]
                seen[rank].append((c.round, got.copy()))
                steps[rank] += 1
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return steps, seen


def test_with_identical_gradients_every_worker_holds_minus_lr_round_g_whichever_workers_were_dropped():
    # Exactness: each round is the mean of the pushes that made it (g) and nothing is applied twice, so after
    # round r every worker holds -lr * r * g, whatever the order of arrival did to who was dropped.
    rounds, workers, backup = 12, 4, 2
    rngs = [np.random.default_rng(r) for r in range(workers)]
    with serving(_server(workers=workers, backup=backup)) as server:
        clients = _clients(server, workers)
        try:
            _, seen = _train(server, clients, rounds, lambda rank: float(rngs[rank].uniform(0, 0.02)))
            for rank in range(workers):
                for r, got in seen[rank]:
                    np.testing.assert_array_equal(got, np.float32(-LR * r) * G)
            assert [c.round for c in clients] == [rounds] * workers
            stats = server.stats()
            assert stats["rounds"] == rounds
            # Every push was in a round of exactly W - b, or dropped: none applied twice, none lost.
            assert stats["pushes"] == (workers - backup) * rounds + stats["dropped_pushes"]
            assert stats["dropped_pushes"] == sum(w["dropped"] for w in per_worker(stats).values())
        finally:
            for c in clients:
                c.close()


def test_every_worker_of_a_training_loop_stops_at_the_same_round():
    # One worker slow: all end at round N holding -lr * N * g, the slow one having taken fewer steps.
    n, workers = 15, 3
    with serving(_server(workers=workers, backup=1)) as server:
        clients = _clients(server, workers)
        try:
            steps, seen = _train(server, clients, n, lambda rank: 0.05 if rank == 2 else 0.0)
            assert [c.round for c in clients] == [n] * workers
            for rank in range(workers):
                np.testing.assert_array_equal(seen[rank][-1][1], np.float32(-LR * n) * G)
            assert server.stats()["rounds"] == n
            assert sum(steps) >= 2 * n  # each round took W - b pushes
        finally:
            for c in clients:
                c.close()


def test_a_resent_dropped_push_is_a_duplicate_and_a_push_without_base_is_refused():
    with serving(_server(workers=2, backup=1)) as server:
        clients = _clients(server, 2)
        try:
            clients[0].push_pull({"w": G})  # round 0 closes alone (W - b = 1)
            entries = [["w", 0, "<f4", [8]]]
            with RawPeer(server.endpoint) as peer:
                late = wire.encode_push(1, 1, 77, 0, entries, [100 * G], False, 1, base=0)
                head, _ = peer.ask([bytes(f) for f in late])
                assert head["op"] == "ack" and head["versions"] == [1] and not head["duplicate"]
                head, _ = peer.ask([bytes(f) for f in late])  # the same push again: taken once already
                assert head["op"] == "ack" and head["duplicate"]
                old = wire.encode_push(2, 1, 77, 1, entries, [100 * G], False, 1)  # an older client: no base
                head, _ = peer.ask([bytes(f) for f in old])
                assert head["op"] == "error" and head["code"] == "config" and "--backup-workers" in head["message"]
            np.testing.assert_array_equal(clients[0].pull()["w"], -LR * G)  # nothing of worker 1 applied
            assert server.stats()["dropped_pushes"] == 1
        finally:
            for c in clients:
                c.close()


def test_without_backup_workers_rounds_wait_for_everyone():
    with serving(_server(workers=2, backup=0)) as server:
        clients = _clients(server, 2)
        try:
            # (Their pushes say their base all the same, as every sync push does: psrt.shard.realign.)
            assert all(s.backup_workers == 0 and s.sync for c in clients for s in c._senders)
            first = clients[0].push_pull_async({"w": G})
            with pytest.raises(psrt.ShardTimeoutError):
                first.wait(0.3)  # the round waits for worker 1
            clients[1].push_pull({"w": G})
            np.testing.assert_array_equal(clients[0].pull()["w"], -LR * G)
            assert server.stats()["dropped_pushes"] == 0
        finally:
            for c in clients:
                c.close()


def test_backup_workers_must_leave_a_round_at_least_one_push():
    for bad in (-1, 3, 4, True, 1.5):
        with pytest.raises(ConfigError, match="backup_workers"):
            ServerConfig(num_workers=3, backup_workers=bad)
    with pytest.raises(ConfigError, match="less than the number of workers"):
        ClusterConfig(num_workers=2, backup_workers=2)
    with pytest.raises(ConfigError, match="less than the number of workers"):
        Scheduler("tcp://127.0.0.1:*", 1, 2, backup_workers=2)
    assert ServerConfig(num_workers=3, backup_workers=2).backup_workers == 2
    for mode in ("async", "ssp"):
        with pytest.raises(ConfigError, match="--mode sync"):
            ServerConfig(num_workers=3, backup_workers=1, mode=mode)
        with pytest.raises(ConfigError, match="--mode sync"):
            ClusterConfig(num_workers=3, backup_workers=1, mode=mode)


def test_backup_workers_come_from_the_environment_and_the_command_line(monkeypatch, capsys):
    from psrt.cli import main

    monkeypatch.setenv("PSRT_BACKUP_WORKERS", "1")
    assert ServerConfig(num_workers=3).backup_workers == 1
    assert ClusterConfig.from_env().backup_workers == 1
    monkeypatch.delenv("PSRT_BACKUP_WORKERS")
    for argv in (["server", "--workers", "2", "--backup-workers", "2"],
                 ["scheduler", "--workers", "2", "--backup-workers", "3"],
                 ["launch", "-s", "1", "-w", "2", "--backup-workers", "2", "--", "true"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("psrt: error: ") and "backup_workers" in err and len(err.strip().splitlines()) == 1


def test_a_shard_under_a_scheduler_takes_its_backup_workers_from_the_table():
    table = wire.decode_control_reply(wire.encode_table(0, 0, 1, 3, "sync", ["tcp://127.0.0.1:1"],
                                                        backup_workers=2), wire.CONTROL_LIMITS)
    assert table.backup_workers == 2
    plain = wire.encode_table(0, 0, 1, 3, "sync", ["tcp://127.0.0.1:1"])
    assert b"backup_workers" not in bytes(plain[0])  # a job without them: the table older processes know
    assert wire.decode_control_reply(plain, wire.CONTROL_LIMITS).backup_workers == 0
    server = Server(ServerConfig(bind="tcp://127.0.0.1:*", shm=False), scheduled=True)
    try:
        server.join(table)
        assert server.store.backup_workers == 2 and server.config.backup_workers == 2
    finally:
        server.close()


def test_an_init_answer_tells_the_client_to_say_its_base():
    with serving(_server(workers=3, backup=1)) as server:
        clients = _clients(server, 3)
        try:
            assert all(s.backup_workers == 1 for c in clients for s in c._senders)
        finally:
            for c in clients:
                c.close()


@pytest.mark.integration
def test_the_bench_runs_a_launched_job_whose_shard_takes_b_from_the_scheduler(tmp_path):
    # Real processes: psrt launch --backup-workers hands b to the scheduler, whose table hands it to the shard,
    # whose answer to init hands it to the workers; each ends at the same round, exact.
    out = tmp_path / "stragglers.json"
    done = subprocess.run([sys.executable, str(BENCH / "stragglers.py"), "--rounds", "6", "--step-ms", "5",
                           "--stall-s", "0.3", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    for backup in (0, 1):
        workers = result[f"b{backup}"]["workers"]
        assert [w["round"] for w in workers] == [6, 6, 6] and all(w["exact"] for w in workers)
        assert all(w["backup_workers"] == backup for w in workers)
    # (read from the shard's per-worker rows: with b = 1 the stalled worker's late pushes are dropped)
    assert sum(w["dropped"] for w in result["b0"]["workers"]) == 0
    assert sum(w["dropped"] for w in result["b1"]["workers"]) > 0
    assert "ratio b1/b0" in done.stdout


def test_lateness_is_measured_from_the_first_push_of_the_round_a_push_was_computed_for():
    from psrt.shard.store import Store

    store = Store("sync", 3, backup_workers=1)
    entry = store.create(("w", 0), np.zeros(2, np.float32), psrt.SGD(lr=1.0))
    late = Lateness()
    grads = [np.ones(2, np.float32)]
    for rnd, t0 in enumerate((10.0, 20.0, 30.0)):  # rounds 0, 1, 2 opened at t0 by worker 0, closed by worker 1
        late.joined(0, entry, now=t0)
        store.apply_push(0, [entry], grads)
        late.joined(1, entry, now=t0 + 0.5)
        assert store.apply_push(1, [entry], grads)[1] == [0] and entry.version == rnd + 1
    assert store.late(2, [entry], 1) == [True] and store.late(2, [entry], 3) is None
    late.missed(2, entry, 1, now=24.0)  # computed for round 1, which opened at 20
    late.missed(2, entry, [0], now=11.0)  # round 0, which opened at 10
    stats = per_worker(late.stats())
    assert stats[0] == {"pushes": 3, "dropped": 0, "late_p50_s": 0.0, "late_p99_s": 0.0, "host": ""}
    assert stats[1]["late_p50_s"] == 0.5 and stats[1]["dropped"] == 0
    assert stats[2]["dropped"] == 2 and stats[2]["pushes"] == 2
    assert sorted(late.samples[2]) == [1.0, 4.0]


def test_medians_are_taken_again_only_for_workers_sampled_since_and_match_numpy():
    from psrt.shard import stragglers

    rng = np.random.default_rng(7)
    late, oracle = Lateness(), {}
    for rnd in range(3):
        for w in range(6) if rnd == 0 else (1, 4):  # later rounds: two workers only
            for v in rng.exponential(0.01, size=stragglers.SAMPLES // 2 + 3):
                late._sample(w, float(v))
                oracle.setdefault(w, []).append(float(v))
        got = late.medians()
        assert got == {w: float(np.median(vs[-stragglers.SAMPLES:])) for w, vs in oracle.items()}
        assert not late._stale
    # A worker not sampled since keeps the median computed before (none is recomputed for it) ...
    before = dict(late.medians())
    late.samples[0].append(99.0)  # (behind the cache's back: not seen)
    assert late.medians()[0] == before[0]
    # ... and one sampled again is taken again, slow() seeing it at once.
    for _ in range(stragglers.SAMPLES):
        late._sample(5, 2.0)
    assert late.medians()[5] == 2.0 and late._slow()[2] == [5]


def test_psrt_stats_and_prometheus_show_who_is_slow():
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from psrt.cluster.stats import format_workers
    from psrt.control.metrics import ServerCollector

    with serving(_server()) as server:
        clients = _clients(server)
        try:
            _round_of(clients, [0, 1])
            clients[2].push_pull({"w": G})  # late: dropped
            rows = [server.stats()]
            table = format_workers(rows)
            registry = CollectorRegistry()
            registry.register(ServerCollector(server))
            body = generate_latest(registry).decode()
        finally:
            for c in clients:
                c.close()
    lines = table.splitlines()
    assert lines[0].split() == ["worker", "host", "pushes", "late", "p50", "ms", "late", "p99", "ms", "dropped"]
    cells = {int(line.split()[0]): line.split() for line in lines[1:]}
    assert sorted(cells) == [0, 1, 2]
    assert [cells[r][1] for r in range(3)] == ["127.0.0.1"] * 3
    assert [int(cells[r][-1]) for r in range(3)] == [0, 0, 1]  # worker 2 dropped once
    assert float(cells[2][3]) >= 0 and float(cells[2][4]) >= float(cells[2][3])
    endpoint = server.endpoint
    assert f'psrt_server_worker_dropped_pushes_total{{endpoint="{endpoint}",host="127.0.0.1",worker="2"}} 1.0' in body
    assert f'psrt_server_dropped_pushes_total{{endpoint="{endpoint}"}} 1.0' in body
    assert 'psrt_server_worker_lateness_p99_seconds{' in body
    assert f'psrt_server_backup_workers{{endpoint="{endpoint}"}} 1.0' in body
    assert format_workers([{"endpoint": "x", "pushes": 3}]) == ""  # nothing measured (no sync rounds): no table


def test_embedding_tables_in_sync_mode_follow_the_same_rule():
    ids = np.array([3, 1, 7], np.int64)
    rows = np.ones((3, 4), np.float32)
    with serving(_server()) as server:
        clients = _clients(server)  # (the dense init's answer tells each client the shard's b)
        try:
            for c in clients:
                c.init_embedding("e", 4, psrt.SGD(lr=LR), init="zeros")
            for c in clients[:2]:  # round 0 of the table: workers 0 and 1 are enough
                c.pull_rows("e", ids)
                c.push_rows("e", ids, rows)
            got = clients[0].pull_rows("e", ids)
            np.testing.assert_array_equal(got, -LR * rows)
            clients[2].push_rows("e", ids, 100 * rows)  # computed from version 0 (never pulled since): dropped
            np.testing.assert_array_equal(clients[1].pull_rows("e", ids), -LR * rows)
            clients[2].pull_rows("e", ids)  # it rejoins from the newest rows: round 1 with worker 0
            clients[2].push_rows("e", ids, rows)
            clients[0].push_rows("e", ids, rows)
            np.testing.assert_array_equal(clients[2].pull_rows("e", ids), -2 * LR * rows)
            stats = server.stats()
            assert stats["dropped_row_pushes"] == 1 and stats["row_rounds"] == 2
        finally:
            for c in clients:
                c.close()
    # A client of tables alone (no dense init to learn b from) says its base all the same: its pushes are taken.
    # One that does not say it (an older client) is refused by a shard with backup workers, naming the flag.
    with serving(_server(workers=2, backup=1)) as server:
        with psrt.Client([server.endpoint], rank=0, num_workers=2, config=CFG) as c:
            c.init_embedding("e", 4, psrt.SGD(lr=LR), init="zeros")
            c.push_rows("e", ids, rows)  # round 0 closes on its first W - b = 1 push
            np.testing.assert_array_equal(c.pull_rows("e", ids), -LR * rows)
        with RawPeer(server.endpoint) as peer:
            head, _ = peer.ask(wire.encode_push_rows(1, 1, 5, 0, "e", ids, rows))
            assert head["op"] == "error" and "--backup-workers" in head["message"], head
        assert server.stats()["row_pushes"] == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_distributed_optimizer_trains_under_backup_workers(overlap):
    # A dropped step's gradient is discarded and the new parameters land as usual. With one push_pull per step
    # (overlap=False) every round is the mean of gradients computed from the same parameters on the same data, so
    # the model follows single-process SGD exactly; pushed tensor by tensor (overlap) it trains and ends agreed.
    torch = pytest.importorskip("torch")
    import psrt.torch

    n, workers = 10, 3
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x), y)

    ref = model()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.125)
    for _ in range(n):
        sgd.zero_grad()
        loss_of(ref).backward()
        sgd.step()
    with serving(_server(workers=workers, backup=1)) as server:
        clients = [psrt.Client([server.endpoint], rank=r, num_workers=workers, config=CFG) for r in range(workers)]
        models = [model() for _ in range(workers)]
        start = float(loss_of(models[0]).detach())
        opts = [psrt.torch.DistributedOptimizer(m.named_parameters(), psrt.SGD(lr=0.125), client=c, overlap=overlap)
                for m, c in zip(models, clients)]
        errors = []

        def loop(rank: int) -> None:
            try:
                while clients[rank].round < n:
                    if rank == 2:
                        threading.Event().wait(0.03)
                    opts[rank].zero_grad()
                    loss_of(models[rank]).backward()
                    opts[rank].step()
                opts[rank].synchronize()
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=loop, args=(r,)) for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not errors and not any(t.is_alive() for t in threads), errors
            assert [c.round for c in clients] == [n] * workers
            final = [c.pull() for c in clients]
            for other in final[1:]:
                assert all(np.array_equal(final[0][k], other[k]) for k in final[0])
            if not overlap:
                for m in models:
                    for p, q in zip(m.parameters(), ref.parameters()):
                        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
            with torch.no_grad():
                for name, p in models[0].named_parameters():
                    p.copy_(torch.from_numpy(final[0][name]))
            assert float(loss_of(models[0]).detach()) < start
        finally:
            for o in opts:
                o.close()
            for c in clients:
                c.close()


def test_the_round_rule_with_backup_workers_in_fixed_and_elastic_jobs():
    from psrt.shard.stragglers import round_done

    assert round_done({0, 1}, 3, None, frozenset(), 1) and not round_done({0}, 3, None, frozenset(), 1)
    assert round_done({0, 1, 2}, 3, None, frozenset(), 0) and not round_done({0, 1}, 3, None, frozenset(), 0)
    members = frozenset({0, 1, 2, 3})
    assert not round_done({0, 1}, 4, members, members, 1) and round_done({0, 1, 2}, 4, members, members, 1)
    # Members leave: the round waits for all but b of those still there, and at least one push.
    assert round_done({0}, 4, frozenset({0, 1}), members, 1)
    assert round_done({0, 1}, 4, frozenset({0, 1}), members, 0)
    # A worker that finished (fixed job) stops a round only when more than b are missing.
    from psrt.shard.store import Store

    store = Store("sync", 3, backup_workers=1)
    entry = store.create(("w", 0), np.zeros(2, np.float32), psrt.SGD(lr=1.0))
    store.apply_push(0, [entry], [np.ones(2, np.float32)])
    store.finished = frozenset({2})
    assert store.missing_finished(entry) is None and store.missing_finished(entry, 0) is None
    store.finished = frozenset({1, 2})
    assert store.missing_finished(entry) == 1 and store.missing_finished(entry, 0) == 1


def test_the_shard_names_the_workers_far_later_than_the_others(caplog):
    late = Lateness()
    for w, seconds in ((0, 0.001), (1, 0.002), (2, 0.9), (3, 0.0015)):
        late.hosts[w] = f"10.0.0.{w}"
        for _ in range(5):
            late._sample(w, seconds)
    late.dropped[2] = 3
    line = late.slow()
    assert line is not None and "worker 2 (10.0.0.2) 900 ms, 3 of 5 pushes dropped" in line
    assert "worker 0" not in line and "worker 1" not in line and "worker 3" not in line
    even = Lateness()
    for w in range(3):
        even._sample(w, 0.5)
    assert even.slow() is None and Lateness().slow() is None
    with serving(_server()) as server:
        server.lateness = late
        with caplog.at_level("WARNING", logger="psrt.server"):
            assert server.report_slow() == line
        assert line in caplog.text


def test_a_late_push_after_the_others_finished_is_answered_and_a_round_that_cannot_close_is_refused():
    with serving(_server()) as server:
        clients = _clients(server)
        try:
            for c in clients:
                c.init_embedding("e", 2, psrt.SGD(lr=LR), init="zeros")
            _round_of(clients, [0, 1])  # round 0 closes with workers 0 and 1 ...
            for c in clients[:2]:
                c.push_rows("e", np.array([1]), np.ones((1, 2), np.float32))
            # ... which then say done: the scheduler's notice (the serving thread is idle: nothing is in flight)
            server.set_finished([0, 1])
            got = clients[2].push_pull({"w": 100 * G})  # late for round 0: dropped and answered, not refused
            np.testing.assert_array_equal(got["w"], -LR * G)
            clients[2].push_rows("e", np.array([1]), 100 * np.ones((1, 2), np.float32))  # late too: dropped
            with pytest.raises(psrt.PeerFailedError, match="finished"):
                clients[2].push_pull({"w": G})  # round 1 would need a finished worker (2 missing > b = 1)
        finally:
            for c in clients:
                c.close()


def test_a_shard_restored_from_its_checkpoint_keeps_closing_rounds_on_w_minus_b(tmp_path):
    ckpt = dict(checkpoint_dir=str(tmp_path))
    with serving(_server(**ckpt)) as server:
        clients = _clients(server)
        try:
            _round_of(clients, [0, 1])
            clients[2].push_pull({"w": G})  # dropped
            server.checkpoint()
        finally:
            for c in clients:
                c.close()
    with serving(_server(restore=True, **ckpt)) as server:
        assert server.store.backup_workers == 1 and server.store.entries[("w", 0)].version == 1
        clients = _clients(server)  # (new sessions: the stored value wins their init)
        try:
            assert [c.round for c in clients] == [1, 1, 1]
            for got in _round_of(clients, [1, 2]):
                np.testing.assert_array_equal(got["w"], -2 * LR * G)
            np.testing.assert_array_equal(clients[0].push_pull({"w": 100 * G})["w"], -2 * LR * G)  # late
            assert server.stats()["dropped_pushes"] == 1
        finally:
            for c in clients:
                c.close()


@pytest.mark.integration
def test_the_digits_time_to_accuracy_bench_runs_on_loopback(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "stragglers.py"), "--digits", "--loopback", "--workers", "3",
                           "--rounds", "9", "--step-ms", "2", "--straggle-ms", "20", "--target", "0.5",
                           "--eval-every", "3", "--runs", "base,b1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "stragglers_digits.json").read_text())
    # (b=auto's run is the same job with another flag; its rule is tested on threads above and below)
    assert list(result["runs"]) == ["no straggler, b=0", "straggler, b=1"]
    for run in result["runs"].values():
        assert run["curve"][-1][0] == 9 and 0 < run["final_acc"] <= 1 and len(run["steps"]) == 3
    assert "| straggler, b=1 |" in done.stdout


def test_auto_backup_workers_leave_out_a_slow_worker_and_no_one_else():
    from psrt.shard.stragglers import AutoBackup

    def measured(medians: list[float], gap: float) -> Lateness:
        late = Lateness()
        for w, m in enumerate(medians):
            for _ in range(AutoBackup.MIN_SAMPLES):
                late._sample(w, m)
        late.gaps.extend([gap] * 5)
        return late

    auto = AutoBackup(8)
    assert auto.choose(measured([0.0] * 7, 0.02), 0, now=1.0) == 0  # not every worker measured yet: b stays
    assert auto.choose(measured([0.0, 0.001, 0.001, 0.002, 0.001, 0.002, 0.001, 0.3], 0.02), 0, now=2.0) == 1
    assert auto.choose(measured([0.0, 0.001, 0.001, 0.002, 0.001, 0.002, 0.001, 0.3], 0.02), 1, now=2.1) == 1
    assert auto.choose(measured([0.0, 0.001, 0.001, 0.002, 0.001, 0.002, 0.001, 0.002], 0.02), 1, now=3.0) == 0
    assert auto.choose(measured([0.0] + [0.5] * 7, 0.02), 0, now=4.0) <= 4  # at least half the workers
    # Between picks (every tenth of a second) b stays as it is; before any, one backup worker.
    assert auto.choose(measured([0.0] * 7 + [9.0], 0.02), 0, now=4.05) == 0
    assert auto.first() == 1 and AutoBackup(2).first() == 0


def test_backup_workers_auto_reaches_the_shard_and_drops_a_straggler():
    assert ServerConfig(num_workers=3, backup_workers="auto").backup_workers == "auto"
    with pytest.raises(ConfigError, match="--mode sync"):
        ServerConfig(num_workers=3, backup_workers="auto", mode="async")
    table = wire.decode_control_reply(wire.encode_table(0, 0, 1, 3, "sync", ["tcp://127.0.0.1:1"],
                                                        backup_workers="auto"), wire.CONTROL_LIMITS)
    assert table.backup_workers == "auto"
    from psrt.config import parse_backup

    assert parse_backup("auto") == "auto" and parse_backup("2") == 2
    with serving(_server(backup="auto")) as server:
        clients = _clients(server)
        try:
            assert all(s.backup_workers == 2 for c in clients for s in c._senders)  # (W - 1: say your base)
            assert server.store.backup_workers == 1 and server.stats()["backup_auto"] == 1
            _, seen = _train(server, clients, 40, lambda rank: 0.06 if rank == 2 else 0.005)
            for rank in range(3):
                for r, got in seen[rank]:
                    np.testing.assert_array_equal(got, np.float32(-LR * r) * G)
            stats = server.stats()
            # Every round took 2 or 3 pushes (auto waits for at least half the workers); the rest were dropped.
            assert stats["rounds"] == 40 and 2 * 40 <= stats["pushes"] - stats["dropped_pushes"] <= 3 * 40
        finally:
            for c in clients:
                c.close()


@needs_shm(16)
def test_backup_workers_over_shared_memory_lanes():
    # A tensor large enough for the lanes: the push says its base over a lane just as over the socket.
    n = 1 << 16
    g = np.ones(n, np.float32)
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=3, backup_workers=1)) as server:
        clients = [psrt.Client([server.endpoint], rank=r, num_workers=3, config=ClientConfig(timeout=20))
                   for r in range(3)]
        try:
            for c in clients:
                c.init({"w": np.zeros(n, np.float32)}, optimizer=psrt.SGD(lr=LR))
            handles = [clients[r].push_pull_async({"w": g}) for r in (0, 1)]
            for h in handles:
                np.testing.assert_array_equal(h.wait(20)["w"], -LR * g)
            np.testing.assert_array_equal(clients[2].push_pull({"w": 100 * g})["w"], -LR * g)  # late: dropped
            stats = server.stats()
            assert stats["lanes"] == 3 and stats["shm_bytes_in"] > 0 and stats["dropped_pushes"] == 1
        finally:
            for c in clients:
                c.close()


def test_backup_workers_with_replicas_are_taken_by_the_configuration_and_the_scheduler():
    from psrt.control.placement import check_job_replicas

    assert ClusterConfig(num_servers=2, num_workers=3, replicas=1, backup_workers=1).backup_workers == 1
    for backup in (1, "auto"):
        check_job_replicas(1, 2, "sync", False, backup)  # (what psrt launch checks before it starts anything)
        sched = Scheduler("tcp://127.0.0.1:*", 2, 3, replicas=1, backup_workers=backup)
        sched.stop()
        assert sched.serve() == 0  # (stopped at once: it only had to bind)


def _replicated_pair(workers: int = 3, backup: int = 1):
    """A primary (rank 0) and its replica (rank 1) of a job of two shards, R = 1, W = ``workers``, b = ``backup``,
    on threads of this process, given the table a scheduler would give them; and W clients of range 0 alone."""
    def make() -> Server:
        return Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=workers, shm=False), scheduled=True)

    pair = [make(), make()]
    announced = tuple(s.prepare_replication(1) for s in pair)
    info = wire.Replication(1, ((0, 1), (1, 0)), announced, "the-job-token")
    for rank, shard in enumerate(pair):
        shard.join(wire.Table(0, rank, 2, workers, "sync", [s.endpoint for s in pair], replication=info,
                              backup_workers=backup))
    threads = [threading.Thread(target=s.serve, daemon=True) for s in pair]
    for t in threads:
        t.start()
    clients = [psrt.Client([pair[0].endpoint], rank=r, num_workers=workers, config=CFG) for r in range(workers)]
    return pair, threads, clients


def _close_pair(pair, threads, clients) -> None:
    for c in clients:
        c.close()
    for s in pair:
        s.stop()
    for t in threads:
        t.join(10)
    for s in pair:
        s.close()


def test_a_dropped_push_is_settled_on_the_replicas_before_its_drop_is_answered():
    pair, threads, clients = _replicated_pair()
    primary, standby = pair[0], pair[1]._replication._standbys[0]
    try:
        assert standby.store.backup_workers == 1  # the standby closes rounds as its primary does once it serves
        for c in clients:
            c.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=LR))
        _round_of(clients, [0, 1])  # the round closes on W - b = 2 pushes, copied
        np.testing.assert_array_equal(clients[2].push_pull({"w": G})["w"], np.float32(-LR) * G)  # late: dropped
        assert primary.stats()["dropped_pushes"] == 1 and standby.store.entries[("w", 0)].version == 1
        # Answered only once the replica holds its sequence number: sent again there, it is a duplicate.
        assert standby.store.workers[2].last_seq == primary.store.workers[2].last_seq >= 0
    finally:
        _close_pair(pair, threads, clients)


def test_a_push_late_for_one_key_joins_the_others_round_alone_in_what_the_replicas_hold():
    pair, threads, clients = _replicated_pair()
    primary, standby = pair[0], pair[1]._replication._standbys[0]
    try:
        for c in clients:
            c.init({n: np.zeros(8, np.float32) for n in "ab"}, optimizer=psrt.SGD(lr=LR))
        first = clients[0].push_pull_async({"a": G})
        clients[1].push({"a": G})  # a's round closes on two pushes; b's has none yet
        first.wait(20)
        both = clients[2].push_pull_async({"a": G, "b": G})  # late for a (dropped there), joins b's round
        clients[0].push({"b": G})  # b's round closes (workers 2 and 0): copied, with who is settled
        got = both.wait(20)
        for n in "ab":
            np.testing.assert_array_equal(got[n], np.float32(-LR) * G)
            assert standby.store.entries[(n, 0)].version == primary.store.entries[(n, 0)].version == 1
        # Worker 2's push is in every round it joined: settled (a resend is a duplicate), not held open by a.
        assert standby.store.workers[2].last_seq == primary.store.workers[2].last_seq >= 0
    finally:
        _close_pair(pair, threads, clients)


def test_a_replayed_push_late_for_a_key_is_not_applied_to_it():
    from psrt.shard.replication import apply_except
    from psrt.shard.store import Store

    store = Store("sync", 3, backup_workers=1)
    entries = [store.create((n, 0), np.zeros(2, np.float32), psrt.SGD(lr=1.0)) for n in "abc"]
    grads = [np.ones(2, np.float32)] * 3
    targets, completed = apply_except(store, 2, entries, grads, skip={2}, late=[True, False, False])
    assert not entries[0].contributors and entries[1].contributors == {2} and not entries[2].contributors
    assert targets == [0, 1, 0] and completed == []


def _replicated_job(name: str, backup: str, kill_at: int = 0, rounds: int = 60, replicas: int = 1,
                    env: Optional[dict] = None) -> tuple[list[dict], str]:
    """A sync job of S = 2 shards, W = 3 workers (the last one slow), R = ``replicas``, ``--backup-workers
    backup``, training by the round (the ``backup_rounds`` worker); with ``kill_at``, the shard of rank 0 is
    SIGKILLed once worker 0 finished that step. Returns the workers' results and the scheduler's output."""
    import signal

    from _helpers import finish_worker, start_worker, stop_workers

    from psrt.control.process import SCHEDULER_READY, SERVER_READY, Child

    env = {"PSRT_HEARTBEAT_INTERVAL": "0.2", "PSRT_HEARTBEAT_TIMEOUT": "1.0", **(env or {})}
    sched = Child(psrt_command("scheduler", "--bind", "tcp://127.0.0.1:*", "--servers", "2", "--workers", "3",
                               "--replicas", str(replicas), "--backup-workers", backup), label="scheduler",
                  ready=SCHEDULER_READY, env=env)
    children, procs, results = [sched], [], []
    try:
        endpoint = sched.wait_ready(30).group(1)
        children += [Child(psrt_command("server", "--scheduler", endpoint), label=f"shard {i}", ready=SERVER_READY,
                           env=env) for i in range(2)]
        procs = [start_worker("backup_rounds", env={**env, "PSRT_SCHEDULER": endpoint, "PSRT_WORKER_ID": str(r)},
                              rounds=rounds, step_s=0.005, slow_s=0.03) for r in range(3)]
        ready = [c.wait_ready(30) for c in children[1:]]
        if kill_at:
            for line in procs[0].stdout:
                if line.strip() == f"step {kill_at}":
                    break
            primary = [i + 1 for i, m in enumerate(ready) if " rank=0" in m.string]
            assert primary, "\n".join(f"[{c.label}] {c.output}" for c in children)
            children[primary[0]].signal(signal.SIGKILL)
        for p in procs:
            try:
                result, err = finish_worker(p, 90)  # exit 0: no worker saw an error
            except (subprocess.TimeoutExpired, AssertionError) as exc:  # a hang or a failure: say where all were
                stop_workers(procs)
                raise AssertionError("\n".join([str(exc), *(f"[{c.label}] {c.output}" for c in children)])) from exc
            assert "Traceback" not in err, err
            results.append(result)
        assert sched.wait(30) == 0, sched.output
    finally:
        stop_workers(procs)
        for c in children:
            c.stop()
    return results, sched.output


@pytest.mark.parametrize("backup", ["1", "auto"])
@pytest.mark.integration
def test_replicas_keep_the_exact_rule_of_backup_workers_across_a_sigkilled_primary(backup):
    """R = 1 with backup workers: a round closed on W - b pushes is copied, and a dropped late push is settled on
    the replicas before its drop is answered, so a primary SIGKILLed mid-run loses no round and applies no push
    twice: every worker reaches the last round, no error, each answer holding -lr x v x g (v its version), the
    final state that of a run without the kill."""
    rounds = 60
    clean, _ = _replicated_job("clean", backup, rounds=rounds)
    failed, sched = _replicated_job("failover", backup, kill_at=20, rounds=rounds)
    assert "key range 0 is served by its replica, server 1" in sched, sched
    for run in (clean, failed):
        assert [w["round"] for w in run] == [rounds] * 3, run
        assert all(w["exact"] for w in run), run
        # The fast workers close the last round on both shards: every tensor at it, as in the clean run. The slow
        # worker's last push is late, dropped and answered at once with each shard's newest parameters (the rule),
        # and one shard may not have closed the last round yet when it answers: as the fast workers' calls need
        # both shards each round, the shards are never more than a round apart.
        assert [w["versions"] for w in run[:2]] == [[rounds]] * 2, run
        assert rounds in run[2]["versions"] and set(run[2]["versions"]) <= {rounds - 1, rounds}, run
        assert all(w["backup"] == [backup, backup] for w in run), run  # a promoted standby's b is the job's
    assert clean[2]["dropped"] > 0 and clean[2]["steps"] < rounds, clean  # the slow worker was left behind


@pytest.mark.integration
def test_the_scheduler_logs_the_workers_slow_on_every_shard_every_n_rounds_and_at_the_end():
    """The shards' heartbeats say who they find slow; the scheduler names the workers slow on every shard, every
    PSRT_SLOW_EVERY rounds and once at the job's end: the slowed worker, and no fast one."""
    workers, sched = _replicated_job("slow", "0", rounds=80, replicas=0, env={"PSRT_SLOW_EVERY": "20"})
    assert [w["round"] for w in workers] == [80] * 3 and all(w["exact"] for w in workers), workers
    lines = [line for line in sched.splitlines() if "slow workers" in line]
    periodic = [line for line in lines if "slow workers at round" in line]
    final = [line for line in lines if "slow workers at the job's end" in line]
    assert periodic and len(final) == 1, sched
    for line in lines:
        assert "every one of the 2 shards measuring lateness" in line and "worker 2 (" in line, line
        assert "worker 0" not in line and "worker 1" not in line, line
    print(final[0])


def test_a_servers_heartbeat_may_say_who_is_slow_and_old_heartbeats_stay_valid():
    from psrt.control.slow import SlowWorkers

    old = wire.decode_control_request(wire.encode_heartbeat(3, "server", 1, 99, 2))
    assert old.lateness is None and old.epoch == 2
    report = wire.SlowReport(40, 3, 0.002, ((2, 0.25, 30, 12),))
    got = wire.decode_control_request(wire.encode_heartbeat(3, "server", 1, 99, 2, report)).lateness
    assert got == report
    for bad in ([40, 3, 0.002], [40, 3, -1.0, []], [40, 3, 0.0, [[2, 0.1, 3]]], [40, 3, 0.0, [[-2, 0.1, 3, 1]]],
                [40, 3, 0.0, [[2, float("nan"), 3, 1]]], [40, 3, 0.0, [[2, 0.1, 3, 1]] * (wire.MAX_SLOW_ROWS + 1)]):
        frames = wire.encode_heartbeat(3, "server", 1, 99)
        header = wire.unpack_header(frames[0], wire.CONTROL_LIMITS)
        header["lateness"] = bad
        with pytest.raises(ProtocolError, match="lateness"):
            wire.decode_control_request(wire.encode(header))
    # The merge: a worker slow on one shard alone is not the job's straggler; one slow on both is.
    slow = SlowWorkers(every=20)
    assert not slow.add(0, wire.SlowReport(10, 3, 0.001, ((2, 0.2, 10, 4), (1, 0.05, 10, 0))))
    assert slow.add(1, wire.SlowReport(21, 3, 0.001, ((2, 0.3, 10, 5),)))
    line = slow.line()
    assert line is not None and "at round 21" in line
    assert "worker 2 200-300 ms, 9 of its 20 pushes to them dropped" in line
    assert "worker 1" not in line
    assert not slow.add(0, wire.SlowReport(30, 3, 0.001, ())) and slow.line(final=True) is None
    assert slow.add(0, wire.SlowReport(40, 3, 0.001, ()))  # every 20 rounds of the job
