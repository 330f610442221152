"""psrt's named optimizers: update rules against torch.optim (when installed) and the validated wire form."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from _helpers import assert_close

import psrt
from psrt import optim
from psrt.errors import ConfigError, PsrtError

DTYPES = [np.float32, np.float64]
#: Against torch.optim, which orders its float64 operations otherwise: looser than the kernels' tolerance.
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}
STEPS = 6

#: torch state name for each psrt slot.
TORCH_SLOT = {"momentum_buffer": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "sum": "sum"}


def _run_against_torch(ours: optim.Optimizer, make_torch, dtype, shape=(37, 5), scale: float = 1.0) -> None:
    """Apply STEPS steps with the same gradients to a psrt parameter and a torch parameter; compare every step."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(hash((type(ours).__name__, np.dtype(dtype).name)) % 2**32)
    start = rng.standard_normal(shape).astype(dtype)

    param = start.copy()
    slots = ours.init_slots(param)
    for s in slots.values():
        assert s.dtype == param.dtype and s.shape == param.shape

    tparam = torch.nn.Parameter(torch.from_numpy(start.copy()))
    topt = make_torch([tparam])
    t = np.dtype(dtype).type

    for step in range(1, STEPS + 1):
        grad = rng.standard_normal(shape).astype(dtype)
        ours.step(param, slots, grad, scale, step)
        tparam.grad = torch.from_numpy(t(scale) * grad)  # psrt uses scale*grad in the array dtype
        topt.step()
        assert_close(param, tparam.detach().numpy(), RTOL)
        state = topt.state[tparam]
        for name, arr in slots.items():
            assert_close(arr, state[TORCH_SLOT[name]].numpy(), RTOL)
    assert not np.allclose(param, start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw",
    [
        {"lr": 0.1},
        {"lr": 0.1, "weight_decay": 0.05},
        {"lr": 0.05, "momentum": 0.9},
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
        {"lr": 0.05, "momentum": 0.8, "nesterov": True},
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True},
    ],
    ids=str,
)
def test_sgd_matches_torch(dtype, kw):
    torch = pytest.importorskip("torch")
    opt = psrt.SGD(**kw)
    assert ("momentum_buffer" in opt.slots) == bool(kw.get("momentum"))
    _run_against_torch(opt, lambda p: torch.optim.SGD(p, foreach=False, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "name, kw",
    [
        # Adam: weight_decay is the L2 penalty added to the gradient.
        ("Adam", {}),
        ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
        ("Adam", {"lr": 0.005, "beta1": 0.5, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.01}),
        ("Adam", {"lr": 0.01, "beta1": 0.0, "beta2": 0.99}),
        # AdamW: weight_decay is decoupled.
        ("AdamW", {}),
        ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
        ("AdamW", {"lr": 0.003, "beta1": 0.8, "beta2": 0.95, "eps": 1e-7, "weight_decay": 0.0}),
    ],
    ids=str,
)
def test_adam_and_adamw_match_torch(dtype, name, kw):
    torch = pytest.importorskip("torch")
    opt = getattr(psrt, name)(**kw)

    def make(p):
        return getattr(torch.optim, name)(
            p, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay, foreach=False
        )

    _run_against_torch(opt, make, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"lr": 0.1, "lr_decay": 0.1},
        {"lr": 0.05, "initial_accumulator_value": 0.5},
        {"lr": 0.05, "weight_decay": 0.02, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-6},
    ],
    ids=str,
)
def test_adagrad_matches_torch(dtype, kw):
    torch = pytest.importorskip("torch")
    opt = psrt.AdaGrad(**kw)

    def make(p):
        return torch.optim.Adagrad(
            p, lr=opt.lr, lr_decay=opt.lr_decay, weight_decay=opt.weight_decay,
            initial_accumulator_value=opt.initial_accumulator_value, eps=opt.eps, foreach=False,
        )

    _run_against_torch(opt, make, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["sgd", "adam", "adamw", "adagrad"])
