"""Configuration → Plan: chunk list, placement, policies, and the event schedule.

The search (issue 5) decides *what* (chunk size, which chunks persist, buffer
count, policy per block); this module writes it down as a plan the executor can
replay without deciding anything. The schedule is derived here, once, by a fixed
rule, so two runs of the planner give the same bytes:

- **fetch**: each step fetches exactly the offloaded chunks its segment uses.
- **prefetch**: after the fetch, start loading the chunks the *next* segment uses,
  as far as the buffers allow (a one-segment lookahead, the paper's pipeline).
- **release / cache**: when a step ends, keep the chunks the next step will have
  (its fetch, then its prefetch), then fill the remaining buffers with resident
  chunks whose next use is soonest (Belady's rule over the forward-then-backward
  sequence); release the rest. So the last chunks of forward are still resident
  when backward starts, and re-fetching in backward happens only for chunks that
  did not fit, as the cost model assumes.
- **offload**: an offloaded chunk's gradients go to CPU at the end of its last
  backward segment. **swap_in**: a swapped block's activations start coming back one
  backward segment ahead of its own.
- **cpu_adam**: ``after_backward`` when the training needs every gradient before any
  update (gradient clipping was requested, or fp16 compute, whose loss scaler checks
  for overflow first), else ``during_backward`` (``cpu_adam_schedule``).
- **shard_persistent_states**: on whenever the world size is above 1 (it never costs
  memory or time in the cost model; ``cost.make_terms``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
from torch import nn

from protrain.executor.check import model_signature, tied_pairs
from protrain.plans import homes as H
from protrain.plans import plan as P
from protrain.plans import validation
from protrain.plans.errors import ConfigError

from ..profiling.graph import ExecutionGraph, trace
from ..profiling.profile import generator
from .layout import assign, layout_order
from .rules import HOST_SLOTS, ModelFacts, build_schedule, cpu_adam_schedule  # noqa: F401  (emit's API)


def model_facts(
    model: nn.Module,
    name: str,
    blocks: list[str],
    seq_len: int = 8,
    graph: ExecutionGraph | None = None,
) -> ModelFacts:
    """Trace ``model`` (may be on meta) and collect the facts ``assemble`` needs."""
    graph = graph or trace(model, blocks, seq_len=min(seq_len, 8))
    return ModelFacts(
        name=name,
        blocks=list(blocks),
        params=model_signature(model),
        tied=tied_pairs(model),
        segments=graph.segments,
        order=graph.order,
        uses=graph.uses,
        frozen=frozenset(n for n, p in model.named_parameters() if not p.requires_grad),
    )


def emit(
    model: nn.Module,
    *,
    name: str,
    blocks: list[str],
    training: P.Training,
    graph: ExecutionGraph | None = None,
    **config,
) -> P.Plan:
    """Write one configuration for a live (or meta) model down as a validated Plan.

    ``config`` is passed to ``assemble``: ``chunk_numel``, ``persistent``,
    ``n_buffer``, ``policies`` and the optional informational sections.
    """
    facts = model_facts(model, name, blocks, training.seq_len, graph)
    return assemble(facts, training=training, **config)


def assemble(
    facts: ModelFacts,
    *,
    training: P.Training,
    chunk_numel: int,
    persistent: Sequence[int],
    n_buffer: int,
    policies: Sequence[str],
    request: P.Request | None = None,
    hardware: P.Hardware | None = None,
    prediction: P.Prediction | None = None,
    provenance: P.Provenance | None = None,
    cpu_adam: P.CpuAdam | None = None,
    shard_persistent_states: bool | None = None,
    homeless: Sequence[int] = (),
    device_homed: Sequence[int] = (),
    nvme: Sequence[int] = (),
) -> P.Plan:
    """Lay out chunks, place them, derive the schedule; return the loaded-back Plan.

    ``persistent`` lists chunk ids kept on the device (any subset; the paper's
    configurations use the first ``n_persist``); ``policies`` gives
    ``keep``/``swap``/``checkpoint`` per block. ``cpu_adam`` defaults to
    ``cpu_adam_schedule`` of the compute dtype and the request's ``max_grad_norm``;
    ``shard_persistent_states`` to ``world_size > 1`` (sharding persistent chunks'
    optimizer states saves device memory and device Adam time for the same traffic:
    ``cost.make_terms``). ``homeless``: offloaded chunks that keep no home on the host
    (``placement.homeless``, with ``HOST_SLOTS`` slots). ``device_homed``: offloaded
    chunks whose master and moments stay on the device (``placement.device_homed``).
    ``nvme``: offloaded chunks whose master and moments live on disk (``placement.nvme``).
    """
    blocks = facts.blocks
    if len(policies) != len(blocks):
        raise ConfigError(f"{len(policies)} activation policies for {len(blocks)} blocks")
    for b, pol in zip(blocks, policies):
        if pol not in H.POLICIES:
            raise ConfigError(
                f"block {b!r}: unknown activation policy {pol!r}",
                f"use one of {', '.join(H.POLICIES)}",
            )
    for b in blocks:
        outside = [n for n in facts.uses[b] if not n.startswith(b + ".")]
        if outside:
            raise ConfigError(
                f"block {b!r} uses parameters outside it ({', '.join(outside[:3])}); "
                "plans describe such sharing only for the segments before and after the blocks",
                "choose block paths that contain all the parameters each block uses (`--blocks`)",
            )
    shape = {n: s for n, s, _ in facts.params}
    dtype = {n: d for n, _, d in facts.params}
    numel = {n: math.prod(s) for n, s in shape.items()}
    order, grp, fresh = layout_order(facts)
    slots = assign(order, numel, grp, chunk_numel, fresh)
    chunks = P.Chunks(
        chunk_numel=chunk_numel,
        items=[
            P.Chunk(
                id=i,
                params=[
                    P.Param(
                        name=s.name,
                        shape=list(shape[s.name]),
                        dtype=dtype[s.name],
                        offset=s.offset,
                        numel=s.numel,
                        frozen=s.name in facts.frozen,
                    )
                    for s in chunk
                ],
            )
            for i, chunk in enumerate(slots)
        ],
    )
    n_chunks = len(slots)
    bad = [c for c in persistent if not 0 <= c < n_chunks]
    if bad:
        raise ConfigError(
            f"persistent chunk ids {bad} are out of range (the layout has {n_chunks} chunks)"
        )
    persistent_ids = sorted(set(persistent))
    offloaded = [c for c in range(n_chunks) if c not in set(persistent_ids)]
    if not offloaded:
        n_buffer = 0  # nothing to buffer; a non-zero count would only mislead `show`

    owner = {s.name: i for i, chunk in enumerate(slots) for s in chunk}
    need = {s: {owner[n] for n in facts.uses[s]} for s in facts.segments}
    swapped = [b for b, pol in zip(blocks, policies) if H.POLICIES[pol].moves]
    if cpu_adam is None:
        cpu_adam = cpu_adam_schedule(
            training.compute_dtype, request.max_grad_norm if request else None
        )
    schedule = build_schedule(facts.segments, need, set(offloaded), n_buffer, swapped, cpu_adam)

    plan = P.Plan(
        schema_version=P.SCHEMA_VERSION,
        generator=generator(),
        request=request or P.Request(),
        model=P.Model(
            name=facts.name,
            fingerprint=P.fingerprint(facts.params, blocks),
            n_params=sum(numel.values()),
            blocks=list(blocks),
            pre_block_params=list(facts.uses[P.PRE]),
            post_block_params=list(facts.uses[P.POST]),
            tied=[list(p) for p in facts.tied],
        ),
        training=training,
        hardware=hardware or P.Hardware(),
        chunks=chunks,
        placement=P.Placement(
            n_persist=len(persistent_ids),
            n_buffer=n_buffer,
            homes=P.homes_of(n_chunks, persistent_ids, homeless, device_homed, nvme),
            shard_persistent_states=(
                training.world_size > 1
                if shard_persistent_states is None
                else shard_persistent_states
            ),
            n_host_slots=HOST_SLOTS if homeless else 0,
        ),
        activations=[P.Activation(block=b, policy=pol) for b, pol in zip(blocks, policies)],
        schedule=schedule,
        prediction=prediction or P.Prediction(),
        provenance=provenance or P.Provenance(),
    )
    # Return exactly what a reader of the file gets: the round trip type-checks every
    # field (Struct constructors do not) and runs the structural checks.
    return round_trip(plan)


def round_trip(plan: P.Plan) -> P.Plan:
    """``plans.load(P.dump(plan))``, through msgspec's compact JSON instead of the file's layout
    (which costs more than the checks): the same bytes decode to the same Plan once the plan's
    one float, ``request.max_grad_norm``, is rounded as ``P.dump`` rounds floats (tests/test_emit.py
    holds the schema to that one float, and the two round trips equal)."""
    req = plan.request
    if isinstance(req.max_grad_norm, float):
        plan = msgspec.structs.replace(
            plan,
            request=msgspec.structs.replace(
                req, max_grad_norm=round(req.max_grad_norm, P.FLOAT_DIGITS)
            ),
        )
    checked = P.decode(msgspec.json.encode(plan, order="deterministic"), encoded=True)
    validation.validate(checked, "<plan bytes>")
    return checked
