"""Named server-side optimizers.

An optimizer travels to the shards by name with its hyperparameters (``{"name": "adamw", "lr": 0.001, ...}``),
never as a pickle, and each shard rebuilds it with :func:`from_wire`, which validates every field. Update rules
and defaults follow torch.optim: :class:`SGD` (momentum, Nesterov, L2 weight decay), :class:`Adam` (L2 weight
decay), :class:`AdamW` (decoupled weight decay) and :class:`AdaGrad`.

Each optimizer steps a dense parameter (:meth:`Optimizer.step`, for the dense keys of a shard) and the touched rows
of an embedding table (:meth:`Optimizer.step_rows`, torch's sparse semantics), each with one kernel of
:mod:`psrt.kernels` or :mod:`psrt.kernels.rows`: a new optimizer is its class and its kernels, nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from psrt import kernels
from psrt.errors import ConfigError
from psrt.kernels import rows as rowkernels

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "AdaGrad", "from_wire", "OPTIMIZERS"]


def _nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
    return value


def _unit(name: str, value: float) -> float:
    value = _nonneg(name, value)
    if not value < 1.0:
        raise ConfigError(f"{name} must be in [0, 1), got {value}")
    return value


@dataclass(frozen=True)
class Optimizer:
    """Base class of the named optimizers.

    Subclasses declare their state ``slots`` (arrays shaped like the parameter, :meth:`slot_fill` at the start)
    and implement :meth:`step`, which calls one fused kernel from :mod:`psrt.kernels`, and :meth:`step_rows`,
    which calls its row-wise twin from :mod:`psrt.kernels.rows`.
    """

    name: ClassVar[str] = ""
    slots: ClassVar[tuple[str, ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        """Return the optimizer as a msgpack-able mapping: its name and every hyperparameter."""
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    def slot_fill(self, slot: str) -> float:
        """The value every entry of state ``slot`` starts from (0 unless an optimizer says otherwise)."""
        return 0.0

    def init_slots(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Allocate this optimizer's state for one parameter array."""
        return {s: np.full_like(param, self.slot_fill(s)) for s in self.slots}

    def step(self, param: np.ndarray, slots: dict[str, np.ndarray], grad: np.ndarray, scale: float, step: int) -> None:
        """Apply one update in place; the gradient used is ``scale * grad``; ``step`` counts from 1."""
        raise NotImplementedError

    def step_rows(self, param: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray, grad: np.ndarray,
                  scale: float, step: int) -> None:
        """Apply one update to the rows ``param[rows]`` and their state only, as torch's sparse optimizers do.

        Parameters
        ----------
        param : numpy.ndarray
            ``(capacity, dim)`` table of rows, updated in place.
        slots : dict of str to numpy.ndarray
            The state arrays (:attr:`slots`), each shaped like ``param``.
        rows : numpy.ndarray
            Distinct int64 row indices (coalesce repeated ids first).
        grad : numpy.ndarray
            ``(len(rows), dim)`` gradient rows; ``scale * grad`` is used.
        scale : float
            Gradient scale.
        step : int
            The table's step count, from 1.

        Raises
        ------
        ConfigError
            When the optimizer has no row-wise step.
        """
        raise ConfigError(f"optimizer {self.name!r} has no row-wise step")


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as torch.optim.SGD (dampening 0).

    Parameters
    ----------
    lr : float
        Learning rate.
    momentum : float
        Momentum factor; 0 disables the momentum buffer.
    weight_decay : float
        L2 penalty added to the gradient.
    nesterov : bool
        Use Nesterov momentum (needs ``momentum > 0``).
    """

    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _nonneg("lr", self.lr))
        object.__setattr__(self, "momentum", _nonneg("momentum", self.momentum))
        object.__setattr__(self, "weight_decay", _nonneg("weight_decay", self.weight_decay))
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("nesterov=True needs momentum > 0")

    @property
    def slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum else ()

    def step(self, param, slots, grad, scale, step) -> None:  # noqa: D102
        if self.momentum:
            kernels.momentum_step(
                param, slots["momentum_buffer"], grad, self.lr, self.momentum, scale, self.weight_decay, self.nesterov
            )
        else:
            kernels.sgd_step(param, grad, self.lr, scale, self.weight_decay)

    def step_rows(self, param, slots, rows, grad, scale, step) -> None:  # noqa: D102
        if self.momentum:
            rowkernels.momentum_rows(param, slots["momentum_buffer"], rows, grad, self.lr, self.momentum, scale,
                                     self.weight_decay, self.nesterov)
        else:
            rowkernels.sgd_rows(param, rows, grad, self.lr, scale, self.weight_decay)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam, as torch.optim.Adam: ``weight_decay`` is an L2 penalty added to the gradient.

    Parameters
    ----------
    lr : float
        Learning rate.
    beta1, beta2 : float
        Decay rates of the first and second moment estimates.
    eps : float
        Added to the denominator for numerical stability.
    weight_decay : float
        L2 penalty (coupled); use :class:`AdamW` for decoupled decay.
    betas : tuple of float, optional
        ``(beta1, beta2)`` as torch.optim spells them (keyword only in effect: give it or beta1/beta2).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: InitVar[Optional[tuple[float, float]]] = None
    name: ClassVar[str] = "adam"
    slots: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    def __post_init__(self, betas: Optional[tuple[float, float]] = None) -> None:
        if betas is not None:
            if (self.beta1, self.beta2) != (0.9, 0.999):
                raise ConfigError("give betas=(beta1, beta2) or beta1 and beta2, not both")
            if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
                raise ConfigError(f"betas must be a pair (beta1, beta2), got {betas!r}")
            object.__setattr__(self, "beta1", betas[0])
            object.__setattr__(self, "beta2", betas[1])
        object.__setattr__(self, "lr", _nonneg("lr", self.lr))
        object.__setattr__(self, "beta1", _unit("beta1", self.beta1))
        object.__setattr__(self, "beta2", _unit("beta2", self.beta2))
        object.__setattr__(self, "eps", _nonneg("eps", self.eps))
        object.__setattr__(self, "weight_decay", _nonneg("weight_decay", self.weight_decay))

    def _decays(self) -> tuple[float, float]:
        return 0.0, self.weight_decay  # (decoupled, coupled L2)

    def step(self, param, slots, grad, scale, step) -> None:  # noqa: D102
        decoupled, l2 = self._decays()
        kernels.adam_step(
            param, slots["exp_avg"], slots["exp_avg_sq"], grad, self.lr, self.beta1, self.beta2, self.eps,
            step, scale, decoupled, l2,
        )

    def step_rows(self, param, slots, rows, grad, scale, step) -> None:
        """torch.optim.SparseAdam on the touched rows (:func:`psrt.kernels.rows.adam_rows`): no weight decay, which
        :class:`psrt.tablespec.TableSpec` refuses for a table; AdamW without weight decay steps the same."""
        rowkernels.adam_rows(param, slots["exp_avg"], slots["exp_avg_sq"], rows, grad, self.lr, self.beta1,
                             self.beta2, self.eps, step, scale)


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW, as torch.optim.AdamW: decoupled weight decay (``param *= 1 - lr*weight_decay``).

    Parameters are those of :class:`Adam`; ``weight_decay`` defaults to 0.01 as in torch.
    """

    weight_decay: float = 1e-2
    name: ClassVar[str] = "adamw"

    def _decays(self) -> tuple[float, float]:
        return self.weight_decay, 0.0


