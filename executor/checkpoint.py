"""Checkpoints: ``Engine.save(root)`` / ``Engine.load(root)``, atomic, pickle-free.

Layout of a checkpoint root (one directory a run writes to again and again)::

    root/latest                   "step-00000040" — the one complete checkpoint to load
    root/step-00000040/manifest.json
    root/step-00000040/model.safetensors      fp32 masters in the model's own names
    root/step-00000040/optim.safetensors      <name>.exp_avg / .exp_avg_sq / .step
    root/step-00000040/rng-rank0.safetensors  torch RNG state(s) of each rank

[Note: atomicity] A save writes everything into ``root/.tmp-step-N``, fsyncs every
file and the directory, renames it to ``root/step-N`` (atomic on POSIX), fsyncs
``root``, and only then replaces ``latest`` through a fsynced temporary file and
``os.replace``. A crash or kill at any instant leaves ``latest`` naming a complete
checkpoint: the previous one until the final replace, the new one after. Stale
``.tmp-*`` directories are removed by the next save; the newest ``keep`` complete
checkpoints are kept. A save that fails (a full disk, a permission) removes its
temporary directory and raises ``CheckpointError`` saying how many bytes it needed
and how many were free; ``latest`` still names the previous checkpoint.
[Note: one run per root] A root belongs to one run at a time: ``lock_root`` takes an
advisory ``fcntl.flock`` on ``root/.lock`` (holding the owner's pid) for the whole run
(``protrain train`` does), and a save that does not hold it takes it for the save. A
second run is refused naming the holder's pid. A save touches only names its own
checkpoints use: ``.tmp-step-N`` directories (swept: with the lock held, no other save
is in progress), ``step-N`` (pruned), ``latest`` and ``.latest.tmp``; anything else in
the root (a user's ``.tmp-notes/``) stays. A save never writes a non-finite tensor and
``load`` refuses one (optim.py [Note: finite-state guard]), so ``latest`` and the
checkpoints ``keep`` leaves are always finite.
``_after_phase`` is a test hook called with each phase's name as it completes
(``directory``, ``rng``, ``tensors``, ``manifest``, ``renamed``, ``latest``,
``pruned``), so a test can kill the saver at a chosen point instead of a random one.

[Note: loading hostile files] ``load`` reads the manifest (capped at 1 MiB, decoded
strictly into a Struct), checks that it lists exactly the expected plain file
names, that every file has the listed size and SHA-256, that the parameter names and
shapes are this model's, and that each safetensors header agrees — all before any
tensor is read. Tensors are read with safetensors (no pickle, no code).

[Note: adapter checkpoints] A model that is mostly frozen (more frozen elements than
trainable ones: a LoRA base) saves only the trainable parameters (their fp32 masters and
moments): a 70B LoRA run writes megabytes. (A model with a few frozen layers saves them
all, as before: a checkpoint of it restores every value.) The
manifest's ``base_fingerprint`` stands for the base instead (``base_fingerprint``: the
frozen parameters' names, shapes, dtypes and a strided sample of up to ``BASE_SAMPLE``
values of each, read before wrap), and ``load`` refuses a checkpoint whose base is not
the live model's; the frozen parameters keep the values the model was built with.

State is saved in plain parameter names (``Engine.state_dict``), so a checkpoint
resumes under any plan of the same model: other budget, other world size. RNG
states are restored when the world size matches (each rank its own); under another
world size the ranks keep their current RNG state (dropout streams then differ
from the uninterrupted run; with dropout 0 nothing does). With several ranks the
root must be on a filesystem every rank sees (each rank writes its RNG file there).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from protrain.plans.errors import CheckpointError

FORMAT = "protrain-checkpoint"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
STEP_DIR = re.compile(r"step-(\d{8})(?:\.(\d{1,6}))?")
LOCK_FILE = ".lock"
OWN_NAMES = re.compile(r"latest|\.latest\.tmp|\.lock|(?:\.tmp-)?step-\d{8}(?:\.\d{1,6})?")
"""Every name a save (or its lock) writes in a root: [Note: one run per root]."""
HASH_BLOCK = 8 << 20
DAMAGED = "resume from another checkpoint"
"""The hint of every refusal of a damaged or foreign file (the previous step directory may be
whole)."""


def _after_phase(phase: str) -> None:
    """Test hook: called with each phase's name as a save completes it (see [Note: atomicity]);
    a test replaces it (tests/ckptworker.py) to kill the saver there. Does nothing in use."""


class FileEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    bytes: int
    sha256: str


class Scaler(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    scale: float
    good_steps: int


class Manifest(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    format: Literal["protrain-checkpoint"]
    version: int
    step: int
    """Optimizer steps done when the checkpoint was taken."""
    model_fingerprint: str
    world_size: int
    compute_dtype: str
    params: dict[str, list[int]]
    """Every saved parameter (tied aliases excluded) and its shape."""
    tied: list[list[str]]
    scaler: Scaler
    data: dict[str, int]
    """The caller's data position (e.g. ``{"micro_batches": 80}``), returned by ``load``."""
    files: dict[str, FileEntry]
    optimizer_state: bool = True
    """False when no update has happened yet (e.g. fp16 steps all skipped): no moments saved."""
    base_fingerprint: str = ""
    """An adapter checkpoint ([Note: adapter checkpoints]): the frozen base it was trained on,
    whose parameters it does not hold (``params`` lists the trainable ones); "" otherwise."""
    lr: float | None = None
    """``Engine.lr`` when saved, restored by ``load`` (None: a checkpoint from before rates were
    saved; the engine keeps its own)."""
    lr_schedule: dict[str, str | int | float] = {}
    """The caller's learning-rate schedule settings (``protrain train``'s), returned by ``load``
    as ``data`` is; the executor only stores them."""


