"""THE plan file format: msgspec Structs, ``load`` and canonical ``dump``.

A plan is the planner's whole decision for one (model, training shape, hardware,
budget): the chunk layout, which chunks stay on the device, how many device buffers
the offloaded chunks share, each block's activation policy, and the event list the
executor replays at every block boundary. The Structs below declare the file
top-down in the order it is written; their attribute docstrings are the format's
documentation (README and DESIGN link here).

Two kinds of sections:

- ``Binding`` sections are what the executor acts on (``model``, ``training``,
  ``chunks``, ``placement``, ``activations``, ``schedule``). Unknown fields are an
  error: an executor that ignored a binding field it does not know would run a
  different plan from the one that was made.
- ``Info`` sections are diagnostics (``generator``, ``request``, ``hardware``,
  ``prediction``, ``provenance``). Unknown fields are ignored, so new diagnostics
  can be added without a version bump; new fields there must have defaults.

Segments. A model's forward runs as ``["<pre>", *model.blocks, "<post>"]``: the
``<pre>`` segment is everything before the first block (embeddings), ``<post>``
everything after the last one (final norm, head, loss). Backward runs the same
segments in reverse. ``schedule.forward`` and ``schedule.backward`` hold one
``Step`` per segment in that order, and ``Step`` says which chunks to fetch
(blocking), prefetch (asynchronous) and release around it. See
``simulate_residency`` for the exact replay rules the executor follows.

Version history (bump on any binding change; ship a migration in ``migrate.py``, a
frozen fixture under ``tests/fixtures/plans/v<old>/`` and a line here):

- 1: first version.
- 2: ``schedule.cpu_adam`` (binding): when offloaded chunks' CPU AdamW steps start.
  The v1 executor decided it at run time (after backward with clipping or fp16,
  during it otherwise), so a plan could not say which schedule it was predicted
  for. ``migrate.v1_to_v2`` fills it the way the v1 executor ran without clipping.
- 3: ``placement.shard_persistent_states`` (binding): under ZeRO-3 each rank keeps the
  fp32 master and Adam moments of only its shard of every persistent chunk. The v2
  executor replicated them on every rank; ``migrate.v2_to_v3`` writes ``false``.
- 4: ``placement.homeless`` and ``placement.n_host_slots`` (binding): offloaded chunks
  that keep no compute-dtype home on the host (12 B per element instead of 14), and the
  pinned slots their uploads and gradients pass through. The v3 executor kept every
  home; ``migrate.v3_to_v4`` writes ``[]`` and ``0``.
- 5: ``placement.device_homed`` (binding): offloaded chunks whose fp32 master and Adam
  moments (this rank's shard) live on the device instead of the host, stepped on the
  device as their gradients complete. The v4 executor kept them all on the host;
  ``migrate.v4_to_v5`` writes ``[]``.
- 6: ``placement.nvme`` (binding): offloaded chunks whose fp32 master and Adam moments
  live in a file on disk (executor/nvme.py), mapped into host memory a piece at a time.
  The v5 executor kept them in host memory; ``migrate.v5_to_v6`` writes ``[]``.
- 7: ``placement.homes`` (binding) replaces ``persistent``, ``offloaded``, ``homeless``,
  ``device_homed`` and ``nvme``: one home per chunk, named as in plans/homes.py, instead
  of five overlapping id lists (a chunk both homeless and on disk is ``nvme_homeless``).
  ``migrate.v6_to_v7`` rewrites the lists; no decision changes.
- 8: ``Param.frozen`` (binding): parameters that do not train (``requires_grad=False``, a
  LoRA model's base): a chunk of frozen parameters only keeps its values, no gradients,
  master or moments (plans/homes.py), and the executor refuses to train a parameter
  its plan says is frozen. Written only where true, so a plan for full training reads as
  schema 7's did; ``migrate.v7_to_v8`` changes nothing (old plans: everything trains).

Only the standard library and msgspec are imported here, so ``protrain show``,
``diff`` and ``validate`` never import torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Literal, get_args

import msgspec

from .errors import PlanError
from .homes import HOMES, Home, homes_of  # noqa: F401  (re-exported: the placement of chunk-id sets)
from .migrate import REGENERATE, SCHEMA_VERSION, migrate

# SCHEMA_VERSION (the version ``dump`` writes) is one past the last migration (migrate.py).

MIN_SCHEMA_VERSION = 1
"""The oldest version ``load`` reads (older files must be regenerated)."""

MAX_PLAN_BYTES = 64 << 20
"""Largest plan file ``load`` reads. A 70B model's plan is ~0.2 MB; the cap stops a
hostile or mistaken file (a checkpoint passed as a plan) before it is read whole."""

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
DType = Literal["float32", "bfloat16", "float16"]
Policy = Literal["keep", "swap", "checkpoint"]
CpuAdam = Literal["during_backward", "after_backward"]
HomeName = Literal["persistent", "host", "homeless", "device_homed", "nvme", "nvme_homeless"]
"""A chunk's home (plans/homes.py ``HOMES``; adding one bumps the schema)."""


