"""PyTorch integration: a model's gradients go to the shards from backward hooks, parameters come back in place.

::

    import psrt.torch

    model = Net()
    opt = psrt.torch.DistributedOptimizer(model.named_parameters(), optimizer=psrt.SGD(lr=0.1, momentum=0.9))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # each gradient is pushed as soon as backward has produced it
        opt.step()                        # returns when the model holds the new parameters

What overlaps with what (``overlap=True``, the default):

- **Pushes with backward.** A post-accumulate-grad hook on every trainable parameter pushes its gradient the
  moment backward has finished it, from the gradient's own memory (no copy), while backward goes on with the
  earlier layers. Pushes leave in the order backward produces them.
- **Pulls with the rest of backward.** As soon as a shard acknowledges a push, the pull of that parameter is
  asked for; the shard answers it when the parameter's round is complete (sync) or at once (async), and the
  bytes are received straight into the parameter's storage (``param.data``: no new tensors, so ``state_dict``
  and anything holding the parameter keep working). When several gradients are queued, the first layers' are
  sent first (a priority queue in forward order, with at most ``window`` bytes handed to the sockets at a time).
- :meth:`DistributedOptimizer.step` then waits for the pulls still in flight: when it returns, every parameter
  holds its new value, wherever it is read (``state_dict()``, ``p.data``, a checkpoint, evaluation code).

``overlap_forward=True`` goes one stage further: ``step()`` returns once the last gradients are queued, and a
forward pre-hook on each module waits only for that module's own parameters, so the next forward starts on the
first layers while the last layers' parameters are still on their way. The price is a rule: after ``step()``, a
parameter is certain to hold its new value only from the forward pre-hook of the module that owns it on, or after
:meth:`DistributedOptimizer.synchronize`; anything that reads it before (``state_dict()``, ``p.data``, saving,
tied weights used through another module) must call ``synchronize()`` first.

The client is single-threaded: the work is driven from the hooks, ``step``, the forward pre-hooks and
:meth:`DistributedOptimizer.synchronize`, all on the training thread; ZeroMQ's I/O thread moves the bytes in
between. The scheduling itself (the queue, the window, each pull after its push) is
:class:`psrt.worker.overlap.Pipeline`, which the load generator's ``psrt worker --overlap`` drives too.
``overlap=False`` pushes everything in one call at ``step()`` and waits for all of it: the plain, serial step.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError('psrt.torch needs PyTorch: pip install "psrt[torch]" (or pip install torch); '
                      f"importing torch failed: {exc}") from exc

from psrt.errors import ConfigError, PsrtTypeError
from psrt.optim import Optimizer
from psrt.worker import exits
from psrt.worker.client import Client
from psrt.worker.overlap import DEFAULT_WINDOW, IDLE, Pipeline, Slot

__all__ = ["DistributedOptimizer"]

_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class _Slot(Slot):
    """One parameter: the pipeline's slot over its storage (shared memory, no copy), and its backward passes."""

    __slots__ = ("param", "passes")

    def __init__(self, name: str, index: int, param: torch.Tensor) -> None:
        # index: forward order, the order the parameters were registered in the model
        super().__init__(name, index, param.detach().numpy())
        self.param = param
        self.passes = 0


def _check_parameter(name: Any, p: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"parameter names must be non-empty strings, got {name!r}; pass model.named_parameters()")
    if not isinstance(p, torch.Tensor):
        raise PsrtTypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch tensor")
    if p.layout != torch.strided:
        raise PsrtTypeError(f"parameter {name!r} is a sparse tensor ({p.layout}); psrt moves dense tensors only")
    if p.device.type != "cpu":
        raise ConfigError(f"parameter {name!r} lives on {p.device}; psrt.torch moves CPU tensors only (no staging "
                          "through host memory): keep the model on the CPU")
    if p.dtype not in _DTYPES:
        raise PsrtTypeError(f"parameter {name!r} has dtype {p.dtype}; psrt holds torch.float32 and torch.float64 "
                            "(use model.float() or model.double())")
    if not p.is_contiguous():
        raise ConfigError(f"parameter {name!r} is not contiguous (stride {p.stride()}); psrt receives into the "
                          "parameter's memory, which must be C-contiguous: make it so with "
                          "param.data = param.data.contiguous() before creating the optimizer")


