"""Checks a command runs before its long work: output paths, host memory, the budget.

A search, a profile or a training run that fails at its last line (an output
directory that does not exist, a checkpoint root that is not writable) has wasted
its time; a model built on the CPU that does not fit the host is an OOM kill with no
message. Each check here is cheap, raises ``ConfigError`` with a HINT, and runs
before anything expensive.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from protrain.plans.errors import BudgetError, ConfigError, HostMemoryError, ProtrainError

from ..hardware.units import human_bytes


def output_file(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse a file path ``flag`` will write that cannot be written (checked, not created)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"{flag} {p}: is a directory", f"give {flag} a file name, e.g. {p / 'out.json'}"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(
            f"{flag} {p}: directory {parent} does not exist",
            f"create it first (mkdir -p {parent}) or give {flag} another path",
        )
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(
            f"{flag} {p}: not writable (permission denied)", f"give {flag} a path you can write"
        )


def output_dir(
    path: str | os.PathLike | None, flag: str, *, create: bool = True, must_be_empty: bool = False
) -> None:
    """Refuse a directory ``flag`` will write into that cannot be written; create it if asked."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"{flag} {p}: is a file, not a directory", f"give {flag} a directory path"
        )
    if must_be_empty and p.is_dir() and any(p.iterdir()):
        raise ConfigError(
            f"{flag} {p}: the directory is not empty", f"give {flag} a new or empty directory"
        )
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"{flag} {p}: cannot create the directory ({e.strerror})",
                f"give {flag} a path you can write",
            ) from None
        where = p
    else:
        where = next((q for q in [p, *p.parents] if q.exists()), Path("."))
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {p}: not writable (permission denied)", f"give {flag} a path you can write"
        )


def available_host_memory() -> int:
    """Bytes of host RAM available now (MemAvailable, capped by a cgroup limit)."""
    from ..hardware.probe import _host_memory

    return _host_memory()[1]


def host_memory_for_build(
    model_name: str, *, bytes_per_param: int = 4, what: str = "build"
) -> None:
    """Refuse to build ``model_name`` on the CPU when its fp32 parameters alone exceed free RAM.

    Counted on the meta device (nothing allocated). ``bytes_per_param``: 4 for the
    build itself; a caller that will also hold masters and Adam states asks for more.
    """
    from ..models.zoo import describe

    n = describe(model_name).n_params
    need, available = n * bytes_per_param, available_host_memory()
    if available and need > available:
        raise HostMemoryError(
            f"{model_name} has {n:,} parameters: to {what} it on the CPU needs about "
            f"{human_bytes(need)} of host memory, and {human_bytes(available)} is available here",
            "use a smaller model (`protrain models` lists their sizes), or a machine with more "
            "RAM; `protrain plan --hardware SPEC --model NAME` plans a big model without building "
            "it",
            need=need,
            available=available,
        )


def budget_within_card(budget_bytes: int, spec, *, where: str) -> None:
    """Refuse a budget larger than the device it is for (``spec``: the profile's hardware)."""
    if budget_bytes > spec.device_memory_bytes:
        raise BudgetError(
            f"budget {human_bytes(budget_bytes)} exceeds the "
            f"{human_bytes(spec.device_memory_bytes)} of device memory of {spec.name} "
            f"({spec.device_name}), the hardware {where} is for",
            f"`protrain plan --budget {human_bytes(spec.usable_memory_bytes).replace(' ', '')}` or "
            "less (its usable memory), or plan for the card you mean (`protrain plan --model NAME "
            "--hardware SPEC`)",
        )


def plan_activations(plan, model_name: str):
    """The activation bytes per segment of ``plan``'s own training shape (micro_batch, seq_len,
    dtype), counted for ``model_name`` on the meta device (``analytic.count_segments``: nothing
    allocated), as ``memory_walk.SegmentBytes``; None when the model's blocks are not the
    plan's (the fingerprint check refuses that plan after the build).

    Counted here rather than read from the plan's prediction: that figure is for the shape
    the plan was made for, and a hand-edited ``micro_batch`` (or a duplicate key) keeps it
    (issue 39 item 8: a plan at micro_batch 100,000 predicted nothing more and grew to OOM).
    No transient peaks: as on a CPU device, whose ledger counts none. Counted for one sequence
    and scaled by the micro-batch (activations are linear in it; the few bytes that are not,
    position ids, are over-counted)."""
    from ..search import memory_walk

    t = plan.training
    one = _one_sequence(model_name, tuple(plan.model.blocks), t.seq_len, t.compute_dtype)
    if one is None:
        return None
    saved, swapped, inputs = ([x * t.micro_batch for x in row] for row in one)
    zeros = [0] * len(saved)
    return memory_walk.SegmentBytes(saved, swapped, inputs, fwd_peak=zeros, bwd_peak=zeros)