@dataclass(frozen=True)
class AdaGrad(Optimizer):
    """Adagrad, as torch.optim.Adagrad.

    Parameters
    ----------
    lr : float
        Learning rate.
    lr_decay : float
        The learning rate at step t is ``lr / (1 + (t-1)*lr_decay)``.
    weight_decay : float
        L2 penalty added to the gradient.
    initial_accumulator_value : float
        Starting value of the sum of squared gradients.
    eps : float
        Added to the denominator for numerical stability.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    name: ClassVar[str] = "adagrad"
    slots: ClassVar[tuple[str, ...]] = ("sum",)

    def __post_init__(self) -> None:
        for f in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            object.__setattr__(self, f, _nonneg(f, getattr(self, f)))

    def slot_fill(self, slot: str) -> float:  # noqa: D102
        return self.initial_accumulator_value if slot == "sum" else 0.0

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 1): ``lr / (1 + (step-1)*lr_decay)``."""
        return self.lr / (1.0 + (step - 1) * self.lr_decay)

    def step(self, param, slots, grad, scale, step) -> None:  # noqa: D102
        kernels.adagrad_step(param, slots["sum"], grad, self.lr_at(step), self.eps, scale, self.weight_decay)

    def step_rows(self, param, slots, rows, grad, scale, step) -> None:  # noqa: D102
        rowkernels.adagrad_rows(param, slots["sum"], rows, grad, self.lr_at(step), self.eps, scale,
                                self.weight_decay)


OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (SGD, Adam, AdamW, AdaGrad)}


def from_wire(spec: object) -> Optimizer:
    """Rebuild an optimizer from its wire form, checking the name and the exact set of fields.

    Raises
    ------
    ConfigError
        When the name is unknown, a field is missing, extra or of the wrong type, or a value is out of range.
    """
    if not isinstance(spec, dict):
        raise ConfigError("optimizer must be a map with a 'name' and its hyperparameters")
    if any(type(k) is not str for k in spec):
        raise ConfigError("optimizer field names must be strings")
    name = spec.get("name")
    cls = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = set(spec) - {"name"}
    if given != set(fields):
        missing, extra = sorted(set(fields) - given), sorted(given - set(fields))
        raise ConfigError(f"optimizer {name!r}: missing fields {missing}, unexpected fields {extra}")
    kwargs = {}
    for key, f in fields.items():
        value = spec[key]
        want = bool if f.type in (bool, "bool") else float
        if type(value) is not want and not (want is float and type(value) is int):
            raise ConfigError(f"optimizer {name!r}: field {key!r} must be {want.__name__}, got {type(value).__name__}")
        kwargs[key] = value
    return cls(**kwargs)