def test_gradient_scale_matches_torch_on_scaled_gradient(dtype, which):
    torch = pytest.importorskip("torch")
    cases = {
        "sgd": (psrt.SGD(lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
        "adam": (psrt.Adam(lr=0.01, weight_decay=0.1), lambda p: torch.optim.Adam(
            p, lr=0.01, weight_decay=0.1, foreach=False)),
        "adamw": (psrt.AdamW(lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False)),
        "adagrad": (psrt.AdaGrad(lr=0.1, lr_decay=0.05), lambda p: torch.optim.Adagrad(
            p, lr=0.1, lr_decay=0.05, foreach=False)),
    }
    ours, make = cases[which]
    _run_against_torch(ours, make, dtype, shape=(129,), scale=0.25)


def test_defaults_follow_torch_where_documented():
    torch = pytest.importorskip("torch")
    import inspect

    def defaults(cls):
        return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}

    adam, adamw, adagrad = defaults(torch.optim.Adam), defaults(torch.optim.AdamW), defaults(torch.optim.Adagrad)
    a, w, g = psrt.Adam(), psrt.AdamW(), psrt.AdaGrad()
    assert (a.lr, (a.beta1, a.beta2), a.eps, a.weight_decay) == (
        adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"])
    assert (w.lr, (w.beta1, w.beta2), w.eps, w.weight_decay) == (
        adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"])
    assert (g.lr, g.lr_decay, g.weight_decay, g.initial_accumulator_value, g.eps) == (
        adagrad["lr"], adagrad["lr_decay"], adagrad["weight_decay"], adagrad["initial_accumulator_value"],
        adagrad["eps"])


# ---------------------------------------------------------------------------------------------------------------
# Without torch: state, wire form and validation
# ---------------------------------------------------------------------------------------------------------------

ALL = [
    psrt.SGD(),
    psrt.SGD(lr=0.5, momentum=0.9, weight_decay=1e-4, nesterov=True),
    psrt.SGD(lr=1, momentum=0.5),
    psrt.Adam(),
    psrt.Adam(lr=0.1, beta1=0.0, beta2=0.5, eps=0.0, weight_decay=0.2),
    psrt.AdamW(),
    psrt.AdamW(lr=3e-4, weight_decay=0.0),
    psrt.AdaGrad(),
    psrt.AdaGrad(lr=1, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.25, eps=1e-6),
]


@pytest.mark.parametrize("opt", ALL, ids=repr)
def test_wire_round_trip(opt):
    spec = opt.to_wire()
    assert spec["name"] == opt.name
    assert set(spec) == {"name"} | {f.name for f in dataclasses.fields(opt)}
    back = optim.from_wire(spec)
    assert type(back) is type(opt)
    assert back == opt
    # and through msgpack, as it travels
    again = optim.from_wire(msgpack.unpackb(msgpack.packb(spec, use_bin_type=True), raw=False))
    assert again == opt and type(again) is type(opt)


def test_adam_and_adamw_are_distinct_on_the_wire():
    a = optim.from_wire(psrt.Adam(weight_decay=0.1).to_wire())
    w = optim.from_wire({**psrt.Adam(weight_decay=0.1).to_wire(), "name": "adamw"})
    assert type(a) is psrt.Adam and type(w) is psrt.AdamW
    assert a != w


def test_integer_hyperparameters_become_floats():
    opt = optim.from_wire({**psrt.SGD().to_wire(), "lr": 1, "momentum": 0})
    assert opt.lr == 1.0 and type(opt.lr) is float
    assert type(psrt.Adam(lr=np.float32(0.5)).lr) is float


@pytest.mark.parametrize("opt", ALL, ids=repr)
def test_init_slots_are_zero_or_initial_accumulator(opt):
    param = np.ones((3, 4), np.float32)
    slots = opt.init_slots(param)
    assert set(slots) == set(opt.slots)
    for name, arr in slots.items():
        assert arr.shape == param.shape and arr.dtype == param.dtype
        want = opt.initial_accumulator_value if name == "sum" else 0.0
        assert np.all(arr == np.float32(want))


def test_optimizer_steps_without_torch_move_against_the_gradient():
    for opt in ALL:
        if opt.lr == 0:
            continue
        param = np.zeros(8)
        slots = opt.init_slots(param)
        opt.step(param, slots, np.ones(8), 1.0, 1)
        assert np.all(param < 0), opt


@pytest.mark.parametrize("spec", [None, [], "sgd", 1, [("name", "sgd")]], ids=repr)
def test_from_wire_rejects_non_maps(spec):
    with pytest.raises(ConfigError, match="must be a map"):
        optim.from_wire(spec)


@pytest.mark.parametrize("name", ["rmsprop", "SGD", "Adam", "", None, 1, True, b"sgd", ["sgd"]], ids=repr)
def test_from_wire_rejects_unknown_names(name):
    spec = {**psrt.SGD().to_wire(), "name": name}
    with pytest.raises(ConfigError, match="unknown optimizer") as info:
        optim.from_wire(spec)
    assert "adagrad, adam, adamw, sgd" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, PsrtError)


def test_from_wire_rejects_missing_name():
    spec = psrt.SGD().to_wire()
    del spec["name"]
    with pytest.raises(ConfigError, match="unknown optimizer None"):
        optim.from_wire(spec)


@pytest.mark.parametrize("opt", ALL, ids=repr)
def test_from_wire_rejects_each_missing_field(opt):
    spec = opt.to_wire()
    for key in list(spec):
        if key == "name":
            continue
        partial = {k: v for k, v in spec.items() if k != key}
        with pytest.raises(ConfigError, match=rf"missing fields \['{key}'\]"):
            optim.from_wire(partial)


@pytest.mark.parametrize("extra", ["betas", "lr_decay", "momentum", "amsgrad", "foo"])
def test_from_wire_rejects_extra_fields(extra):
    spec = psrt.Adam().to_wire()
    if extra in spec:  # a field Adam has: put it on SGD instead
        spec = psrt.SGD().to_wire()
    spec[extra] = 0.1
    with pytest.raises(ConfigError, match=rf"unexpected fields \['{extra}'\]"):
        optim.from_wire(spec)


def test_from_wire_rejects_extra_fields_of_mixed_key_types():
    # A header map off the wire may carry an empty binary key next to string keys (msgpack max_bin_len=0 still
    # admits b""). from_wire must answer with ConfigError, not fail while formatting its message.
    spec = {**psrt.SGD().to_wire(), b"": 1.0, "junk": 2.0}
    with pytest.raises(ConfigError, match="must be strings"):
        optim.from_wire(spec)


FLOAT_FIELDS = [("sgd", "lr"), ("sgd", "momentum"), ("sgd", "weight_decay"), ("adam", "beta1"), ("adam", "eps"),
                ("adamw", "weight_decay"), ("adagrad", "lr_decay"), ("adagrad", "initial_accumulator_value")]


@pytest.mark.parametrize(("name", "field"), FLOAT_FIELDS)
@pytest.mark.parametrize("value", [True, False, "0.1", None, [0.1], {"x": 1}, b"1"], ids=repr)
def test_from_wire_rejects_wrong_types_for_floats(name, field, value):
    spec = {**optim.OPTIMIZERS[name]().to_wire(), field: value}
    with pytest.raises(ConfigError, match=f"field '{field}' must be float"):
        optim.from_wire(spec)


@pytest.mark.parametrize("value", [1, 0, 1.0, "true", None])
def test_from_wire_rejects_non_bool_nesterov(value):
    spec = {**psrt.SGD(momentum=0.9).to_wire(), "nesterov": value}
    with pytest.raises(ConfigError, match="'nesterov' must be bool"):
        optim.from_wire(spec)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("sgd", "lr", -0.1, "lr must be a finite number >= 0"),
        ("adam", "lr", -1e-9, "lr must be a finite number >= 0"),
        ("sgd", "momentum", -0.5, "momentum must be"),
        ("sgd", "weight_decay", -1, "weight_decay must be"),
        ("adamw", "weight_decay", -0.01, "weight_decay must be"),
        ("adagrad", "eps", -1e-10, "eps must be"),
        ("adagrad", "lr_decay", -0.1, "lr_decay must be"),
        ("sgd", "lr", float("nan"), "finite"),
        ("adam", "lr", float("inf"), "finite"),
        ("adam", "eps", float("-inf"), "finite"),
        ("adam", "beta1", 1.0, r"beta1 must be in \[0, 1\)"),
        ("adam", "beta1", 1.5, r"beta1 must be in \[0, 1\)"),
        ("adam", "beta2", 1, r"beta2 must be in \[0, 1\)"),
        ("adamw", "beta2", 1.0000001, r"beta2 must be in \[0, 1\)"),
        ("adamw", "beta1", -0.1, "beta1 must be"),
        ("adam", "beta2", float("nan"), "beta2 must be"),
    ],
)
def test_from_wire_rejects_out_of_range_values(name, field, value, message):
    spec = {**optim.OPTIMIZERS[name]().to_wire(), field: value}
    with pytest.raises(ConfigError, match=message) as info:
        optim.from_wire(spec)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match=message):
        optim.OPTIMIZERS[name](**{field: value})


