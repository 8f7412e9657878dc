"""Chunk homes and block policies: where each state lives, declared once.

A chunk's *home* says where its states are kept between uses: its compute-dtype values,
its gradients, and (if any parameter trains) its fp32 master and the two Adam moments.
A block's *policy* says what its saved activations do between its forward and its
backward. Each is one entry in a table below: the tensors it keeps (where, how many
bytes per element, of which element count), the traffic of its events, and the
preconditions of the plan that may use it.

Everything that needs bytes or traffic reads these tables: the accounting stream
(``accounting.state_events``: the ledger's expectations, ``show``, ``fit``), the executor's
allocation (``chunks.ChunkStore``'s pinned arena, ``optim``'s states), the cost model and
its tier choice (planner ``cost``, ``host_tiers``), the trace, and validation. Adding a
home is one entry here plus its mechanism in the executor, the search's space and a
plan migration; nothing else re-derives a byte from flags.

Element counts. A chunk has ``padded_numel`` elements (the plan's ``chunk_numel`` padded
to a multiple of the world size ``W``); its shard is ``padded / W``. A part ``over``
``"chunk"`` is the whole padded chunk on every rank (a persistent chunk's values and
gradients); a part over ``"own"`` is the elements whose states this rank keeps
(``own_numel``): its shard under ZeRO-3, or at one rank an offloaded chunk up to its last
parameter rounded up to ``VEC_ALIGN`` (its padding has no state), or a persistent chunk's
whole padded size unless its states are sharded.

Plain data, plain Python: no torch, no numpy, so the executor, the planner and light
commands (``show``, ``diff``) all import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from .errors import PlanError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

VEC_ALIGN = 64
"""fp32 elements; a multiple of every CPU vector width of the fused AdamW kernel (8 for
AVX2, 16 for AVX-512, up to 64 for 2048-bit SVE): an offloaded chunk's host states at
one rank stop at its last parameter rounded up to it (optim.py [Note: optimizer placement])."""

STEP_PIECE = 1 << 20
"""fp32 elements of 16-bit gradients (in a home or a slot) the CPU step reads at once, and
of the device steps' scratch (a multiple of ``VEC_ALIGN``; optim.py ``_adamw_pieces``)."""

NVME_ALIGN = 1 << 16
"""Bytes each tensor in the NVMe file starts on: a page of any page size (4 KiB to 64 KiB),
so one tensor's pages are never another's (nvme.py ``DiskStates.drop``)."""

NVME_WINDOW = 4 * (4 * STEP_PIECE + 2 * NVME_ALIGN)
"""Host bytes of the NVMe file mapped at once: the CPU step's pieces of master and two
moments and a fetch's (or the home's refresh's) piece of a master, each widened to whole
pages (nvme.py [Note: NVMe tier])."""

# ------------------------------------------------------------------- element counts


