"""The Profile: everything the cost model needs about one (model, training shape, device).

Made once, planned from many times: ``protrain profile`` measures it on the device
(``planner/commands/measure.py``), ``planner/profiling/analytic.py`` estimates it from FLOP and byte
counts and a hardware spec. Both produce this one type, canonical JSON like plans.

Per segment (``<pre>``, each block, ``<post>``, as in the plan's schedule):

- ``fwd_us`` / ``bwd_us``: compute time of its forward and backward ([Note: robust
  timing] in commands/measure.py);
- ``saved_bytes``: activations it saves for backward, counted the way the
  executor's ledger counts them (each storage once, chunk parameters excluded,
  a storage saved by two segments belonging to the first): the cost model's
  memory walk then speaks the ledger's language;
- ``saved_tensor_bytes``: the same tensors without de-duplication, i.e. what a
  swap policy moves over the link (swap copies each saved tensor);
- ``input_bytes``: its input activation (what a checkpointed block keeps);
- ``fwd_peak_bytes`` / ``bwd_peak_bytes``: transient peak above the allocation at
  the segment's start (CUDA allocator; 0 on CPU, where no allocator is observable
  and the ledger does not count transients either).

Only msgspec and the plan contract are imported here: measuring runs the engine on a plan the
search emits, so it sits above both (``commands/measure.py``).
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from protrain.plans.errors import ProfileError
from protrain.plans.plan import Generator, canonical

from ..hardware.spec import HardwareSpec

PROFILE_VERSION = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


def generator() -> Generator:
    return Generator(name="protrain", version=_version())


@functools.cache
def _version() -> str:
    """The installed protrain's version, looked up once per process (a millisecond each time:
    ``protrain fit`` makes dozens of profiles and plans)."""
    try:
        return version("protrain")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ProfileModel(_Strict, kw_only=True):
    name: str
    """Model name (zoo name or label)."""
    fingerprint: str
    """Same hash as a plan's ``model.fingerprint``: profile and plan must agree."""
    n_params: NonNegInt
    """Unique parameter elements."""
    blocks: list[str]
    """Block module paths in execution order."""
    tied: list[list[str]]
    """``[name, alias]`` pairs of tied parameters."""


class ProfileTraining(_Strict, kw_only=True):
    micro_batch: PosInt
    """Sequences per micro-batch the profile was measured with."""
    seq_len: PosInt
    """Tokens per sequence."""
    compute_dtype: Literal["float32", "bfloat16", "float16"]
    """Dtype the model computed in."""


class SegmentProfile(_Strict, kw_only=True):
    segment: str
    """``<pre>``, a block path, or ``<post>``."""
    fwd_us: NonNegInt
    """Forward compute time: the least over measured iterations on CPU, the median on CUDA."""
    bwd_us: NonNegInt
    """Backward compute time (as ``fwd_us``)."""
    saved_bytes: NonNegInt
    """Saved activations, as the ledger counts them (see module docstring)."""
    saved_tensor_bytes: NonNegInt
    """Saved activations summed per tensor (what swap moves)."""
    input_bytes: NonNegInt
    """The segment's input activation."""
    fwd_peak_bytes: NonNegInt
    """Transient peak above the running allocation during forward."""
    bwd_peak_bytes: NonNegInt
    """Transient peak above the running allocation during backward."""


class ParamInfo(_Strict, kw_only=True, omit_defaults=True):
    name: str
    """Canonical parameter name (tied aliases are in ``model.tied``)."""
    shape: list[NonNegInt]
    dtype: str
    """Dtype as built (part of the fingerprint)."""
    uses: list[str]
    """Segments that use it, in execution order (the first is its first use)."""
    frozen: bool = False
    """It does not train (``requires_grad=False``; written only when true): the plan keeps
    no gradient, master or moments for a chunk of frozen parameters."""


class Profile(_Strict, kw_only=True):
    profile_version: int
    """Format version; ``load_profile`` refuses others."""
    source: Literal["measured", "analytic"]
    """Measured on a device, or estimated from a hardware spec."""
    generator: Generator = Generator()
    model: ProfileModel
    training: ProfileTraining
    device: str
    """Device the numbers describe (``cpu``, ``NVIDIA H200``, or ``analytic:<spec>``)."""
    attention: str
    """Attention kernel in use (SDPA backend), which sets activation sizes and times."""
    bootstrap: bool
    """True when the model was profiled through an all-offloaded executor plan (larger than the
    device)."""
    iterations: NonNegInt
    """Measured iterations the times come from (0 for analytic)."""
    segments: list[SegmentProfile]
    """``<pre>``, blocks in order, ``<post>``."""
    params: list[ParamInfo]
    """Every unique parameter, in first-use order."""
    hardware: HardwareSpec
    """The machine: link, optimizer and memory figures (measured or from a spec)."""


def dump_profile(profile: Profile) -> bytes:
    return canonical(profile)


def load_profile(source: str | Path | bytes) -> Profile:
    """Read and check a profile; any bad input raises ``ProfileError`` (never executes code)."""
    where = "<profile bytes>" if isinstance(source, bytes) else str(source)
    try:
        if isinstance(source, bytes):
            data = source
        else:
            with open(source, "rb") as f:
                data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(
            f"{where}: cannot read the profile ({e.strerror or e})",
            "make one with `protrain profile --model NAME …`",
        ) from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ProfileError(
            f"{where}: larger than {MAX_PROFILE_BYTES >> 20} MiB; no profile is that big",
            "check the path: is this a profile file?",
        )
    try:
        version = msgspec.json.decode(data, type=_Version).profile_version
        if version != PROFILE_VERSION:
            raise ProfileError(
                f"{where}: profile version {version}; this protrain reads {PROFILE_VERSION}",
                "re-run `protrain profile`",
            )
        profile = msgspec.json.decode(data, type=Profile)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise ProfileError(
            f"{where}: not a valid profile: {e}", "re-run `protrain profile`"
        ) from None
    expected = ["<pre>", *profile.model.blocks, "<post>"]
    if [s.segment for s in profile.segments] != expected:
        raise ProfileError(
            f"{where}: segments must be <pre>, the blocks in order, <post> - at `$.segments`",
            "re-run `protrain profile`",
        )
    return profile


MAX_PROFILE_BYTES = 64 << 20
"""Largest profile file ``load_profile`` reads (a 70B model's profile is ~50 kB)."""


class _Version(msgspec.Struct):
    profile_version: int