def test_nesterov_needs_momentum():
    with pytest.raises(ConfigError, match="nesterov=True needs momentum > 0"):
        psrt.SGD(nesterov=True)
    with pytest.raises(ConfigError, match="nesterov=True needs momentum > 0"):
        optim.from_wire({**psrt.SGD().to_wire(), "nesterov": True})
    assert psrt.SGD(momentum=0.1, nesterov=True).nesterov is True


@pytest.mark.parametrize("value", [True, "0.1", None, [1.0]], ids=repr)
def test_constructors_reject_non_numbers(value):
    with pytest.raises(ConfigError, match="lr must be a number"):
        psrt.SGD(lr=value)
    with pytest.raises(ConfigError, match="eps must be a number"):
        psrt.AdaGrad(eps=value)


def test_optimizers_are_immutable():
    opt = psrt.Adam()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("cls", sorted(optim.OPTIMIZERS.values(), key=lambda c: c.name), ids=lambda c: c.name)
def test_every_optimizer_steps_rows_in_its_own_class(cls):
    # One dispatch: a table asks the optimizer for its row step, so each named optimizer defines it (or inherits a
    # named parent's, as AdamW does Adam's) instead of a type switch elsewhere knowing every optimizer.
    assert cls.step_rows is not optim.Optimizer.step_rows


