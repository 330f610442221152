"""psrt.torch: DistributedOptimizer against torch.optim, hooks, accumulation, dtypes, frozen and late workers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _helpers import run_workers, whole_window  # noqa: E402
from _workers import batches, make_cnn  # noqa: E402

import psrt  # noqa: E402
import psrt.torch  # noqa: E402
from psrt.errors import ConfigError, PsrtTypeError  # noqa: E402

pytestmark = pytest.mark.integration

SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}


def torch_reference(initial: dict[str, np.ndarray], steps: int, passes: int = 1, model=None) -> dict[str, np.ndarray]:
    """Single-process torch.optim.SGD on the whole of every batch, from ``initial``."""
    model = make_cnn(0) if model is None else model
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(torch.from_numpy(initial[k]))
    opt = torch.optim.SGD(model.parameters(), **SGD)
    for x, y in batches(steps):
        opt.zero_grad()
        for part in range(passes):
            torch.nn.functional.cross_entropy(model(x[part::passes]), y[part::passes]).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def max_relative_error(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(actual[k] - expected[k]).max() / np.abs(expected[k]).max()) for k in expected)


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_two_sync_workers_on_half_batches_match_torch_on_the_whole_batch(shards, tmp_path, overlap_forward):
    """The default reads the parameters right after the loop, no synchronize(); overlap_forward reads after it."""
    steps = 30
    group = shards(2, workers=2, mode="sync")
    run_workers("torch_cnn", [dict(servers=group.endpoints, rank=r, workers=2, steps=steps,
                                   out=str(tmp_path / f"w{r}.npz"), overlap_forward=overlap_forward,
                                   synchronize=overlap_forward, **SGD) for r in range(2)])
    w0, w1 = (np.load(tmp_path / f"w{r}.npz") for r in range(2))
    names = [k.split("/", 1)[1] for k in w0.files if k.startswith("initial/")]
    for k in names:  # construction made both workers identical: the first init won
        np.testing.assert_array_equal(w0[f"initial/{k}"], w1[f"initial/{k}"])
        np.testing.assert_array_equal(w0[f"final/{k}"], w1[f"final/{k}"])
    expected = torch_reference({k: w0[f"initial/{k}"] for k in names}, steps)
    error = max_relative_error({k: w0[f"final/{k}"] for k in names}, expected)
    print(f"max relative error after {steps} steps: {error:.3g}")
    assert error < 1e-4
    assert max_relative_error({k: w0[f"initial/{k}"] for k in names}, expected) > 0.1  # it did train


def local_optimizer(group, model, rank=0, workers=1, **kw):
    client = psrt.Client(group.endpoints, rank=rank, num_workers=workers)
    return psrt.torch.DistributedOptimizer(model.named_parameters(), optimizer=psrt.SGD(**SGD), client=client, **kw)


@pytest.mark.parametrize("overlap, overlap_forward", [(True, False), (True, True), (False, False)])
def test_hooks_push_each_parameter_once_per_step_in_backward_order(shards, monkeypatch, overlap, overlap_forward):
    whole_window(monkeypatch)
    model = make_cnn(0)
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    opt = local_optimizer(shards(1), model, overlap=overlap, overlap_forward=overlap_forward)
    pushed: list[list[str]] = []
    push_async = opt.client.push_async
    opt.client.push_async = lambda grads: pushed[-1].extend(grads) or push_async(grads)
    for x, y in batches(5):
        pushed.append([])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()
    names = [n for n, _ in model.named_parameters()]
    if overlap:  # one push per parameter, in the order backward produced the gradients (last layers first)
        for order in pushed:
            assert sorted(order) == sorted(names)
            layers = [int(n.split(".")[0]) for n in order]
            assert layers == sorted(layers, reverse=True)
    else:  # all at once, at step(): the serial baseline
        assert pushed == [[]] * 5
    actual = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert max_relative_error(actual, torch_reference(initial, 5)) < 1e-10
    opt.close()


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_accumulation_pushes_the_sum_once_after_the_last_pass(shards, monkeypatch, overlap_forward):
    whole_window(monkeypatch)
    model = make_cnn(0)
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    opt = local_optimizer(shards(1), model, backward_passes_per_step=2, overlap_forward=overlap_forward)
    count = []
    push_async = opt.client.push_async
    opt.client.push_async = lambda grads: count.append(1) or push_async(grads)
    for step, (x, y) in enumerate(batches(4)):
        opt.zero_grad()
        for part in range(2):
            torch.nn.functional.cross_entropy(model(x[part::2]), y[part::2]).backward()
            assert len(count) == 6 * (step + part)  # nothing on the first pass, every parameter on the last
        opt.step()
    opt.synchronize()
    assert len(count) == 4 * 6
    actual = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert max_relative_error(actual, torch_reference(initial, 4, passes=2)) < 1e-10
    # A third pass before step() is a clear error, not a silent double count.
    x, y = batches(1)[0]
    opt.zero_grad()
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ConfigError, match="backward_passes_per_step=2"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.close()


def test_after_each_step_the_model_holds_what_the_shard_holds(shards):
    """No synchronize(): every read right after step() (p.data, state_dict) sees this step's new values."""
    model, ref = make_cnn(0), make_cnn(0)
    opt = local_optimizer(shards(2), model)
    topt = torch.optim.SGD(ref.parameters(), **SGD)
    for step, (x, y) in enumerate(batches(6)):
        for m, o in ((model, opt), (ref, topt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        read = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        stored = opt.client.pull()  # nothing is in flight: the shards' current values
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            np.testing.assert_array_equal(read[name], stored[name], err_msg=f"step {step}: {name}")
            np.testing.assert_array_equal(p.data.numpy(), stored[name], err_msg=f"step {step}: {name}")
            np.testing.assert_allclose(p.data.numpy(), q.detach().numpy(), rtol=1e-10, atol=1e-12,
                                       err_msg=f"step {step}: {name}")
    opt.close()


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_zero_grad_in_place_waits_for_the_pushes_and_trains_as_torch(shards, overlap_forward):
    model, ref = make_cnn(0), make_cnn(0)
    opt = local_optimizer(shards(1), model, overlap_forward=overlap_forward)
    topt = torch.optim.SGD(ref.parameters(), **SGD)
    for x, y in batches(4):
        for m, o in ((model, opt), (ref, topt)):
            o.zero_grad(set_to_none=False)  # right after step(): overwrites memory the last pushes were sent from
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    opt.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    opt.close()


def test_overlap_forward_without_overlap_is_refused(shards):
    with pytest.raises(ConfigError, match="overlap=True"):
        local_optimizer(shards(1), make_cnn(0), overlap=False, overlap_forward=True)


class Mixed(torch.nn.Module):
    """A float32 layer feeding a float64 one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double())


def test_mixed_float32_and_float64_parameters_are_each_kept_in_their_dtype(shards):
    model, ref = Mixed(), Mixed()
    opt = local_optimizer(shards(1), model)
    topt = torch.optim.SGD(ref.parameters(), **SGD)
    assert opt.client.partition.tensors["a.weight"][1] == np.float32
    assert opt.client.partition.tensors["b.weight"][1] == np.float64
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(8, 6, generator=g)
        for m, o in ((model, opt), (ref, topt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    opt.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == q.dtype
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    opt.close()


def test_unsupported_parameters_are_refused_clearly(shards):
    group = shards(1)
    client = psrt.Client(group.endpoints)
    with pytest.raises(PsrtTypeError, match="float16"):
        psrt.torch.DistributedOptimizer([("w", torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)))], client=client)
    with pytest.raises(ConfigError, match="not contiguous"):
        psrt.torch.DistributedOptimizer([("w", torch.nn.Parameter(torch.zeros(3, 4).t()))], client=client)
    with pytest.raises(PsrtTypeError, match="sparse"):
        psrt.torch.DistributedOptimizer([("w", torch.zeros(3, 3).to_sparse())], client=client)
    with pytest.raises(ConfigError, match="CPU tensors only"):  # CUDA tensors are refused the same way
        psrt.torch.DistributedOptimizer([("w", torch.nn.Parameter(torch.zeros(3, device="meta")))], client=client)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = psrt.torch.DistributedOptimizer(emb.named_parameters(), client=client)
    with pytest.raises(PsrtTypeError, match="sparse gradient"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt.close()
    client.close()


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_frozen_parameters_start_identical_and_are_never_pushed(shards, overlap_forward):
    group = shards(1, workers=2, mode="async")
    models = [make_cnn(1 + r) for r in range(2)]
    for m in models:
        m[0].requires_grad_(False)
    opts = [local_optimizer(group, m, rank=r, workers=2, overlap_forward=overlap_forward)
            for r, m in enumerate(models)]
    frozen = models[0][0].weight.detach().clone()
    assert torch.equal(models[1][0].weight, frozen)  # the first worker's init won, frozen or not
    # The frozen parameters hold no part of the push window (tests/test_overlap.py checks the share-out).
    assert opts[0]._pipe._queueable == {s.index for s in opts[0]._slots if s.param.requires_grad}
    assert len(opts[0]._pipe._queueable) == len(opts[0]._slots) - 2
    names = []
    push_async = opts[0].client.push_async
    opts[0].client.push_async = lambda grads: names.extend(grads) or push_async(grads)
    for x, y in batches(3):
        opts[0].zero_grad()
        torch.nn.functional.cross_entropy(models[0](x), y).backward()
        opts[0].step()
    opts[0].synchronize()
    assert not {"0.weight", "0.bias"} & set(names) and len(names) == 3 * 4
    assert torch.equal(models[0][0].weight, frozen)
    for o in opts:
        o.close()
        o.client.close()


def test_a_late_worker_gets_the_current_parameters(shards):
    group = shards(1, workers=2, mode="async")
    first = make_cnn(1)
    opt = local_optimizer(group, first, rank=0, workers=2)
    start = [p.detach().clone() for p in first.parameters()]
    for x, y in batches(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(first(x), y).backward()
        opt.step()
    opt.synchronize()
    late = make_cnn(2)
    local_optimizer(group, late, rank=1, workers=2).close()
    for p, q, s in zip(first.parameters(), late.parameters(), start):
        assert torch.equal(p, q) and not torch.equal(p, s)
    opt.close()


class Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4).double()
        self.left = torch.nn.Linear(4, 1).double()
        self.right = torch.nn.Linear(4, 1).double()

    def forward(self, x, side):
        return (self.left if side == "left" else self.right)(torch.relu(self.trunk(x)))


def test_a_parameter_without_gradient_is_pushed_as_zeros_and_overlap_forward_step_does_not_wait_for_the_round(
        shards):
    """Two sync workers in one thread: worker 0 uses only the left head, worker 1 only the right one.

    With overlap_forward=True, step() returns with the round still open (the default would wait for the other
    worker, here in the same thread: never).
    """
    group = shards(2, workers=2, mode="sync")
    models = [Branches() for _ in range(2)]
    opts = [local_optimizer(group, m, rank=r, workers=2, overlap_forward=True) for r, m in enumerate(models)]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 8, 4, generator=g, dtype=torch.float64)
        for r, side in enumerate(("left", "right")):
            opts[r].zero_grad()
            models[r](x[r], side).square().mean().backward()
            opts[r].step()  # returns with the round still open: the other worker has not pushed yet
        for r in range(2):  # the next forward waits, module by module, for the parameters it uses
            models[r](x[r], "left")
    for o in opts:
        o.synchronize()
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
    assert not torch.equal(models[0].left.weight, Branches().left.weight)
    for o in opts:
        o.close()
        o.client.close()


def test_importing_psrt_does_not_import_torch_and_psrt_torch_says_how_to_install():
    code = "import sys, psrt; assert 'torch' not in sys.modules; sys.modules['torch'] = None; import psrt.torch"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert 'pip install "psrt[torch]"' in proc.stderr


@pytest.mark.parametrize("mode", [[], ["--mode", "ssp", "--staleness", "2"]], ids=["sync", "ssp"])
def test_the_launched_torch_digits_example_learns(mode):
    # ssp: psrt.torch pushes each tensor apart, from backward; clocks per tensor keep the bound without a hang.
    pytest.importorskip("sklearn")
    proc = subprocess.run([sys.executable, "-m", "psrt.cli", "launch", "-s", "2", "-w", "2", *mode, "--",
                           sys.executable, "-m", "psrt.examples.torch_digits", "--epochs", "3"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker 0] epoch   1/3" in proc.stdout
    m = re.search(r"\[worker 0\] final test accuracy (\d\.\d+)", proc.stdout)
    # ssp applies each worker's push as a step of its own (as async): 3 epochs learn less than sync does.
    assert m and float(m.group(1)) > (0.7 if mode else 0.9), proc.stdout
    assert "Warning" not in proc.stdout + proc.stderr


def test_the_overlap_bench_runs_on_loopback(tmp_path):
    bench = Path(__file__).resolve().parent.parent / "bench" / "overlap.py"
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(bench), "--loopback", "--depth", "2", "--width", "32", "--batch", "64",
                           "--steps", "3", "--rounds", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: MISS, which loopback's tiny comm may give
    record = json.loads(out.read_text())
    assert {"compute_s", "comm_s", "serial_s", "overlap_s", "ratio", "overlap_split_s", "overlap_forward_s",
            "overlap_forward_split_s"} <= set(record)
    assert "overlapped step" in proc.stdout and "split: forward" in proc.stdout
    assert "overlap_forward=True" in proc.stdout