BASE_SAMPLE = 4096
"""Values of each frozen parameter the base fingerprint reads (strided over the whole tensor)."""


def base_fingerprint(model: torch.nn.Module) -> str:
    """``sha256:`` of the frozen parameters (name, shape, dtype, a strided sample of values:
    [Note: adapter checkpoints]), or "" unless they are most of the model."""
    frozen = sorted((n, p) for n, p in model.named_parameters() if not p.requires_grad)
    if sum(p.numel() for _, p in frozen) * 2 <= sum(p.numel() for p in model.parameters()):
        return ""
    h = hashlib.sha256()
    for name, p in frozen:
        h.update(f"{name}|{list(p.shape)}|{p.dtype}|".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // BASE_SAMPLE)][:BASE_SAMPLE]
            h.update(sample.float().cpu().contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------- the root's owner

_held: dict[str, RootLock] = {}
"""Roots this process holds the lock of (by real path)."""


class RootLock:
    """The advisory lock of one checkpoint root ([Note: one run per root]); ``release`` ends it.
    ``fd`` -1: none held (as after ``release``; a save on a root its run already holds)."""

    def __init__(self, root: Path, fd: int):
        self.root, self.fd = root, fd

    def release(self) -> None:
        if self.fd >= 0:
            _held.pop(os.path.realpath(self.root), None)
            os.close(self.fd)  # (closing the descriptor drops the flock)
            self.fd = -1


def lock_root(root: str | Path, flag: str = "--save-dir") -> RootLock:
    """Take the lock of checkpoint root ``root`` (created if missing) for this process, or
    raise ``CheckpointError`` naming the pid of the run that holds it."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"{flag} {root}: cannot create its lock file ({e.strerror or e})",
            f"give {flag} a directory you can write",
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise CheckpointError(
            f"{flag} {root} is in use by another protrain run (pid {holder} holds "
            f"{root / LOCK_FILE}); two runs saving into one directory would delete each other's "
            "checkpoints",
            f"give this run its own directory (--save-dir {root}-2), or wait for pid {holder} to "
            "finish",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[os.path.realpath(root)] = lock = RootLock(root, fd)
    return lock


# ------------------------------------------------------------------------- save


def save(
    engine: Any,
    root: str | Path,
    *,
    data: dict[str, int] | None = None,
    keep: int = 2,
    lr_schedule: dict[str, str | int | float] | None = None,
) -> Path:
    """Write a checkpoint of ``engine`` under ``root``; every rank must call it. Returns its
    directory."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    root = Path(root)
    # a collective: every rank gathers
    sd = engine.state_dict(trainable_only=bool(engine.base_fingerprint))
    optim = {f"{k}.{part}": v for k, st in sd["optim"].items() for part, v in st.items()}
    tensors = [*sd["model"].items(), *optim.items()]
    # bytes; tied aliases counted twice (a bound)
    need = sum(t.numel() * t.element_size() for _, t in tensors)
    last = engine.last_checkpoint
    _refuse_nonfinite(
        tensors,
        f"checkpoint to {root} at step {engine.steps_done}",
        "; not written (a checkpoint must resume)",
        f"resume from the last finite checkpoint: `protrain train … --resume {last}`"
        if last
        else "train again with a lower learning rate: `protrain train … --lr X`",
    )
    # A save outside a run (rank 0, a root no lock_root of this process holds) owns the root
    # meanwhile.
    outside = engine.comm.rank == 0 and os.path.realpath(root) not in _held
    lock = lock_root(root, "the checkpoint root") if outside else RootLock(root, -1)
    try:
        caller = {"data": dict(data or {}), "lr_schedule": dict(lr_schedule or {})}  # (manifest's)
        return _write(engine, sd["model"], optim, root, caller, keep, need)
    finally:
        lock.release()


def _write(
    engine: Any, model: dict, optim: dict, root: Path, caller: dict[str, dict], keep: int, need: int
) -> Path:
    """``save`` once rank 0 holds the root's lock ([Note: one run per root]): name, sweep, the
    files, the rename, ``latest`` and the pruning ([Note: atomicity])."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    comm = engine.comm
    name = f"step-{engine.steps_done:08d}"
    # saved again at one step: a new name, never replaced
    if comm.rank == 0 and (root / name).exists():
        name += f".{next(k for k in itertools.count(1) if not (root / f'{name}.{k}').exists())}"
    if comm.world > 1:  # rank 0's choice, as bytes (no pickle)
        buf = torch.zeros(64, dtype=torch.uint8, device=engine.device)
        if comm.rank == 0:
            buf[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        comm.broadcast(buf, "checkpoint name")
        name = bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
    tmp, final = root / f".tmp-{name}", root / name
    try:  # safetensors reports a full disk as its own error
        if comm.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.iterdir():  # ours only: [Note: one run per root]
                if stale.name.startswith(".tmp-") and OWN_NAMES.fullmatch(stale.name):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        comm.barrier("checkpoint directory")
        _after_phase("directory")
        rng = {"cpu": torch.get_rng_state()}
        if engine.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(engine.device)
        save_file(rng, tmp / f"rng-rank{comm.rank}.safetensors")
        fsync_path(tmp / f"rng-rank{comm.rank}.safetensors")
        comm.barrier("checkpoint RNG states")
        _after_phase("rng")
        if comm.rank == 0:
            _write_rank0(engine, model, optim, tmp, caller)
    except (OSError, SafetensorError) as e:
        raise _save_failed(root, tmp, e, need) from None
    if comm.rank == 0:
        os.rename(tmp, final)
        fsync_path(root)
        _after_phase("renamed")
        _write_latest(root, name, final)
        _after_phase("latest")
        # Keep the one just written (``latest``) and the keep-1 newest others by step; a run
        # resumed from an older step may write a lower step than those already there.
        others = sorted(
            (p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.name != name),
            key=lambda p: ([int(g or 0) for g in STEP_DIR.fullmatch(p.name).groups()], p.name),
        )
        for old in others[: max(0, len(others) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        _after_phase("pruned")
    comm.barrier("checkpoint rename")
    return final


def _write_latest(root: Path, name: str, final: Path) -> None:
    """Point ``latest`` at ``name`` through a fsynced temporary file; on failure (a full disk)
    remove the temporary file and say that the complete ``final`` is there to resume from."""
    latest_tmp = root / ".latest.tmp"
    try:
        with open(latest_tmp, "w", encoding="ascii") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, root / "latest")
        fsync_path(root)
    except OSError as e:
        latest_tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"checkpoint {final} is complete, but {root / 'latest'} could not be pointed at it: "
            f"{e.strerror or e}; `latest` still names the previous checkpoint",
            f"free space in {root}, then resume from the new one: `protrain train … --resume "
            f"{final}`",
        ) from None


def _write_rank0(engine: Any, model: dict, optim: dict, tmp: Path, caller: dict) -> None:
    """Rank 0's files: parameters, optimizer state (``name.part``), then the manifest listing
    every file (and ``caller``'s fields: ``data``, ``lr_schedule``)."""
    from safetensors.torch import save_file

    aliases = {alias for _, alias in engine.plan.model.tied}
    model = {k: v.contiguous() for k, v in model.items() if k not in aliases}
    save_file(model, tmp / "model.safetensors")
    save_file({k: v.contiguous() for k, v in optim.items()}, tmp / "optim.safetensors")
    files = {}
    for f in sorted(tmp.iterdir()):
        fsync_path(f)
        files[f.name] = FileEntry(bytes=f.stat().st_size, sha256=_sha256(f))
    _after_phase("tensors")
    manifest = Manifest(
        format=FORMAT,
        version=VERSION,
        step=engine.steps_done,
        model_fingerprint=engine.plan.model.fingerprint,
        world_size=engine.comm.world,
        compute_dtype=engine.plan.training.compute_dtype,
        params={k: list(v.shape) for k, v in model.items()},
        tied=[list(p) for p in engine.plan.model.tied],
        scaler=Scaler(scale=engine.scaler.scale, good_steps=engine.scaler.good_steps),
        files=files,
        optimizer_state=bool(optim),
        base_fingerprint=engine.base_fingerprint,
        lr=engine.lr,
        **caller,
    )
    (tmp / "manifest.json").write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    fsync_path(tmp / "manifest.json")
    fsync_path(tmp)
    _after_phase("manifest")


def _save_failed(root: Path, tmp: Path, error: Exception, need: int) -> CheckpointError:
    """Remove the half-written ``tmp`` and describe the failure (space needed vs free)."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        free = (
            f"{shutil.disk_usage(root if root.exists() else root.parent).free / 2**20:,.1f} MiB "
            "free there"
        )
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"checkpoint to {root} failed: {getattr(error, 'strerror', None) or error} (a checkpoint "
        f"needs about {need / 2**20:,.1f} MiB; {free}); the partial {tmp.name} was removed, and "
        "`latest` still names the previous checkpoint",
        "free space or give --save-dir another directory; fewer kept checkpoints (--keep 1) need "
        "less",
    )


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _refuse_nonfinite(
    tensors: list[tuple[str, torch.Tensor]], where: str, fate: str, hint: str
) -> None:
    """Refuse a state holding NaN or inf, naming its first such tensor: a save writes finite
    tensors only and a load reads them only ([Note: one run per root]). All on the host: one
    ``all_finite`` reads each tensor once, and only a refusal looks for the name."""
    from .optim import all_finite

    if not all_finite([t for _, t in tensors]):
        bad = next(name for name, t in tensors if not all_finite([t]))
        raise CheckpointError(f"{where}: {bad} holds NaN or infinite values{fate}", hint)


# ------------------------------------------------------------------------- load


def resolve(root: str | Path) -> Path:
    """The checkpoint directory ``root`` means: itself if it holds a manifest, else
    ``root/latest``."""
    root = Path(root)
    if (root / "manifest.json").is_file():
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise CheckpointError(
            f"{root}: no checkpoint here (neither manifest.json nor latest)",
            "pass the directory given to --save-dir / Engine.save",
        )
    with open(latest, "rb") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    if not STEP_DIR.fullmatch(text):
        raise CheckpointError(
            f"{latest}: names {text[:24]!r}, not a step-NNNNNNNN directory",
            "point --resume at a step directory that holds manifest.json",
        )
    return root / text


def read_manifest(directory: str | Path) -> Manifest:
    """Decode and check ``directory/manifest.json`` and the files it lists; read no tensor."""
    directory = Path(directory)
    where = directory / "manifest.json"
    try:
        with open(where, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise CheckpointError(
            f"{where}: cannot read ({e.strerror or e})", "check the path"
        ) from None
    m = decode_manifest(raw, str(where))
    for name, entry in m.files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry.bytes:
            raise CheckpointError(
                f"{path}: missing or not {entry.bytes} bytes (incomplete checkpoint)", DAMAGED
            )
        if _sha256(path) != entry.sha256:
            raise CheckpointError(f"{path}: SHA-256 differs from the manifest (corrupted)", DAMAGED)
    return m


def decode_manifest(raw: bytes, where: str = "<manifest bytes>") -> Manifest:
    """Strictly decode and check a manifest's own bytes; any bad input is a ``CheckpointError``."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{where}: larger than 1 MiB; not a protrain manifest", "check the path"
        )
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{where}: not a valid checkpoint manifest: {e}",
            f"{DAMAGED} (the previous step directory)",
        ) from None
    if m.version != VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format {m.version}; this protrain reads {VERSION}",
            "resume with the protrain version that wrote it",
        )
    if (
        not 1 <= m.world_size <= 65536
        or m.step < 0
        or not 0 < m.scaler.scale < float("inf")
        or not 0 <= (m.lr or 0.0) < float("inf")
    ):
        raise CheckpointError(
            f"{where}: world_size {m.world_size}, step {m.step}, loss scale "
            f"{m.scaler.scale} or learning rate {m.lr} out of range",
            DAMAGED,
        )
    expected = {"model.safetensors", "optim.safetensors"} | {
        f"rng-rank{r}.safetensors" for r in range(m.world_size)
    }
    if set(m.files) != expected:  # (plain names only: world_size is at most 65536, checked above)
        raise CheckpointError(
            f"{where}: lists files {sorted(m.files)[:6]}, expected {sorted(expected)[:6]}", DAMAGED
        )
    return m