@functools.lru_cache(maxsize=16)
def _one_sequence(model_name: str, blocks: tuple[str, ...], seq_len: int, dtype: str):
    """``plan_activations``' count at micro-batch 1: (saved, swapped, inputs) per segment."""
    from ..hardware.spec import find_spec
    from ..models.zoo import build
    from ..profiling.analytic import count_segments

    try:
        counts = count_segments(
            build(model_name, device="meta"),
            blocks=list(blocks),
            micro_batch=1,
            seq_len=seq_len,
            compute_dtype=dtype,
            spec=find_spec("cpu"),
        )
    except (ProtrainError, KeyError, AttributeError, ValueError, RuntimeError, IndexError):
        return (
            None  # (blocks the model does not have: another model's plan, refused after the build)
        )
    return tuple(
        tuple(getattr(c, k) for c in counts)
        for k in ("saved_bytes", "saved_tensor_bytes", "input_bytes")
    )


def plan_fits_host(
    plan, model_name: str, *, device: str, where: str = "the plan", ranks: int | None = None
) -> int:
    """Refuse to train ``plan`` when this machine cannot hold what it needs on the host (before the
    build); return that need in bytes.

    The need, per process: the model's fp32 parameters (built on the CPU first), the
    plan's own host figures from ``memory_walk.walk`` (offloaded chunks' states, swapped
    activations at the turn) and, when the device is the CPU, the device side too (the
    walk's peak: persistent chunks, buffers, gradients, activations) and one micro-batch's
    token ids and fp32 logits: a CPU's device and host are one RAM. The activations are
    those of the plan's own shape (``plan_activations``). torchrun's ``LOCAL_WORLD_SIZE``
    ranks (``ranks``: that many) share the machine. Also refuses a sequence longer than the
    model's positions, which would fail only at the first forward.
    """
    from ..models.zoo import describe
    from ..search import memory_walk

    info = describe(model_name)
    t = plan.training
    if info.max_seq_len and t.seq_len > info.max_seq_len:
        raise ConfigError(
            f"{where}: seq_len {t.seq_len} is longer than {model_name}'s {info.max_seq_len} "
            "positions - at `$.training.seq_len`",
            f"make a plan with `protrain plan --seq {info.max_seq_len}` or less",
        )
    w = memory_walk.walk(plan, plan_activations(plan, model_name))
    parts = {
        "fp32 parameters": info.n_params * 4,
        "offloaded states": w.host_bytes,
        "swapped activations": w.host_swap_bytes,
    }
    if device == "cpu":
        tokens = t.micro_batch * t.seq_len
        parts["device side on the CPU"] = int(w.peak_bytes)
        parts["one micro-batch's ids and logits"] = tokens * (2 * 8 + info.vocab_size * 4)
    ranks = ranks or max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    need, available = sum(parts.values()) * ranks, available_host_memory()
    if available and need > available:
        detail = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
        per = f" × {ranks} ranks on this machine" if ranks > 1 else ""
        one = "; on a CPU the device and the host are one RAM" if device == "cpu" else ""
        raise HostMemoryError(
            f"{where}: training {model_name} needs about {human_bytes(need)} of host memory "
            f"({detail}{per}{one}), and {human_bytes(available)} is available here",
            "make a plan that fits this machine: `protrain plan --model NAME --host-memory SIZE …` "
            "(or a smaller --batch), or use a machine with more RAM",
            need=need,
            available=available,
        )
    return need


MACHINE_TOLERANCE = 0.10
"""Device memory sizes within this fraction of each other count as the same card: a
datasheet's 80 GiB and a probe's 79.1 GiB of one H100 (the probe sees what the driver leaves)."""


def other_machine(plan, device: str) -> str | None:
    """A one-line note when ``plan`` was made for another machine than ``device`` here, else None.

    What is compared: the kind of device (a plan for a CPU, the ``cpu`` spec or a probe of one,
    against a CUDA device, or a GPU's plan on the CPU) and its memory (``plan.hardware``'s
    device_memory_bytes against this GPU's total memory, or this host's RAM for a CPU: what a
    probe records). A plan that recorded no hardware (made by hand or by a library call) says
    nothing. Its peak is still checked against the budget on this device; only its predicted
    times and the machine's measured rates are another machine's.
    """
    h = plan.hardware
    if not h.name or not h.device_memory_bytes:
        return None
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        index = torch.device(device).index
        props = torch.cuda.get_device_properties(
            torch.cuda.current_device() if index is None else index
        )
        here, memory = props.name, props.total_memory
    else:
        from ..hardware.probe import _host_memory

        here, memory = "this CPU", _host_memory()[0]
    plan_cpu = h.name == "cpu" or h.name.startswith("cpu-")
    same_kind = plan_cpu == (kind == "cpu")
    if same_kind and memory and abs(h.device_memory_bytes - memory) <= MACHINE_TOLERANCE * memory:
        return None
    return (
        f"note: this plan was made for {h.name} ({human_bytes(h.device_memory_bytes)} of device "
        f"memory), not for this machine ({here}, {human_bytes(memory)}): its predicted times and "
        f"peak are {h.name}'s, not this machine's; for this one's, plan here (`protrain plan "
        f"--model NAME --device {kind} …`, or --hardware SPEC naming this machine)"
    )