class Binding(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A section the executor acts on. Unknown fields are an error."""


class Info(msgspec.Struct, frozen=True, kw_only=True):
    """A diagnostic section. Unknown fields are ignored (added without a version bump)."""


# --------------------------------------------------------------------------- info


class Generator(Info):
    name: str = "protrain"
    """The program that wrote the plan."""
    version: str = ""
    """Its version (informational: plans are compared by content, not by generator)."""


class Request(Info):
    """What the planner was asked, stored verbatim so a plan says what it answers."""

    model: str = ""
    """Model name as given to the planner (zoo name, config path or user label)."""
    hardware: str = ""
    """Hardware spec name the plan was made for."""
    budget_bytes: NonNegInt = 0
    """Device memory budget the plan had to fit (per rank)."""
    micro_batch: NonNegInt = 0
    """Sequences per micro-batch per rank."""
    seq_len: NonNegInt = 0
    """Tokens per sequence."""
    compute_dtype: str = ""
    """Requested compute dtype."""
    world_size: NonNegInt = 0
    """Requested number of ranks."""
    grad_accum: NonNegInt = 0
    """Requested micro-batches per optimizer step."""
    max_grad_norm: float | None = None
    """Requested global-norm gradient clipping (``protrain plan --max-grad-norm``); None: none.
    It is why ``schedule.cpu_adam`` is ``after_backward``: the training run passes the norm
    itself (``protrain train --max-grad-norm``)."""


class Hardware(Info):
    """The hardware the plan was made for, as the planner saw it."""

    name: str = ""
    """Spec name (``plans/hardware/<name>.json``) or the probed device's name."""
    device_memory_bytes: NonNegInt = 0
    """Total device memory."""
    budget_bytes: NonNegInt = 0
    """Device memory the plan may use (per rank)."""
    h2d_bytes_per_s: NonNegInt = 0
    """Host-to-device bandwidth for chunk-sized pinned copies."""
    d2h_bytes_per_s: NonNegInt = 0
    """Device-to-host bandwidth for chunk-sized pinned copies."""
    cpu_adam_params_per_s: NonNegInt = 0
    """CPU AdamW throughput (fp32 parameters updated per second)."""
    dev_adam_params_per_s: NonNegInt = 0
    """Device Adam throughput (fp32 parameters updated per second)."""


# ------------------------------------------------------------------------ binding


class Model(Binding):
    """Identity of the model the plan was made for; checked against the live model."""

    name: str
    """Model name (zoo name or user label); informational, the fingerprint is what is checked."""
    fingerprint: str
    """``sha256:`` of the sorted (name, shape, dtype) parameter list plus the block list."""
    n_params: NonNegInt
    """Number of unique parameter elements (tied parameters counted once)."""
    blocks: list[str]
    """Module paths of the transformer blocks, in execution order."""
    pre_block_params: list[str]
    """Parameters used before the first block (segment ``<pre>``), e.g. embeddings."""
    post_block_params: list[str]
    """Parameters used after the last block (segment ``<post>``), e.g. final norm, head."""
    tied: list[list[str]]
    """Tied parameters as ``[name, alias]`` pairs: ``name`` is in a chunk, ``alias`` is the same
    tensor."""


class Training(Binding):
    """The training shape the plan was made for."""

    micro_batch: PosInt
    """Sequences per micro-batch per rank."""
    seq_len: PosInt
    """Tokens per sequence."""
    compute_dtype: DType
    """Dtype of the chunks (parameters and gradients as the model computes with them)."""
    master_dtype: Literal["float32"]
    """Dtype of the optimizer's master weights and Adam moments."""
    world_size: PosInt
    """Number of ranks that replay this plan."""
    grad_accum: PosInt
    """Micro-batches per optimizer step."""


class Param(Binding, omit_defaults=True):
    """One parameter's place in its chunk (one line in the file)."""

    name: str
    """Fully qualified name, as in ``model.named_parameters()``."""
    shape: list[NonNegInt]
    """Shape of the parameter."""
    dtype: str
    """Dtype of the parameter as the model was built (``float32``), part of the fingerprint."""
    offset: NonNegInt
    """Element offset of the parameter inside its chunk."""
    numel: NonNegInt
    """Number of elements (the product of ``shape``)."""
    frozen: bool = False
    """The parameter does not train (written only when true): the plan provisions no
    gradient, master or moments for a chunk whose parameters are all frozen, and the
    executor refuses a model that trains it (schema 8)."""


class Chunk(Binding):
    """A fixed-size flat buffer holding parameters in execution order."""

    id: NonNegInt
    """Index of the chunk in execution order (chunk ``i`` is ``chunks.list[i]``)."""
    params: list[Param]
    """Parameters in the chunk, in execution order, non-overlapping."""


class Chunks(Binding):
    """The chunk layout."""

    chunk_numel: PosInt
    """Elements per chunk (every chunk has this capacity; the last may be partly empty)."""
    items: list[Chunk] = msgspec.field(name="list")
    """The chunks, in execution order."""


def _ids_whose_home(test: Callable[[Home], bool]) -> property:
    """A read-only property of ``Placement``: the ids of the chunks whose home passes ``test``,
    ascending."""
    return property(lambda self: [i for i, h in enumerate(self.homes) if test(HOMES[h])])


class Placement(Binding):
    """Where each chunk lives: one home per chunk (plans/homes.py declares each)."""

    n_persist: NonNegInt
    """Number of persistent chunks (always on the device, optimizer on the device)."""
    n_buffer: NonNegInt
    """Device buffers shared by offloaded chunks: at most this many are on the device at once."""
    homes: list[HomeName]
    """The home of each chunk, in chunk order (``homes[i]`` is chunk ``i``'s), by its name in
    plans/homes.py's table: ``persistent`` (values, gradients, master and moments on the
    device), ``host`` (fetched into a device buffer for its segments, released after; its
    compute-dtype home, fp32 master and moments on the host, stepped by CPU AdamW),
    ``homeless`` (as ``host`` with no compute-dtype home: each fetch rounds the fp32 master
    into a pinned slot, and its gradients land in a slot until the CPU step has read them;
    16-bit compute, ``grad_accum`` 1 and ``schedule.cpu_adam = during_backward`` only, and
    trainable chunks only: chunks.py [Note: host slots]), ``device_homed`` (this rank's shard
    of the fp32 master and moments stays on the device, stepped there as its gradients
    complete in backward; ``grad_accum`` 1 and ``during_backward`` only; a frozen one keeps
    its values' shard on the device: chunks.py [Note: device homes]), ``nvme`` (as ``host``
    with the fp32 master and moments in a file on disk, mapped a piece at a time; in fp32
    the home is the master and is there too; a frozen one's values stay in host memory:
    nvme.py [Note: NVMe tier]; the directory is named at run time, ``protrain train --nvme
    DIR``) and ``nvme_homeless`` (as ``homeless``, with master and moments on disk)."""
    shard_persistent_states: bool
    """World size > 1 only: each rank keeps the fp32 master and Adam moments of only its
    shard of every trainable persistent chunk (values and gradients stay whole on every
    rank); gradients are reduce-scattered instead of all-reduced, each rank steps its
    shard and the updated values are all-gathered. ``false``: replicated on every rank
    (executor/dist.py [Note: sharding])."""
    n_host_slots: NonNegInt = 0
    """Pinned compute-dtype slots of one chunk shard each, shared by the homeless chunks'
    uploads and gradients; 0 exactly when no chunk is homeless."""

    # Chunk ids by what their home is (homes.HOMES' attributes), ascending: derived from
    # ``homes``, not fields of the file.

    persistent = _ids_whose_home(lambda h: not h.offloaded)
    """Chunks always on the device (not fetched: ``persistent``)."""
    offloaded = _ids_whose_home(lambda h: h.offloaded)
    """Every chunk fetched into the shared buffers (every home but ``persistent``)."""
    homeless = _ids_whose_home(lambda h: h.fetch_rounds_master)
    """Chunks with no compute-dtype home: each fetch rounds the master (``homeless``,
    ``nvme_homeless``)."""
    device_homed = _ids_whose_home(lambda h: h.offloaded and h.steps_on == "device")
    """Offloaded chunks whose master and moments live (and step) on the device."""
    nvme = _ids_whose_home(lambda h: h.on_disk)
    """Chunks whose master and moments live on disk (``nvme``, ``nvme_homeless``)."""


class Activation(Binding):
    """Activation policy of one block."""

    block: str
    """Module path of the block."""
    policy: Policy
    """``keep`` saved activations on the device, ``swap`` them to CPU memory during
    forward and back before the block's backward, or ``checkpoint`` (drop them and
    recompute the block's forward in backward)."""


class Step(Binding):
    """The events around one segment of forward or backward (chunk ids are offloaded chunks)."""

    segment: str
    """``<pre>``, a block's module path, or ``<post>``."""
    fetch: list[NonNegInt] = []
    """Chunks that must be resident before the segment runs; waits for in-flight prefetches."""
    prefetch: list[NonNegInt] = []
    """Chunks to start loading after ``fetch``, to overlap with this segment's compute."""
    release: list[NonNegInt] = []
    """Chunks whose device buffers are freed when the segment ends."""
    offload: list[NonNegInt] = []
    """Backward only: chunks whose gradients are complete when the segment ends; they go
    to CPU memory and their CPU optimizer step starts."""
    swap_in: list[str] = []
    """Backward only: blocks whose swapped activations start coming back when the segment starts."""


class Schedule(Binding):
    """Per-segment events, replayed identically on every rank and every iteration."""

    forward: list[Step]
    """One step per segment: ``<pre>``, blocks in order, ``<post>``."""
    backward: list[Step]
    """One step per segment in reverse: ``<post>``, blocks reversed, ``<pre>``."""
    cpu_adam: CpuAdam
    """When offloaded chunks' CPU AdamW steps start, in the last micro-batch of a step.
    ``during_backward``: each as soon as its gradients reach the host (at its ``offload``),
    overlapping the rest of backward. ``after_backward``: all after backward ends, in
    offload order; needed by global-norm gradient clipping and by fp16 loss scaling's
    overflow check, which need every gradient before any parameter changes."""


# ------------------------------------------------------------------------ info (2)


class Prediction(Info):
    """What the planner's cost model predicts for this plan."""

    iter_time_us: NonNegInt = 0
    """Predicted time of one iteration (forward, backward, optimizer)."""
    peak_memory_bytes: NonNegInt = 0
    """Predicted peak device memory per rank."""
    breakdown: dict[str, int] = {}
    """Named terms of the prediction (bytes or microseconds, as each name says)."""


class Candidate(Info):
    """One configuration the search evaluated (for ``protrain explain``)."""

    n_persist: NonNegInt = 0
    n_buffer: NonNegInt = 0
    n_swap: NonNegInt = 0
    n_checkpoint: NonNegInt = 0
    iter_time_us: NonNegInt = 0
    """Predicted iteration time."""
    peak_memory_bytes: NonNegInt = 0
    """Predicted peak device memory."""


class Search(Info):
    space_size: NonNegInt = 0
    """Number of configurations in the search space."""
    evaluated: NonNegInt = 0
    """Number of configurations whose cost was evaluated (the rest were pruned)."""
    time_us: NonNegInt = 0
    """Always 0 in files: wall time differs between runs and plans must be byte-identical
    when replanned (``protrain plan`` prints it instead)."""
    solver: str = ""
    """Which search produced the plan."""
    chosen: Candidate = Candidate()
    """The configuration this plan carries out."""
    runners_up: list[Candidate] = []
    """The next-best feasible configurations, best first."""
    front: list[Candidate] = []
    """Pareto front of (predicted time, predicted peak) over the evaluated space (at most 24
    points)."""


class Provenance(Info):
    profile_digest: str = ""
    """``sha256:`` of the profile the plan was made from (empty for hand-made plans)."""
    search: Search = Search()
    """How the configuration was found."""


class Plan(Binding, kw_only=True):
    """A whole plan file."""

    schema_version: int
    """Always the first key; ``load`` checks it against the supported window first."""
    generator: Generator = Generator()
    request: Request = Request()
    model: Model
    training: Training
    hardware: Hardware = Hardware()
    chunks: Chunks
    placement: Placement
    activations: list[Activation]
    """One entry per block, in ``model.blocks`` order."""
    schedule: Schedule
    prediction: Prediction = Prediction()
    provenance: Provenance = Provenance()


# --------------------------------------------------------------------------- identity

PRE = "<pre>"
"""Segment name of everything the model runs before its first block."""

POST = "<post>"
"""Segment name of everything the model runs after its last block (head and loss)."""


def fingerprint(params: Iterable[tuple[str, Sequence[int], str]], blocks: Sequence[str]) -> str:
    """Hash of the sorted (name, shape, dtype) list plus the block list.

    The executor computes it from the live model (``check.py``) and refuses a plan
    whose fingerprint differs. Canonical JSON keeps it identical on every machine.
    """
    entries = sorted([name, [int(s) for s in shape], str(dtype)] for name, shape, dtype in params)
    payload = json.dumps({"params": entries, "blocks": list(blocks)}, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def plan_fingerprint(plan: Plan) -> str:
    """The fingerprint recomputed from the parameters listed in the plan's chunks."""
    params = [(p.name, p.shape, p.dtype) for c in plan.chunks.items for p in c.params]
    return fingerprint(params, plan.model.blocks)


def segments(plan: Plan) -> list[str]:
    """Forward segment order: ``<pre>``, the blocks, ``<post>``."""
    return [PRE, *plan.model.blocks, POST]


_CHOICES = {".homes[": HomeName, ".policy": Policy, "_dtype": DType, ".cpu_adam": CpuAdam}
"""Literal fields by a piece of their JSON path: an invalid value's error lists the valid ones."""


def _choices(error: str) -> str:
    """`` (expected one of ...)`` for msgspec's "Invalid enum value" error at a Literal field."""
    if not error.startswith("Invalid enum value"):
        return ""
    path = error.rpartition(" - at ")[2]
    kind = next((t for key, t in _CHOICES.items() if key in path), None)
    return f" (expected one of: {', '.join(get_args(kind))})" if kind else ""


class _Header(msgspec.Struct):
    """Decodes only ``schema_version``; msgspec skips every other key."""

    schema_version: int


# ---------------------------------------------------------------------- dump


def dump(plan: Plan) -> bytes:
    """Canonical bytes: fixed key order, 2-space indent, one parameter per line, trailing newline.

    Key order is the Struct definition order (``schema_version`` first); dict keys
    are sorted. A container whose children are all scalars goes on one line, so each
    parameter and each event list is one line and ``git diff`` shows one decision per
    line. Same plan → same bytes, on any machine.
    """
    return canonical(plan)


def canonical(obj: msgspec.Struct | list) -> bytes:
    """Canonical JSON bytes of any Struct (or list of them), in the plan file's layout (profiles and
    specs use it too, and ``engine.agreement`` digests a plan's binding sections with it)."""
    return (_emit(msgspec.to_builtins(obj, order="deterministic"), 0) + "\n").encode()


FLOAT_DIGITS = 6
"""Decimal places a float keeps in the file (``dump``): machine noise never reaches it."""


def _emit(value: object, depth: int) -> str:
    # depth 0 is the plan object and depth 1 its sections: those always span lines, so
    # every section starts on a line of its own. Deeper containers whose children are
    # all scalars (or flat lists of scalars, like a shape) go on one line.
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        if depth >= 2 and all(_is_flat(v) for v in value.values()):
            if all(k.isascii() for k in value) and not any(
                isinstance(v, float) or isinstance(v, list) and any(isinstance(x, float) for x in v)
                for v in value.values()
            ):  # what the items below give, in one call (no floats to round)
                return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
            return (
                "{"
                + ", ".join(f"{json.dumps(k)}: {_emit(v, depth + 1)}" for k, v in value.items())
                + "}"
            )
        items = [f"{json.dumps(k)}: {_emit(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(inner + i for i in items) + "\n" + pad + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        if all(not isinstance(v, (list, dict)) for v in value):
            if not any(
                isinstance(v, float) for v in value
            ):  # what the items below give, in one call
                return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
            return "[" + ", ".join(_emit(v, depth + 1) for v in value) + "]"
        return "[\n" + ",\n".join(inner + _emit(v, depth + 1) for v in value) + "\n" + pad + "]"
    if isinstance(value, float):
        # Informational sections only (binding sections hold integers). Round so that
        # float noise from different machines never reaches the file.
        return repr(round(value, FLOAT_DIGITS))
    return json.dumps(value, ensure_ascii=False)


def _is_flat(value: object) -> bool:
    """A scalar, or a list of scalars (so a Param with its shape still fits one line)."""
    if isinstance(value, list):
        return all(not isinstance(v, (list, dict)) for v in value)
    return not isinstance(value, dict)


# ---------------------------------------------------------------------- load


def decode(data: bytes, where: str = "<plan bytes>", *, encoded: bool = False) -> Plan:
    """Decode a plan's bytes: header → version window → migrate → strict decode.

    The structural checks (``validation.validate``) come after, in ``reader.load``: this
    module is the schema, below the checks that read it. Raises ``PlanError`` naming
    ``where``, the JSON path and the fix. Decoding never executes code.
    ``encoded``: the bytes are ``msgspec.json.encode`` of a Plan (the planner's round trip), so
    the duplicate-key scan, most of a decode's time, is left out.
    """
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(
            f"{where}: not UTF-8 text (byte {e.start}); a plan is a JSON file", REGENERATE
        ) from None
    try:
        header = msgspec.json.decode(data, type=_Header)
    except RecursionError:  # msgspec's guard against deeply nested documents
        raise PlanError(f"{where}: JSON nested too deeply; no plan is", REGENERATE) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise PlanError(
            f"{where}: not a protrain plan: {e}",
            "a plan is a JSON object whose first key is `schema_version`; regenerate it with "
            "`protrain plan`",
        ) from None
    if not encoded:  # (bytes msgspec encoded from a Plan cannot repeat a key)
        _refuse_duplicate_keys(data, where)
    version, newer = header.schema_version, header.schema_version > SCHEMA_VERSION
    if newer or version < MIN_SCHEMA_VERSION:
        raise PlanError(
            f"{where}: plan schema {version} is {'newer' if newer else 'older'} than this protrain "
            f"reads ({MIN_SCHEMA_VERSION}–{SCHEMA_VERSION}) - at `$.schema_version`",
            "upgrade protrain, or regenerate the plan with this version's `protrain plan`"
            if newer
            else REGENERATE,
        )
    if version < SCHEMA_VERSION:
        try:
            data = msgspec.json.encode(migrate(msgspec.json.decode(data), version))
        except PlanError as e:
            raise PlanError(f"{where}: {e.message}", e.hint) from None
    try:
        plan = msgspec.json.decode(data, type=Plan)
    except msgspec.ValidationError as e:
        raise PlanError(
            f"{where}: {e}{_choices(str(e))}", f"fix that field, or {REGENERATE}"
        ) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise PlanError(f"{where}: malformed JSON: {e}", REGENERATE) from None
    return plan


def _refuse_duplicate_keys(data: bytes, where: str) -> None:
    """Refuse a JSON object that repeats a key, naming its JSON path (msgspec, like ``json``,
    keeps the last value silently: ``"micro_batch": 4, "micro_batch": 100000`` would train the
    second). A pre-scan with the standard library, after msgspec has parsed the document (so
    it is well-formed and not nested past msgspec's limit). Issue 39 item 8."""

    class Obj(dict):
        dup: str | None = None

    def pairs(items: list) -> Obj:
        obj = Obj()
        for k, v in items:
            if k in obj and obj.dup is None:
                obj.dup = k
            obj[k] = v
        return obj

    try:
        doc = json.loads(data, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return  # msgspec's decode reports what is wrong with it
    stack: list[tuple[object, str]] = [(doc, "$")]
    while stack:  # (depth-first, in document order: the first duplicate is named)
        value, path = stack.pop()
        if isinstance(value, Obj):
            if value.dup is not None:
                raise PlanError(
                    f"{where}: key {value.dup!r} appears twice in one object - at "
                    f"`{path}.{value.dup}`; which value was meant is unknown",
                    f"remove one of them, or {REGENERATE}",
                )
            stack.extend((v, f"{path}.{k}") for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
