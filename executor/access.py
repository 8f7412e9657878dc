"""The wrapped model between steps: what a call of it, or of any module inside it, does.

[Note: the model between steps]
After wrap, offloaded chunks hold no device storage between steps (chunks.py [Note:
chunk storage resize]): their parameters are views of zero-byte storage, and reading
one reads freed memory (SIGSEGV on CPU, no message). So every public entry of the
model and of its modules either runs under the plan or raises a ``ProtrainError``
naming what to call instead:

- A *root's* forward under ``torch.no_grad()`` (``Engine.evaluate`` is one, in eval mode)
  runs in the replayer's evaluate phase: block hooks fetch, prefetch and release as
  the plan's forward says; afterwards every offloaded chunk is released again. The
  roots are the model given to wrap and the modules its ``protrain_roots()`` names
  (protrain's HF adapter names the transformers model, whose forward ``generate``
  calls once per token, KV cache and all). With gradients enabled it is refused:
  training goes through ``Engine.step``.
- Outside every root's forward, parameters are of a guarded Parameter class
  (``_Guard``): a torch function that would read a released parameter (its values,
  ``.data``, ``.grad``, a copy) raises; shapes, dtypes and devices stay readable, and
  resident (persistent) parameters stay readable. Inside a forward they are plain
  Parameters again, so a step's forward pays nothing (a checkpointed block's
  recomputation in backward pays one Python call per op on a parameter).
- Per module, as instance attributes (Activations overrides ``forward`` the same way):
  ``state_dict`` returns the engine's values (plain names, full fp32 tensors, so
  transformers' ``save_pretrained`` writes them); ``zero_grad`` does nothing (the engine
  zeroes its gradient buffers at each step); the rest of ``OVERRIDES`` is refused by name
  unless it would change nothing (``_changes_nothing``).

``Engine.close`` removes all of it: the model is a plain module again, except that the
parameters of released chunks keep the guard (their storage is still released).
"""

from __future__ import annotations

import torch
from torch import nn

from protrain.plans.errors import ConfigError, ProtrainError
from protrain.plans.plan import POST, PRE

from .schedule import Phase

# Torch functions that read no parameter's values: allowed on a released one.
METADATA = frozenset(
    "shape size dim ndim numel dtype device layout is_cuda is_floating_point requires_grad "
    "requires_grad_ is_leaf grad_fn _version untyped_storage __hash__ _post_accumulate_grad_hooks "
    "register_hook register_post_accumulate_grad_hook".split()
)
VALUES = "for the values, engine.state_dict()['model'] (plain names, full tensors)"
MOVE = "make a plan for that device or dtype and wrap again; " + VALUES
# Module methods overridden per module (see the Note), and the hint of each refusal.
OVERRIDES = {
    **dict.fromkeys("to cuda xpu cpu half float double bfloat16 type".split(), MOVE),
    **dict.fromkeys("apply to_empty share_memory".split(), "call it before wrap; " + VALUES),
    "load_state_dict": "engine.load_state_dict({'model': sd}), names as in named_parameters()",
    "requires_grad_": "set requires_grad before wrap; to change it, wrap again",
    "__deepcopy__": "load engine.state_dict()['model'] into a fresh model",
    "state_dict": "",
    "zero_grad": "",
}