def padded_numel(chunk_numel: int, world_size: int) -> int:
    """A chunk's elements on every rank: ``chunk_numel`` padded to a multiple of the world size."""
    return -(-chunk_numel // world_size) * world_size


def shard_numel(chunk_numel: int, world_size: int) -> int:
    """One rank's shard of a chunk (executor/dist.py [Note: sharding])."""
    return padded_numel(chunk_numel, world_size) // world_size


def own_numel(chunk_numel: int, world_size: int, end: int) -> int:
    """Elements of an offloaded chunk whose states one rank keeps (home, master, moments,
    gradient buffers): its shard under ZeRO-3; at one rank the chunk up to its last
    parameter (``end``, an element offset), rounded up to ``VEC_ALIGN``, not its padding."""
    if world_size > 1:
        return shard_numel(chunk_numel, world_size)
    return min(chunk_numel, -(-end // VEC_ALIGN) * VEC_ALIGN)


def nvme_span(numel: int) -> int:
    """Bytes one fp32 tensor of ``numel`` elements takes in the NVMe file, alignment included."""
    return -(-numel * 4 // NVME_ALIGN) * NVME_ALIGN


# ----------------------------------------------------------------------- training setup


@dataclass(frozen=True)
class Setup:
    """What a home's bytes depend on beyond the chunk: the compute dtype and accumulation."""

    compute_dtype: str
    grad_accum: int = 1

    @property
    def cb(self) -> int:
        """Bytes of one compute-dtype element."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def master(self) -> int:
        """Bytes of a separate fp32 master: none in fp32, where the values are the master."""
        return 4 if self.cb != 4 else 0

    @property
    def grads_in_home(self) -> bool:
        """16-bit compute without accumulation: an offloaded chunk's gradients land in its
        home (or a homeless chunk's slot) and are stepped from there (optim.py [Note:
        gradients land in home]); otherwise an fp32 accumulator takes them."""
        return self.cb != 4 and self.grad_accum == 1

    @property
    def staging(self) -> int:
        """Bytes of the compute-dtype staging buffer of later micro-batches (``grad_accum > 1``)."""
        return self.cb if self.grad_accum > 1 else 0


def host_scratch_bytes(setup: Setup, shard: int) -> int:
    """The CPU step's fp32 scratch, through which it reads 16-bit gradients that landed in a
    home or a slot (optim.py ``_adamw_pieces``): one ``STEP_PIECE``, or a shard if smaller.
    Present once when some trainable chunk steps on the host (one worker, one chunk at a time)."""
    return 4 * min(shard, STEP_PIECE) if setup.grads_in_home else 0


def device_scratch_bytes(shard: int) -> int:
    """The device steps' fp32 scratch, once when some trainable chunk is device-homed."""
    return 4 * min(shard, STEP_PIECE)


# ------------------------------------------------------------------------- the homes


@dataclass(frozen=True)
class Part:
    """One tensor a home keeps for a chunk, on one rank."""

    name: str  # values, grads, home, master, exp_avg, exp_avg_sq, accumulator, staging
    where: str  # "device", "host" or "disk"
    kind: str  # the ledger's kind: chunks, grads, optim (device); home, optim (host); optim (disk)
    elem_bytes: int  # bytes per element
    over: str  # "chunk": the whole padded chunk; "own": the elements whose states this rank keeps

    def nbytes(self, chunk: int, own: int) -> int:
        """Bytes of the tensor for a chunk of ``chunk`` padded elements, ``own`` of them kept here.
        A disk tensor starts on its own pages (``nvme_span``)."""
        n = chunk if self.over == "chunk" else own
        if self.where == "disk":
            return self.elem_bytes // 4 * nvme_span(n)
        return self.elem_bytes * n


ARENA_PARTS = ("home", "accumulator", "staging")
"""Host parts carved from the executor's pinned arena (transfer.py [Note: pinned arena]);
the master and moments are plain host memory (or the NVMe file)."""


def _optim(s: Setup, where: str, master: int | None = None) -> list[Part]:
    """fp32 master (``master`` bytes: ``s.master`` unless given) and the two Adam moments."""
    m = s.master if master is None else master
    return [
        Part("master", where, "optim", m, "own"),
        Part("exp_avg", where, "optim", 4, "own"),
        Part("exp_avg_sq", where, "optim", 4, "own"),
    ]


def _host_grads(s: Setup) -> list[Part]:
    """An offloaded chunk's host gradient buffers: none when they land in its home."""
    if s.grads_in_home:
        return []
    return [
        Part("accumulator", "host", "optim", 4, "own"),
        Part("staging", "host", "optim", s.staging, "own"),
    ]


def _persistent(s: Setup, trainable: bool) -> list[Part]:
    values = [Part("values", "device", "chunks", s.cb, "chunk")]
    return (
        values + [Part("grads", "device", "grads", s.cb, "chunk"), *_optim(s, "device")]
        if trainable
        else values
    )


def _host(s: Setup, trainable: bool) -> list[Part]:
    home = [Part("home", "host", "home", s.cb, "own")]
    return home + _optim(s, "host") + _host_grads(s) if trainable else home


def _homeless(s: Setup, trainable: bool) -> list[Part]:
    return _optim(s, "host") + _host_grads(s) if trainable else []


def _device_homed(s: Setup, trainable: bool) -> list[Part]:
    # The master is kept even in fp32: the chunk's device values live in a shared buffer.
    return (
        _optim(s, "device", master=4)
        if trainable
        else [Part("values", "device", "chunks", s.cb, "own")]
    )


def _nvme(s: Setup, trainable: bool) -> list[Part]:
    home = [Part("home", "host", "home", s.cb, "own")]
    if not trainable:
        return home
    # In fp32 the home is the master, so it moves to the disk with it.
    return (home if s.cb != 4 else []) + _optim(s, "disk", master=4) + _host_grads(s)


def _nvme_homeless(s: Setup, trainable: bool) -> list[Part]:
    return _optim(s, "disk", master=4) + _host_grads(s) if trainable else []


@dataclass(frozen=True)
class Home:
    """Where one chunk's states live (``placement.homes[i]`` of a plan)."""

    name: str
    parts_of: Callable[[Setup, bool], list[Part]] = field(repr=False)
    offloaded: bool = True
    """Fetched into one of the ``n_buffer`` shared device buffers for its segments, released
    after."""
    steps_on: str = "host"
    """Where a trainable chunk's optimizer step runs: "device" or "host" (the CPU worker)."""
    needs_16bit: bool = False
    """Its master must differ from its values (16-bit compute)."""
    needs_accum_1: bool = False
    """Gradient accumulation 1: a gradient must not outlive the chunk's step."""
    needs_during_backward: bool = False
    """``schedule.cpu_adam = during_backward``: the chunk steps as its gradients complete."""
    needs_trainable: bool = False
    """Its master is its only copy of the values: a frozen chunk (no master) cannot live here."""
    uses_slots: bool = False
    """Uploads and gradients pass through the plan's pinned host slots (chunks.py
    [Note: host slots])."""
    fetch_rounds_master: bool = False
    """A fetch rounds the fp32 master into compute-dtype bytes on the host's main thread
    (``fetch_host_bytes`` per element moved by the host's memory)."""
    on_disk: bool = False
    """Master and moments live in the NVMe file (nvme.py [Note: NVMe tier])."""

    def parts(self, setup: Setup, trainable: bool = True) -> list[Part]:
        """The tensors this home keeps for one chunk (those of zero bytes left out)."""
        return [p for p in self.parts_of(setup, trainable) if p.elem_bytes]

    def per_elem(self, setup: Setup, where: str, trainable: bool = True) -> int:
        """Bytes per element kept ``where``."""
        return sum(p.elem_bytes for p in self.parts(setup, trainable) if p.where == where)

    def nbytes(
        self,
        setup: Setup,
        where: str,
        chunk: int,
        own: int,
        trainable: bool = True,
        kind: str | None = None,
    ) -> int:
        """Bytes kept ``where`` for one chunk (``kind``: of that ledger kind only)."""
        return sum(
            p.nbytes(chunk, own)
            for p in self.parts(setup, trainable)
            if p.where == where and (kind is None or p.kind == kind)
        )

    def fetch_reads_disk(self, setup: Setup) -> bool:
        """Whether a fetch reads the fp32 master from the disk: a chunk on disk that is rounded
        from its master (no home), or any chunk on disk in fp32 (the home is the master)."""
        return self.on_disk and (self.fetch_rounds_master or setup.cb == 4)

    def fetch_disk_bytes(self) -> int:
        """Bytes per element a fetch that reads the disk reads: the fp32 master."""
        return 4 if self.on_disk else 0

    def fetch_host_bytes(self, setup: Setup) -> int:
        """Host memory traffic per element of a fetch's rounding: read fp32, write the compute
        dtype."""
        return 4 + setup.cb if self.fetch_rounds_master else 0

    def step_disk_bytes(self) -> tuple[int, int]:
        """Bytes per element a CPU step reads from and writes to the disk (master and moments)."""
        return (12, 12) if self.on_disk else (0, 0)

    def refusal(self, setup: Setup, cpu_adam: str) -> str | None:
        """Why a plan with this training setup cannot use the home, or None."""
        need = []
        if self.needs_16bit and setup.cb == 4:
            need.append("16-bit compute")
        if self.needs_accum_1 and setup.grad_accum != 1:
            need.append("grad_accum 1")
        if self.needs_during_backward and cpu_adam != "during_backward":
            need.append("schedule.cpu_adam 'during_backward'")
        return f"needs {', '.join(need)}" if need else None


PERSISTENT = Home("persistent", _persistent, offloaded=False, steps_on="device")
"""Always on the device: values, gradients, master and moments (fused device Adam); the first
n_persist chunks."""
HOST = Home("host", _host)
"""Fetched into a device buffer for its segments; its compute-dtype home, fp32 master and
moments in host memory, stepped by the CPU worker."""
HOMELESS = Home(
    "homeless",
    _homeless,
    needs_16bit=True,
    needs_accum_1=True,
    needs_during_backward=True,
    needs_trainable=True,
    uses_slots=True,
    fetch_rounds_master=True,
)
"""As host, but no compute-dtype home: each fetch rounds the master into a pinned slot
(chunks.py [Note: host slots])."""
DEVICE_HOMED = Home(
    "device_homed", _device_homed, steps_on="device", needs_accum_1=True, needs_during_backward=True
)
"""Fetched into a device buffer; this rank's shard of its fp32 master and moments stays on the
device, stepped there as its gradients complete (chunks.py [Note: device homes])."""
NVME = Home("nvme", _nvme, on_disk=True)
"""As host, with its fp32 master and moments in the NVMe file (nvme.py [Note: NVMe tier]); in
fp32 the home is the master, on the disk."""
NVME_HOMELESS = replace(HOMELESS, name="nvme_homeless", parts_of=_nvme_homeless, on_disk=True)
"""As homeless, with its fp32 master and moments in the NVMe file."""

HOMES: dict[str, Home] = {
    h.name: h for h in (PERSISTENT, HOST, HOMELESS, DEVICE_HOMED, NVME, NVME_HOMELESS)
}
"""Every home by name, in the order ``show`` lists them."""


# ------------------------------------------------------------------------ the policies


@dataclass(frozen=True)
class Policy:
    """What a block's saved activations do between its forward and its backward."""

    name: str
    letter: str
    """Its one-letter name in policy strips (``show``, ``diff``: ``SCCK``)."""
    held: str | None
    """The profile's bytes the block holds on the device after its forward: ``saved`` (all it
    saved), ``inputs`` (only its inputs), or None (nothing)."""
    moves: bool = False
    """Its saved bytes (``swapped``) go to the host after forward and come back before backward."""
    recomputes: bool = False
    """Its forward runs again in backward (its time, and its saved bytes at that moment)."""


KEEP = Policy("keep", "K", held="saved")
"""Saved activations stay on the device."""
SWAP = Policy("swap", "S", held=None, moves=True)
"""Saved activations go to host memory during forward and come back before the block's
backward."""
CHECKPOINT = Policy("checkpoint", "C", held="inputs", recomputes=True)
"""Only the block's inputs are kept; its forward is recomputed in backward."""

POLICIES: dict[str, Policy] = {p.name: p for p in (KEEP, SWAP, CHECKPOINT)}


def held_bytes(policy: str, saved: int, inputs: int) -> int:
    """Device bytes a block holds from its forward to its backward under ``policy``."""
    held = POLICIES[policy].held
    return saved if held == "saved" else inputs if held == "inputs" else 0


def homes_of(
    n_chunks: int,
    persistent: Iterable[int],
    homeless: Iterable[int] = (),
    device_homed: Iterable[int] = (),
    nvme: Iterable[int] = (),
    where: str = "",
) -> list[str]:
    """``placement.homes`` from chunk-id sets (the form of schema 6 and of the search's choice):
    ``homeless``, ``device_homed`` and ``nvme`` name offloaded chunks; a device-homed chunk is
    neither homeless nor on disk; a chunk on disk and homeless is ``nvme_homeless``. Sets that
    name no home are refused (``PlanError``, ``where`` before the message)."""
    sets = {
        "persistent": set(persistent),
        "homeless": set(homeless),
        "device_homed": set(device_homed),
        "nvme": set(nvme),
    }

    def refuse(key: str, what: str):
        raise PlanError(
            f"{where}{what} - at `$.placement.{key}`", "regenerate the plan with `protrain plan`"
        )

    for key, ids in sets.items():
        if bad := sorted(c for c in ids if not (isinstance(c, int) and 0 <= c < n_chunks)):
            refuse(key, f"chunk ids {bad} are out of range (0..{n_chunks - 1})")
    for key in ("homeless", "device_homed", "nvme"):
        if sets[key] & sets["persistent"]:
            refuse(key, f"chunks {sorted(sets[key] & sets['persistent'])} are not offloaded")
    for key in ("homeless", "nvme"):
        if sets["device_homed"] & sets[key]:
            refuse(
                "device_homed",
                f"chunks {sorted(sets['device_homed'] & sets[key])} are also in `{key}`: a "
                "device-homed chunk keeps nothing on the host",
            )

    def home(c: int) -> str:
        if c in sets["persistent"]:
            return PERSISTENT.name
        if c in sets["device_homed"]:
            return DEVICE_HOMED.name
        if c in sets["nvme"]:
            return (NVME_HOMELESS if c in sets["homeless"] else NVME).name
        return (HOMELESS if c in sets["homeless"] else HOST).name

    return [home(c) for c in range(n_chunks)]