class DistributedOptimizer:
    """Train a PyTorch model's parameters on psrt's shards: the shards run ``optimizer``, the model gets the result.

    Construction initializes the shards with the parameters (the first worker's values win) and loads the
    stored values into this worker's parameters, so every worker starts from the same model.

    Parameters
    ----------
    named_parameters : iterable of (str, torch.nn.Parameter)
        ``model.named_parameters()``: dense, contiguous CPU tensors of dtype float32 or float64 (both may mix).
        Parameters with ``requires_grad=False`` (frozen) are initialized, so they start identical everywhere,
        but never pushed or pulled.
    optimizer : Optimizer, optional
        The named optimizer the shards apply (:class:`psrt.SGD`, :class:`psrt.Adam`, ...); ``SGD(lr=0.01)``
        when omitted. Hyperparameters follow torch.optim.
    client : Client, optional
        The connection to the shards; by default ``psrt.Client()`` from the environment (``psrt launch``, a
        scheduler), which this optimizer closes in :meth:`close`.
    backward_passes_per_step : int
        Gradient accumulation: gradients are pushed on the last of this many backward passes, as accumulated in
        ``.grad`` by torch (their sum: divide the loss by this number for the mean).
    overlap : bool
        Push from the backward hooks, and ask for each pull as soon as its push is acknowledged (see the module
        docstring); False: push everything at :meth:`step` and wait for all of it. Either way, :meth:`step`
        returns with the new parameters in the model.
    overlap_forward : bool
        Let the next forward start before every pull is in: :meth:`step` returns once the last gradients are
        queued, and each module's forward waits for its own parameters. Read parameters outside a forward only
        after :meth:`synchronize` (see Notes). Needs ``overlap=True``.
    window : int
        At most this many gradient bytes handed to the sockets at a time (at least one tensor); the rest wait in
        a queue that sends the first layers first.
    timeout : float, optional
        Seconds to wait for any one reply (the client's timeout by default).

    Notes
    -----
    A trainable parameter that got no gradient in a step (``.grad`` is None: an unused branch) is pushed as
    zeros, so that every worker pushes every parameter every step and sync rounds complete; unlike
    torch.optim, which skips it, the shard's optimizer then still applies momentum and weight decay to it.
    With ``overlap_forward=True``, after :meth:`step` a parameter holds its new value from the forward pre-hook
    of the module that owns it on, or after :meth:`synchronize`; before that, a read (``state_dict()``,
    ``p.data``, saving, evaluation code that does not call the modules, tied weights used through another
    module) may see the previous step's values, the new ones, or some of each: call :meth:`synchronize` first.
    :meth:`close` drops the pulls in flight.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], optimizer: Optional[Optimizer] = None,
                 client: Optional[Client] = None, *, backward_passes_per_step: int = 1, overlap: bool = True,
                 overlap_forward: bool = False, window: int = DEFAULT_WINDOW, timeout: Optional[float] = None) -> None:
        self._closed = True
        self._hooks: list[Any] = []
        if type(backward_passes_per_step) is not int or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
        if type(window) is not int or window < 1:
            raise ConfigError(f"window must be a positive number of bytes, got {window!r}")
        if overlap_forward and not overlap:
            raise ConfigError("overlap_forward=True lets the next forward wait for the pulls that overlap=True "
                              "starts from the backward hooks; with overlap=False there are none: pass "
                              "overlap=True, or leave overlap_forward out")
        items = list(named_parameters)
        if not items:
            raise ConfigError("no parameters: pass model.named_parameters()")
        names, seen = set(), set()
        for item in items:
            if not isinstance(item, tuple) or len(item) != 2:
                raise ConfigError("named_parameters must yield (name, parameter) pairs: pass model.named_parameters()")
            name, p = item
            _check_parameter(name, p)
            if name in names:
                raise ConfigError(f"parameter name {name!r} appears twice")
            if id(p) in seen:
                raise ConfigError(f"parameter {name!r} appears twice under different names (tied weights): pass "
                                  "each parameter once, as model.named_parameters() does")
            names.add(name)
            seen.add(id(p))
        self._k = backward_passes_per_step
        self._overlap = overlap
        self._overlap_forward = overlap_forward
        self._timeout = timeout
        self._own_client = client is None
        self.client = Client() if client is None else client
        try:
            self._slots = [_Slot(name, i, p) for i, (name, p) in enumerate(items)]
            stored = self.client.init({s.name: s.array for s in self._slots}, optimizer=optimizer, timeout=timeout)
        except BaseException:
            if self._own_client:
                self.client.close()
            raise
        for s in self._slots:
            np.copyto(s.array, stored[s.name])  # into the parameter's own storage
        self._trainable = [s for s in self._slots if s.param.requires_grad]
        self._by_param = {id(s.param): s for s in self._trainable}
        # Its epoch counts the steps taken; only trainable slots are ever queued.
        self._pipe = Pipeline(self.client, self._slots, window, timeout, pushed=self._trainable)
        self._closed = False
        for s in self._trainable:
            self._hooks.append(s.param.register_post_accumulate_grad_hook(
                lambda p, s=s: self._on_grad(s)))
        if overlap_forward:
            # A global hook: the model itself is not passed in, only its parameters; it returns at once when no
            # pull is in flight, and otherwise looks only at the module's own parameters.
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward))

    # ------------------------------------------------------------------ the training loop's calls
    @property
    def backward_passes_per_step(self) -> int:
        """How many backward passes accumulate into one push."""
        return self._k

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the trainable parameters' gradients, as :meth:`torch.optim.Optimizer.zero_grad`.

        With ``set_to_none=False`` the gradients are zeroed in place, which first waits for their pushes to
        leave (their memory is being sent as is).
        """
        self._check_open()
        if not set_to_none:
            self._pipe.drain_pushes()
        for s in self._trainable:
            if set_to_none:
                s.param.grad = None
            elif s.param.grad is not None:
                with torch.no_grad():
                    s.param.grad.zero_()

    def step(self) -> None:
        """Push what backward has not pushed yet and wait for the new parameters, which land in place.

        When this returns, every trainable parameter holds its new value. With ``overlap_forward=True`` it
        returns once the last gradients are queued instead: the next forward waits, module by module, for the
        parameters it uses (call :meth:`synchronize` to wait for all of them). A parameter that got no gradient
        is pushed as zeros (see Notes of the class).
        """
        self._check_open()
        if not self._overlap:
            grads = {s.name: self._gradient(s) for s in self._trainable}
            if grads:
                self.client.push_pull(grads, timeout=self._timeout, out={s.name: s.array for s in self._trainable})
            for s in self._trainable:
                s.passes = 0
            return
        pipe = self._pipe
        pipe.finish_previous()  # a step without a backward in between: the last step's work must be done
        for s in self._trainable:
            if s.epoch < pipe.epoch:  # backward did not push it: fewer passes than expected, or no gradient
                pipe.enqueue(s, self._gradient(s))
            s.passes = 0
        pipe.end_step()
        if not self._overlap_forward:
            for s in self._trainable:  # the pulls asked for during backward have been landing all along
                pipe.wait_for(s)

    def synchronize(self) -> None:
        """Wait until every push and pull of the last step is done: the model holds the new parameters."""
        self._check_open()
        self._pipe.synchronize()

    def close(self, failure: Optional[str] = None) -> None:
        """Remove the hooks and close the client if this optimizer created it (pulls in flight are dropped).

        ``failure``: the program failed (one line saying how), for that client to tell the scheduler, as
        :meth:`psrt.Client.close` does; leaving the optimizer's ``with`` block by an exception passes it.
        """
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._own_client:
            self.client.close(failure=failure)

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        # A script that raises here failed: its client must say so, not that it is done (which a fixed job would
        # take for an early finish, and a job of one worker for success).
        self.close(failure=exits.failure_of(exc))

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, s: _Slot) -> None:
        if self._closed:
            return
        if s.passes >= self._k:
            raise ConfigError(f"parameter {s.name!r} got a gradient {s.passes + 1} times since the last step(), "
                              f"but backward_passes_per_step={self._k}: call opt.step() after every "
                              f"{self._k} backward pass(es)")
        pipe = self._pipe
        if s.state != IDLE and s.epoch < pipe.epoch:
            pipe.finish_previous()  # the first gradient of a step while the last step's work is in flight
        s.passes += 1
        if self._overlap and s.passes == self._k:
            pipe.enqueue(s, self._gradient(s))
            pipe.pump()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._pipe.busy or self._closed:
            return
        for p in module.parameters(recurse=False):
            s = self._by_param.get(id(p))
            if s is not None and s.state != IDLE:
                self._pipe.wait_for(s)

    # ------------------------------------------------------------------ the gradients
    def _gradient(self, s: _Slot) -> np.ndarray:
        g = s.param.grad
        if g is None:
            return np.zeros_like(s.array)
        if g.layout != torch.strided:
            raise PsrtTypeError(f"parameter {s.name!r} got a sparse gradient; psrt moves dense gradients only "
                                "(create the layer with sparse=False)")
        if g.device.type != "cpu" or g.dtype != s.param.dtype:
            raise PsrtTypeError(f"parameter {s.name!r} got a gradient on {g.device} of dtype {g.dtype}; expected "
                                f"the parameter's cpu {s.param.dtype}")
        return g.detach().numpy()  # the gradient's own memory (the client copies it only if not contiguous)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this DistributedOptimizer is closed")