def _released(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _none(t: torch.Tensor) -> bool:  # a frozen parameter's .grad: None reads no storage
    with torch._C.DisableTorchFunctionSubclass():
        return t.grad is None


class _Guard:
    """Mixed into a parameter's class between forwards; see [Note: the model between steps]."""

    names: dict[int, str] = {}  # id(param) → its name (set per engine, on the made subclass)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a property: Tensor.data, .grad, .shape, ...
            name = func.__self__.__name__
        for a in () if name in METADATA else (*args, *(kwargs or {}).values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, _Guard) and _released(t) and not (name == "grad" and _none(t)):
                    msg = f"{name!r} of {cls.names.get(id(t))!r}: its chunk is offloaded, released"
                    raise ProtrainError(msg, "call the model under torch.no_grad(); " + VALUES)
        return super().__torch_function__(func, types, args, kwargs or {})


class Access:
    """Hooks and overrides that keep the wrapped model usable between steps (see the Note)."""

    def __init__(self, engine, model: nn.Module):
        self.engine = engine  # for state_dict, the store, the replayer and the device
        self.roots = [model, *getattr(model, "protrain_roots", list)()]
        self.modules = list(dict.fromkeys([*model.modules(), *self.roots]))
        # Each parameter once (a tied one is one object), with its own class.
        self.classes = {p: type(p) for c in engine.store.chunks for p, _, _ in c.params}
        # Its guarded subclass, made once per class.
        self.guards = {
            cls: type(f"Guarded{cls.__name__}", (_Guard, cls), {"names": engine.names})
            for cls in set(self.classes.values())
        }
        self.dtype = next(iter(self.classes)).dtype  # the compute dtype (every parameter's)
        self.owner: nn.Module | None = None  # the root whose forward runs now (None: none)
        self.entered = False  # whether that forward began the evaluate phase itself
        self.handles: list = []  # the roots' hooks

    def install(self) -> None:
        for root in self.roots:
            self.handles.append(root.register_forward_pre_hook(self._enter))
            self.handles.append(root.register_forward_hook(self._leave, always_call=True))
        for m in self.modules:
            m.__dict__.update({n: self._override(m, n) for n in OVERRIDES})
        self.guard(True)

    def uninstall(self) -> None:
        # A plain module again, but an offloaded chunk's parameters stay views of its released
        # storage (the values are in engine.state_dict()): those keep the guard, so a read
        # raises rather than crashes.
        for p, cls in self.classes.items():
            p.__class__ = self.guards[cls] if _released(p) else cls
        for h in self.handles:
            h.remove()
        for m, n in ((m, n) for m in self.modules for n in OVERRIDES):
            m.__dict__.pop(n, None)

    def guard(self, on: bool) -> None:
        for p, cls in self.classes.items():
            p.__class__ = self.guards[cls] if on else cls

    # -- a root's forward

    def _enter(self, module, args) -> None:
        replayer = self.engine.replayer
        if self.owner is not None:  # a root inside another's forward (HFCausalLM → .hf)
            return
        if replayer.phase is Phase.IDLE and torch.is_grad_enabled():
            msg = f"{type(module).__name__} called with grad enabled outside Engine.step/evaluate"
            raise ProtrainError(
                msg,
                "train with engine.step; evaluate under torch.no_grad()"
                " or with engine.evaluate((idx, targets))",
            )
        self.owner, self.entered = module, replayer.phase is Phase.IDLE
        self.guard(False)
        if self.entered:  # as Engine.evaluate: the plan's forward, nothing kept for backward
            replayer.phase = Phase.EVALUATE
            replayer.begin(Phase.FORWARD, PRE)

    def _leave(self, module, args, output) -> None:
        if module is not self.owner:
            return
        self.owner, replayer, store = None, self.engine.replayer, self.engine.store
        try:
            if self.entered and replayer.acts.segment == POST:  # (else it raised midway)
                replayer.end(Phase.FORWARD, POST)
        finally:
            if self.entered:
                replayer.phase = Phase.IDLE
                for cid in sorted(store.resident_offloaded()):
                    store.release(cid)  # waits for a prefetch still in flight
                    store.copies.events.emit("release", "mark", chunk=cid)
            self.guard(True)

    # -- module methods

    def _override(self, module: nn.Module, name: str):
        method = getattr(module, name, None)  # (None: __deepcopy__, which Module lacks)
        if name == "state_dict":
            return lambda *args, **kwargs: self._state_dict(method, *args, **kwargs)
        if name == "zero_grad":  # harmless: the engine zeroes its gradient buffers each step
            return lambda *args, **kwargs: None

        def refuse(*args, **kwargs):
            if self._changes_nothing(module, name, args, kwargs):
                return module
            what = f"{type(module).__name__}.{name}{args or ''}"
            raise ConfigError(f"{what} after wrap: the plan owns the parameters", OVERRIDES[name])

        return refuse

    def _changes_nothing(self, module, name: str, args: tuple, kwargs: dict) -> bool:
        """A ``to`` the device and compute dtype the plan gave, a ``requires_grad_`` to the flags
        the parameters have: these pass (Trainer-like code calls them unconditionally)."""
        if name == "requires_grad_":
            flag = args[0] if args else kwargs.get("requires_grad", True)
            return all(p.requires_grad == flag for p in module.parameters())
        if name != "to":
            return False
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        dev, d = self.engine.device, torch.device(device or self.engine.device)
        return d.type == dev.type and d.index in (None, dev.index) and dtype in (None, self.dtype)

    def _state_dict(self, method, *args, destination=None, keep_vars: bool = False, **kwargs):
        if destination is not None:  # a child's, inside the outer call: the plain one
            return method(*args, destination=destination, keep_vars=keep_vars, **kwargs)
        sd = method(*args, keep_vars=True, **kwargs)
        if not keep_vars:  # (keep_vars: the Parameters themselves, guarded)
            values, names = self.engine.state_dict()["model"], self.engine.names
            for k, v in sd.items():
                sd[k] = values[names[id(v)]] if id(v) in names else v.detach()
        return sd