OPTIM_PARTS = ("exp_avg", "exp_avg_sq", "step")


def check_header(
    path: Path, expected: dict[str, tuple[list[int], torch.dtype]], partial: bool = False
) -> None:
    """Check the file's tensor names, shapes and dtypes against ``expected`` before reading.
    ``partial``: the optimizer file, which holds all three parts of some parameters (those
    that have stepped; frozen and never-used ones have no state, as in torch.optim)."""
    from safetensors import safe_open

    try:  # the header alone; safetensors raises its own SafetensorError on a bad one
        with safe_open(path, framework="pt") as f:
            found = {
                k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})", DAMAGED) from None
    if partial:
        whole = {f"{k.rsplit('.', 1)[0]}.{part}" for k in found for part in OPTIM_PARTS}
        expected = {k: v for k, v in expected.items() if k in whole}
    if found.keys() != expected.keys():
        diff = sorted(found.keys() ^ expected.keys())
        raise CheckpointError(f"{path}: tensors differ from the manifest, e.g. {diff[:3]}", DAMAGED)
    for k, (shape, dtype) in found.items():
        want = (expected[k][0], _ST_DTYPES[expected[k][1]])
        if (shape, dtype) != want:
            raise CheckpointError(
                f"{path}: tensor {k!r} is {dtype} {shape}, expected {want[1]} {want[0]}", DAMAGED
            )