def checkpoint_bytes(plan) -> tuple[int, int]:
    """(bytes of one checkpoint of ``plan``'s model, bytes of its largest file): fp32 masters
    and two Adam moments of the trained parameters, and the frozen ones' values unless they are
    most of the model (an adapter checkpoint: executor/checkpoint.py
    [Note: adapter checkpoints])."""
    params = [p for c in plan.chunks.items for p in c.params]
    total = sum(p.numel for p in params) or plan.model.n_params
    trained = sum(p.numel for p in params if not p.frozen) if params else total
    model = trained * 4 if (total - trained) * 2 > total else total * 4
    optim = trained * 8
    return model + optim, max(model, optim)


def _tokenizer_bytes(tokenizer_dir) -> int:
    from ..models.hf_checkpoint import tokenizer_files

    return sum((Path(tokenizer_dir) / n).stat().st_size for n in tokenizer_files(tokenizer_dir))


def _disk_of(path: Path) -> Path:
    """The nearest existing directory at or above ``path`` (where it will be created)."""
    return next((q for q in [path, *path.parents] if q.is_dir()), Path("."))


ROOM_MARGIN = 1 << 20
"""Bytes beyond the estimate a disk must have free: manifests, configs, directory entries."""


def output_room(
    plan,
    *,
    save_dir=None,
    keep: int = 2,
    saves: int = 1,
    export_dir=None,
    export_merged=None,
    keeper=None,
    lora: bool = False,
    tokenizer_dir=None,
) -> None:
    """Refuse, before the first step, outputs that cannot fit: each disk's free space against
    what this run will write there (``save_dir``: up to ``keep`` checkpoints and the one being
    written, or ``saves`` in all; the export, the merged export, ``keeper``, the checkpoint kept
    beside an export until it succeeded), all of them on one disk counted together; and the
    process's file-size limit (``ulimit -f``, RLIMIT_FSIZE) against the largest file."""
    import resource

    ckpt, ckpt_file = checkpoint_bytes(plan)
    n_params = plan.model.n_params
    trained = sum(p.numel for c in plan.chunks.items for p in c.params if not p.frozen)
    tok = _tokenizer_bytes(tokenizer_dir)
    outputs: list[tuple[str, Path, int, int]] = []  # (what, path, bytes, largest file)
    if save_dir is not None:
        root = Path(save_dir)
        there = (
            sum(1 for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
            if root.is_dir()
            else 0
        )
        count = max(1, min(keep + 1, there + saves) - there)
        what = (
            f"--save-dir {root} ({count} checkpoint{'s' if count > 1 else ''} of "
            f"{human_bytes(ckpt)})"
        )
        outputs.append((what, root, count * ckpt, ckpt_file))
    if export_dir is not None:
        size = (trained if lora else n_params) * 4
        outputs.append(
            (
                f"--export {export_dir} ({human_bytes(size + tok)})",
                Path(export_dir),
                size + tok,
                size,
            )
        )
    if export_merged is not None:
        size = n_params * 4
        outputs.append(
            (
                f"--export-merged {export_merged} ({human_bytes(size + tok)})",
                Path(export_merged),
                size + tok,
                size,
            )
        )
    if keeper is not None:
        outputs.append(
            (
                f"the checkpoint kept until the export, {keeper} ({human_bytes(ckpt)})",
                Path(keeper),
                ckpt,
                ckpt_file,
            )
        )
    if not outputs:
        return
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        what, path, _, largest = max(outputs, key=lambda o: o[3])
        if largest > limit:
            raise ConfigError(
                f"{what.split(' (')[0]}: a file of about {human_bytes(largest)} will be written "
                f"there, and this process may write files of at most {human_bytes(limit)} (ulimit "
                "-f, RLIMIT_FSIZE)",
                "raise the limit (`ulimit -f unlimited`) and run again",
            )
    disks: dict[int, list[tuple[str, Path, int, int]]] = {}
    for out in outputs:
        try:
            disks.setdefault(os.stat(_disk_of(out[1])).st_dev, []).append(out)
        except OSError:
            continue  # (unreadable: output_dir has said so already)
    import shutil

    for group in disks.values():
        where = _disk_of(group[0][1])
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            continue
        need = sum(o[2] for o in group) + ROOM_MARGIN
        if need > free:
            flag = group[0][0].split(" ")[0]
            raise ConfigError(
                f"not enough disk space for this run's output: {' + '.join(o[0] for o in group)} "
                f"need about {human_bytes(need)}, and the disk of {where} has {human_bytes(free)} "
                "free",
                f"free space on the disk of {where}, or give {flag} a directory on a disk with "
                "room",
            )