@pytest.mark.parametrize("opt", [psrt.SGD(lr=0.1, weight_decay=0.01), psrt.SGD(lr=0.1, momentum=0.9),
                                 psrt.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                                 psrt.AdaGrad(lr=0.1, lr_decay=0.5, weight_decay=0.01, initial_accumulator_value=0.1)],
                         ids=repr)
def test_a_row_step_equals_the_dense_step_on_the_touched_rows(opt):
    # The same rule (AdaGrad's lr_decay included) whether a tensor or a table's rows step; untouched rows stay.
    rng = np.random.default_rng(1)
    param = rng.standard_normal((5, 8)).astype(np.float32)
    slots = opt.init_slots(param)
    rows = np.array([1, 3], np.int64)
    dense = param[rows].copy()
    dense_slots = {k: v[rows].copy() for k, v in slots.items()}
    for step in (1, 2, 3):
        grad = rng.standard_normal((2, 8)).astype(np.float32)
        opt.step_rows(param, slots, rows, grad, 0.5, step)
        opt.step(dense, dense_slots, grad, 0.5, step)
    assert np.array_equal(param[rows], dense)
    for name in slots:
        assert np.array_equal(slots[name][rows], dense_slots[name])
        assert np.all(slots[name][[0, 2, 4]] == np.float32(opt.slot_fill(name)))


def test_an_optimizer_without_a_row_step_says_so():
    @dataclasses.dataclass(frozen=True)
    class Plain(optim.Optimizer):
        name = "plain"

    with pytest.raises(ConfigError, match="optimizer 'plain' has no row-wise step"):
        Plain().step_rows(np.zeros((2, 2)), {}, np.array([0], np.int64), np.zeros((1, 2)), 1.0, 1)