_ST_DTYPES = {torch.float32: "F32", torch.uint8: "U8"}


def load(engine: Any, root: str | Path) -> Manifest:
    """Restore ``engine`` from the checkpoint ``root`` names; returns its manifest (data
    position)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory = resolve(root)
    m = read_manifest(directory)
    # [Note: adapter checkpoints]
    if m.base_fingerprint and m.base_fingerprint != engine.base_fingerprint:
        mine = engine.base_fingerprint
        raise CheckpointError(
            f"{directory}: adapters trained on another base (base {m.base_fingerprint[:19]}…, "
            + (f"this model's {mine[:19]}…)" if mine else "this model's has no frozen parameters)"),
            "resume with the base model (and the --lora settings) the checkpoint was trained with",
        )
    # (a chunk's parameter is never a tied alias: validate refuses an alias with a chunk slot, and
    # check() at wrap refuses a plan naming other than the model's first names (named_parameters))
    mine = {
        engine.names[id(p)]: list(p.shape)
        for c in engine.store.chunks
        for p, _, _ in c.params
        if p.requires_grad or not m.base_fingerprint
    }
    if m.model_fingerprint != engine.plan.model.fingerprint or m.params != mine:
        wrong = sorted(set(m.params) ^ set(mine)) or [k for k in mine if m.params.get(k) != mine[k]]
        raise CheckpointError(
            f"{directory}: checkpoint of another model (fingerprint {m.model_fingerprint[:19]}…, "
            f"this model {engine.plan.model.fingerprint[:19]}…; e.g. {wrong[:3]})",
            "resume with the model the checkpoint was saved from",
        )
    check_header(
        directory / "model.safetensors", {k: (v, torch.float32) for k, v in m.params.items()}
    )
    check_header(
        directory / "optim.safetensors",
        {
            f"{k}.{part}": (([] if part == "step" else v), torch.float32)
            for k, v in m.params.items()
            for part in OPTIM_PARTS
        }
        if m.optimizer_state
        else {},
        partial=True,
    )
    rng = directory / f"rng-rank{engine.comm.rank}.safetensors"
    restore_rng = m.world_size == engine.comm.world
    if restore_rng:  # checked before the engine changes, like the other files
        with safe_open(rng, framework="pt") as f:
            if "cpu" not in f.keys() or f.get_slice("cpu").get_dtype() != "U8":
                raise CheckpointError(f"{rng}: no uint8 `cpu` RNG state", DAMAGED)
    # (no aliases: load_state_dict reads chunk names only)
    model = load_file(directory / "model.safetensors")
    flat = load_file(directory / "optim.safetensors")
    refuse_to_load_nonfinite(directory, model, flat)
    optim = {
        n: {part: flat[f"{n}.{part}"] for part in OPTIM_PARTS}  # all three of each: check_header
        for n in dict.fromkeys(k.rsplit(".", 1)[0] for k in flat)
    }
    engine.load_state_dict({"model": model, "optim": optim})
    engine.scaler.scale, engine.scaler.good_steps = m.scaler.scale, m.scaler.good_steps
    engine.steps_done = m.step
    if m.lr is not None:
        engine.set_lr(m.lr)
    if restore_rng:
        state = load_file(rng)
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and engine.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], engine.device)
    return m


def refuse_to_load_nonfinite(directory: Path, model: dict, optim: dict) -> None:
    """A checkpoint holding NaN or inf (not one this protrain wrote) is refused before the
    engine changes; ``optim`` as the file holds it (``name.part``: tensor)."""
    _refuse_nonfinite(
        [*model.items(), *optim.items()],
        str(directory),
        " (the state of a diverged run); not loaded",
        "resume from an earlier checkpoint: "
        f"`protrain train … --resume {directory.parent}/step-NNNNNNNN`",
    )
