"""``protrain diff``: a semantic diff of two plans (placement, policy strips, schedule,
predicted speed and memory), as text and as JSON.

Reads ``Plan`` Structs only; never imports torch or numpy (it runs as a ``git diff``
text converter).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protrain.plans.homes import POLICIES
from protrain.plans.plan import Generator, Plan, Provenance, dump

from ..hardware.units import human_bytes, human_count
from .show import policy_strip

# ------------------------------------------------------------------------ diff
#
# [Note: when `protrain diff` calls two plans equal]
# Two plans are equal when their canonical bytes (``dump``) are identical once the
# ``generator`` and ``provenance`` sections are blanked in both. Those two say who
# wrote the plan and how the search found it, not what the plan is: two protrain
# versions, or two solvers, that reach the same decisions and predictions for the
# same request and hardware give equal plans. Every other section counts, the
# informational ``request``, ``hardware`` and ``prediction`` included: a plan made
# for another card or budget, or predicting another time, is a different plan even
# where the executor would replay it the same way. Differences in ``generator`` and
# ``provenance`` are still reported, under "informational". The CLI exits 0 when
# equal and 1 when not, like diff(1).

DIFF_LIST = 10
"""Parameters (moved, added, removed) named in the text before "… and N more" (the JSON has them
all)."""
DIFF_STEPS = 6
"""Schedule changes shown in the text (the JSON has them all)."""
STRIP_WRAP = 40
"""Blocks per line of the two policy strips."""
EVENTS = ("fetch", "prefetch", "release", "offload", "swap_in")
"""The ``Step`` fields compared, in file order."""


def diff_json(a: Plan, b: Plan) -> dict[str, Any]:
    """The semantic difference of two plans as JSON builtins, keys in a fixed order.

    Every key is always present (so scripts need no ``get``): ``equal`` (see
    [Note: when `protrain diff` calls two plans equal]), ``differs`` (names of the
    sections that differ), then one entry per section. ``{"a": …, "b": …}`` pairs
    carry both sides; ``changed`` dicts list only the fields that differ, in the
    order the schema declares them. Floats are rounded to 4 places.
    """
    d: dict[str, Any] = {
        "equal": _core(a) == _core(b),
        "differs": [],
        "schema_version": _pair(a.schema_version, b.schema_version),
        "model": _diff_model(a, b),
        "training": _changed(a.training, b.training),
        "request": _changed(a.request, b.request),
        "hardware": _changed(a.hardware, b.hardware),
        "chunks": _diff_chunks(a, b),
        "placement": _diff_placement(a, b),
        "activations": _diff_activations(a, b),
        "schedule": _diff_schedule(a, b),
        "prediction": _diff_prediction(a, b),
        "informational": {
            "generator": _changed(a.generator, b.generator),
            "provenance": _changed(a.provenance, b.provenance, skip=("search",)),
            "search": _changed(a.provenance.search, b.provenance.search),
        },
    }
    differs = [
        k
        for k in (
            "schema_version",
            "model",
            "training",
            "request",
            "hardware",
            "chunks",
            "placement",
            "activations",
            "schedule",
            "prediction",
        )
        if _section_differs(k, d[k])
    ]
    if not d["equal"] and not differs:
        # The bytes differ in something no section above compares (e.g. the order in
        # which a chunk lists parameters at unchanged offsets); never call that equal.
        differs = ["other"]
    d["differs"] = differs
    return d


def render_diff(a: Plan, b: Plan, a_name: str = "A", b_name: str = "B") -> tuple[str, bool]:
    """Text of ``protrain diff A B`` and whether the plans are equal (the CLI's exit status)."""
    d = diff_json(a, b)
    m = d["model"]
    lines = [f"diff  A  {a_name}", f"      B  {b_name}"]
    if d["equal"]:
        lines.append("  plans are equal (same decisions and predictions)")
        lines.append(f"  model         {_model_line(m['a'])}")
        pa = d["prediction"]["a"]
        if pa["iter_time_us"] is not None:
            lines.append(
                f"  predicted     {pa['iter_time_us'] / 1e6:.3f} s/iteration, "
                f"peak {human_bytes(pa['peak_memory_bytes'])}"
            )
        lines += _render_info(d["informational"])
        return "\n".join(lines), True

    lines.append(f"  plans differ in: {', '.join(d['differs'])}")
    if not m["same_model"]:
        lines += [
            f"  !! DIFFERENT MODELS: A is {_model_line(m['a'])}, {_short(m['a']['fingerprint'])}",
            f"  !!                   B is {_model_line(m['b'])}, {_short(m['b']['fingerprint'])}",
            "  !! parameters are matched by name, blocks by position, chunk ids by number only",
        ]
    sv = d["schema_version"]
    if sv["a"] != sv["b"]:
        lines.append(f"  schema        v{sv['a']} → v{sv['b']}")
    lines += _render_model(m)
    for key in ("training", "request", "hardware"):
        ch = [
            f"{f} {_fmt(f, v['a'], key)} → {_fmt(f, v['b'], key)}" for f, v in d[key].items()
        ] or ["same"]
        lines += [f"  {key:<13} {ch[0]}", *(" " * 16 + x for x in ch[1:])]  # one field per line
    lines += _render_chunks(d["chunks"])
    lines += _render_placement(d["placement"])
    lines += _render_activations(d["activations"])
    lines += _render_schedule(d["schedule"], d["chunks"], m["same_model"])
    lines += _render_prediction(d["prediction"])
    lines += _render_info(d["informational"])
    return "\n".join(lines), False


# ---------------------------------------------------------------- diff: facts


def _core(plan: Plan) -> bytes:
    """Canonical bytes without who wrote the plan and how it was found (the equality key)."""
    return dump(msgspec.structs.replace(plan, generator=Generator(), provenance=Provenance()))


def _pair(a: Any, b: Any) -> dict[str, Any]:
    return {"a": a, "b": b}


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, order="deterministic")


def _changed(a: msgspec.Struct, b: msgspec.Struct, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field → ``{"a", "b"}`` for each field of two Structs of one type that differs."""
    return {
        f: _pair(_builtins(getattr(a, f)), _builtins(getattr(b, f)))
        for f in a.__struct_fields__
        if f not in skip and getattr(a, f) != getattr(b, f)
    }


def _section_differs(key: str, value: Any) -> bool:
    if key == "schema_version":
        return value["a"] != value["b"]
    if key == "model":
        return bool(value["changed"])
    if key == "chunks":
        return (
            value["chunk_numel"]["a"] != value["chunk_numel"]["b"]
            or value["n_chunks"]["a"] != value["n_chunks"]["b"]
            or any(value[k] for k in ("moved", "added", "removed", "reshaped"))
        )
    if key == "placement":
        return (
            value["n_persist"]["a"] != value["n_persist"]["b"]
            or value["n_buffer"]["a"] != value["n_buffer"]["b"]
            or value["shard_persistent_states"]["a"] != value["shard_persistent_states"]["b"]
            or bool(value["to_offloaded"] or value["to_persistent"])
        )
    if key == "activations":
        return bool(value["changed"])
    if key == "schedule":
        return value["steps_differ"] > 0 or value["cpu_adam"]["a"] != value["cpu_adam"]["b"]
    if key == "prediction":
        return value["a"] != value["b"] or bool(value["breakdown"])
    return bool(value)  # training, request, hardware: the changed fields


def _diff_model(a: Plan, b: Plan) -> dict[str, Any]:
    def ident(p: Plan) -> dict[str, Any]:
        return {
            "name": p.model.name,
            "fingerprint": p.model.fingerprint,
            "n_params": p.model.n_params,
            "n_blocks": len(p.model.blocks),
        }

    return {
        "same_model": a.model.fingerprint == b.model.fingerprint,
        "a": ident(a),
        "b": ident(b),
        "changed": _changed(a.model, b.model),
    }


def _diff_chunks(a: Plan, b: Plan) -> dict[str, Any]:
    """Parameters matched by name: moved (chunk or offset), reshaped, added, removed."""
    pa = {p.name: (c.id, p) for c in a.chunks.items for p in c.params}
    pb = {p.name: (c.id, p) for c in b.chunks.items for p in c.params}
    moved, reshaped = [], []
    for name, (ca, p) in pa.items():  # A's execution order
        if name not in pb:
            continue
        cb, q = pb[name]
        if (ca, p.offset) != (cb, q.offset):
            moved.append(
                {
                    "name": name,
                    "a": {"chunk": ca, "offset": p.offset},
                    "b": {"chunk": cb, "offset": q.offset},
                }
            )
        if (p.shape, p.dtype, p.numel) != (q.shape, q.dtype, q.numel):
            reshaped.append(
                {
                    "name": name,
                    "a": {"shape": list(p.shape), "dtype": p.dtype},
                    "b": {"shape": list(q.shape), "dtype": q.dtype},
                }
            )
    return {
        "chunk_numel": _pair(a.chunks.chunk_numel, b.chunks.chunk_numel),
        "n_chunks": _pair(len(a.chunks.items), len(b.chunks.items)),
        "moved": moved,
        "added": [n for n in pb if n not in pa],
        "removed": [n for n in pa if n not in pb],
        "reshaped": reshaped,
    }


def _diff_placement(a: Plan, b: Plan) -> dict[str, Any]:
    la, lb = a.placement, b.placement
    return {
        "n_persist": _pair(la.n_persist, lb.n_persist),
        "n_buffer": _pair(la.n_buffer, lb.n_buffer),
        "shard_persistent_states": _pair(la.shard_persistent_states, lb.shard_persistent_states),
        # Only chunk ids present in both plans can change residency.
        "to_offloaded": sorted(set(la.persistent) & set(lb.offloaded)),
        "to_persistent": sorted(set(la.offloaded) & set(lb.persistent)),
    }


def _diff_activations(a: Plan, b: Plan) -> dict[str, Any]:
    """Policies compared by block position (block names differ only between models)."""
    xa, xb = a.activations, b.activations
    changed = []
    for i in range(max(len(xa), len(xb))):
        pa = xa[i].policy if i < len(xa) else None
        pb = xb[i].policy if i < len(xb) else None
        if pa != pb:
            changed.append(
                {"index": i, "block": (xa[i] if i < len(xa) else xb[i]).block, "a": pa, "b": pb}
            )
    return {"a": policy_strip(a), "b": policy_strip(b), "changed": changed}


def _diff_schedule(a: Plan, b: Plan) -> dict[str, Any]:
    """Steps matched by (phase, segment); one change per differing event list."""
    changes: list[dict[str, Any]] = []
    steps_differ = n_matched = 0
    for phase in ("forward", "backward"):
        sa = {s.segment: s for s in getattr(a.schedule, phase)}
        sb = {s.segment: s for s in getattr(b.schedule, phase)}
        for seg in [*sa, *(s for s in sb if s not in sa)]:
            n_matched += 1
            x, y = sa.get(seg), sb.get(seg)
            if x is None or y is None:
                step = [
                    {
                        "phase": phase,
                        "segment": seg,
                        "field": "step",
                        "a": x is not None,
                        "b": y is not None,
                    }
                ]
            else:
                step = [
                    {
                        "phase": phase,
                        "segment": seg,
                        "field": f,
                        "a": getattr(x, f),
                        "b": getattr(y, f),
                    }
                    for f in EVENTS
                    if getattr(x, f) != getattr(y, f)
                ]
            steps_differ += bool(step)
            changes += step
    n = (
        len(a.schedule.forward) + len(a.schedule.backward),
        len(b.schedule.forward) + len(b.schedule.backward),
    )
    return {
        "n_steps": _pair(*n),
        "n_matched": n_matched,
        "steps_differ": steps_differ,
        "changes": changes,
        "cpu_adam": _pair(a.schedule.cpu_adam, b.schedule.cpu_adam),
    }


def _predicted(plan: Plan) -> dict[str, Any]:
    """Iteration time, peak and tokens/s (tokens of one optimizer step over all ranks / time)."""
    p, t = plan.prediction, plan.training
    if not (p.iter_time_us or p.peak_memory_bytes):
        return {"iter_time_us": None, "peak_memory_bytes": None, "tokens_per_s": None}
    tokens = t.micro_batch * t.seq_len * t.grad_accum * t.world_size
    return {
        "iter_time_us": p.iter_time_us,
        "peak_memory_bytes": p.peak_memory_bytes,
        "tokens_per_s": round(tokens * 1e6 / p.iter_time_us) if p.iter_time_us else None,
    }


def _ratio(x: int | None, y: int | None) -> float | None:
    return round(x / y, 4) if x and y else None


def _diff_prediction(a: Plan, b: Plan) -> dict[str, Any]:
    pa, pb = _predicted(a), _predicted(b)
    ba, bb = a.prediction.breakdown, b.prediction.breakdown
    return {
        "a": pa,
        "b": pb,
        "time_ratio": _ratio(pb["iter_time_us"], pa["iter_time_us"]),  # B/A; < 1: B is faster
        "speedup": _ratio(pa["iter_time_us"], pb["iter_time_us"]),  # A/B; > 1: B is faster
        "peak_ratio": _ratio(pb["peak_memory_bytes"], pa["peak_memory_bytes"]),  # B/A
        "breakdown": {
            k: _pair(ba.get(k), bb.get(k)) for k in sorted({*ba, *bb}) if ba.get(k) != bb.get(k)
        },
    }


# -------------------------------------------------------------- diff: rendering


def _short(fp: str) -> str:
    return fp[:23] + "…" if len(fp) > 23 else fp


def _model_line(ident: dict[str, Any]) -> str:
    return (
        f"{ident['name']}: {human_count(ident['n_params'])} parameters, {ident['n_blocks']} blocks"
    )


def _fmt(field: str, value: Any, section: str = "") -> str:
    """One value the way ``show`` writes it: bytes, bandwidths and rates in human units."""
    if section in ("request", "hardware") and value in (0, ""):
        return "unset"  # these sections use 0 and "" for "not recorded"
    if value is None:
        return "none"
    if value == "":
        return '""'
    if isinstance(value, bool) or not isinstance(value, int):
        return str(value)
    if field.endswith("_bytes_per_s"):
        return f"{value / 1e9:.1f} GB/s"
    if field.endswith("_params_per_s"):
        return f"{human_count(value)} params/s"
    if field.endswith("_bytes"):
        return human_bytes(value)
    if field.endswith("_us"):
        return f"{value / 1e6:.3f} s"
    return str(value)


def _more(shown: int, total: int, indent: str) -> list[str]:
    return [f"{indent}… and {total - shown} more"] if total > shown else []


def _ids(ids: list[int]) -> str:
    """``[3, 4, 5, 9]`` → ``3-5, 9``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(s) if s == e else f"{s}-{e}" for s, e in runs)


def _render_model(m: dict[str, Any]) -> list[str]:
    ch = m["changed"]
    if not ch:
        return [f"  model         {_model_line(m['a'])} (same fingerprint)"]
    parts = []
    for f, v in ch.items():
        if f == "fingerprint":
            parts.append(f"fingerprint {_short(v['a'])} → {_short(v['b'])}")
        elif isinstance(v["a"], list):
            parts.append(f"{f} differ ({len(v['a'])} → {len(v['b'])} entries)")
        else:
            parts.append(f"{f} {_fmt(f, v['a'])} → {_fmt(f, v['b'])}")
    return ["  model         " + parts[0], *(" " * 16 + x for x in parts[1:])]


def _render_chunks(c: dict[str, Any]) -> list[str]:
    pad = " " * 16
    numel, count = c["chunk_numel"], c["n_chunks"]
    head = []
    if numel["a"] != numel["b"]:
        head.append(f"chunk_numel {human_count(numel['a'])} → {human_count(numel['b'])} elements")
    if count["a"] != count["b"]:
        head.append(f"{count['a']} → {count['b']} chunks")
    if not head and not any(c[k] for k in ("moved", "added", "removed", "reshaped")):
        return [f"  chunks        same layout ({count['a']} × {human_count(numel['a'])} elements)"]
    lines = [
        "  chunks        "
        + ("; ".join(head) or f"{count['a']} × {human_count(numel['a'])} elements")
    ]
    moved = c["moved"]
    if moved:
        shown = moved[:DIFF_LIST]
        width = max(len(x["name"]) for x in shown)
        lines.append(
            f"{pad}{len(moved)} parameter{'s' * (len(moved) != 1)} moved (chunk @ element offset)"
        )
        lines += [
            f"{pad}  {x['name']:<{width}}  {x['a']['chunk']} @ {x['a']['offset']} → "
            f"{x['b']['chunk']} @ {x['b']['offset']}"
            for x in shown
        ]
        lines += _more(len(shown), len(moved), pad + "  ")
    for key, what in (("added", "only in B"), ("removed", "only in A")):
        names = c[key]
        if names:
            lines.append(f"{pad}{len(names)} parameter{'s' * (len(names) != 1)} {key} ({what})")
            lines += [f"{pad}  {n}" for n in names[:DIFF_LIST]]
            lines += _more(min(len(names), DIFF_LIST), len(names), pad + "  ")
    if c["reshaped"]:
        r = c["reshaped"]
        lines.append(f"{pad}{len(r)} parameter{'s' * (len(r) != 1)} changed shape or dtype")
        lines += [
            (
                f"{pad}  {x['name']}  {x['a']['shape']} {x['a']['dtype']} → {x['b']['shape']} "
                f"{x['b']['dtype']}"
            )
            for x in r[:DIFF_LIST]
        ]
        lines += _more(min(len(r), DIFF_LIST), len(r), pad + "  ")
    return lines


def _render_placement(p: dict[str, Any]) -> list[str]:
    np_, nb = p["n_persist"], p["n_buffer"]
    if not _section_differs("placement", p):
        return [f"  placement     same ({np_['a']} persistent, {nb['a']} device buffers)"]
    head = "; ".join(
        f"{k} {v['a']} → {v['b']}" if v["a"] != v["b"] else f"{k} {v['a']} (same)"
        for k, v in (("n_persist", np_), ("n_buffer", nb))
    )
    lines = [f"  placement     {head}"]
    sh = p["shard_persistent_states"]
    if sh["a"] != sh["b"]:
        lines.append(
            f"                persistent optimizer states {_sharding(sh['a'])} → "
            f"{_sharding(sh['b'])}"
        )
    if p["to_offloaded"]:
        lines.append(f"                persistent → offloaded: chunks {_ids(p['to_offloaded'])}")
    if p["to_persistent"]:
        lines.append(f"                offloaded → persistent: chunks {_ids(p['to_persistent'])}")
    return lines


def _sharding(sharded: bool) -> str:
    return "sharded" if sharded else "replicated"


def _render_activations(act: dict[str, Any]) -> list[str]:
    la, lb = act["a"].split(), act["b"].split()
    if not act["changed"]:
        counts = {p: la.count(p.letter) for p in POLICIES.values() if p.letter in la}
        summary = ", ".join(f"{n} {p.name}" for p, n in counts.items())
        return [f"  activations   same ({summary or 'no blocks'})"]
    n = max(len(la), len(lb))
    legend = ", ".join(f"{p.letter} {p.name}" for p in POLICIES.values())
    lines = [f"  activations   {len(act['changed'])} of {n} blocks differ   ({legend})"]
    pad = " " * 16
    for start in range(0, n, STRIP_WRAP):
        end = min(n, start + STRIP_WRAP)
        row_a = [la[i] if i < len(la) else "-" for i in range(start, end)]
        row_b = [lb[i] if i < len(lb) else "-" for i in range(start, end)]
        marks = ["^" if x != y else " " for x, y in zip(row_a, row_b)]
        if n > STRIP_WRAP:
            lines.append(f"{pad}blocks {start}-{end - 1}")
        lines += [f"{pad}A  {' '.join(row_a)}", f"{pad}B  {' '.join(row_b)}"]
        if "^" in marks:  # a wrapped group without differences gets no (blank) marker line
            lines.append(f"{pad}   {' '.join(marks)}".rstrip())
    return lines


def _render_schedule(s: dict[str, Any], chunks: dict[str, Any], same_model: bool) -> list[str]:
    n, k, cpu = s["n_steps"], s["steps_differ"], s["cpu_adam"]
    adam = [] if cpu["a"] == cpu["b"] else [f"{' ' * 18}cpu_adam  {cpu['a']} → {cpu['b']}"]
    if not k:
        if adam:
            return [
                f"  schedule      cpu_adam {cpu['a']} → {cpu['b']}   (the {n['a']} steps are the "
                "same)"
            ]
        return [f"  schedule      same ({n['a']} steps)"]
    note = ""
    if s["n_matched"] != n["a"] or s["n_matched"] != n["b"]:
        note += f"; A has {n['a']}, B has {n['b']}, matched by segment"
    if _section_differs("chunks", chunks) or not same_model:
        note += "; chunk ids name each plan's own chunks"
    lines = [
        f"  schedule      {k} of {s['n_matched']} steps differ"
        + (f"   ({note[2:]})" if note else "")
    ]
    shown = s["changes"][:DIFF_STEPS]
    seg_w = max(len(x["segment"]) for x in shown)
    for x in shown:
        if x["field"] == "step":
            what = "step only in A" if x["a"] else "step only in B"
        else:
            what = f"{x['field']:<8} {x['a']} → {x['b']}"
        lines.append(f"                  {x['phase']:<8}  {x['segment']:<{seg_w}}  {what}")
    if len(s["changes"]) > len(shown):
        lines.append(f"{' ' * 18}… and {len(s['changes']) - len(shown)} more changes")
    return lines + adam


def _render_prediction(p: dict[str, Any]) -> list[str]:
    pa, pb = p["a"], p["b"]
    if pa["iter_time_us"] is None and pb["iter_time_us"] is None:
        return ["  prediction    neither plan has one (made without a profile)"]
    if pa["iter_time_us"] is None or pb["iter_time_us"] is None:
        side, pr = ("A", pa) if pb["iter_time_us"] is None else ("B", pb)
        return [
            f"  prediction    only {side} has one: {pr['iter_time_us'] / 1e6:.3f} s/iteration, "
            f"peak {human_bytes(pr['peak_memory_bytes'])}"
        ]
    ta, tb = pa["iter_time_us"], pb["iter_time_us"]
    if p["time_ratio"] is None:
        speed = ""
    elif tb < ta:
        speed = f" (B/A = {p['time_ratio']:.2f}×, B is {p['speedup']:.2f}× faster)"
    elif tb > ta:
        speed = f" (B/A = {p['time_ratio']:.2f}×, B is {p['time_ratio']:.2f}× slower)"
    else:
        speed = " (same)"
    peak = f" (B/A = {p['peak_ratio']:.2f}×)" if p["peak_ratio"] is not None else ""
    lines = [
        f"  prediction    iteration {ta / 1e6:.3f} s → {tb / 1e6:.3f} s{speed}",
        f"                peak memory {human_bytes(pa['peak_memory_bytes'])} → "
        f"{human_bytes(pb['peak_memory_bytes'])}{peak}",
    ]
    if pa["tokens_per_s"] and pb["tokens_per_s"]:
        lines.append(f"                tokens/s {pa['tokens_per_s']:,} → {pb['tokens_per_s']:,}")
    if p["breakdown"]:
        lines.append("                terms that changed")
    for name, v in p["breakdown"].items():
        lines.append(f"                  {name:<22} {_fmt(name, v['a'])} → {_fmt(name, v['b'])}")
    return lines


def _render_info(info: dict[str, Any]) -> list[str]:
    lines = []
    for section, prefix in (
        ("generator", "generator"),
        ("provenance", "provenance"),
        ("search", "provenance.search"),
    ):
        for f, v in info[section].items():
            if f == "chosen":
                lines.append(
                    f"                {prefix}.chosen (n_persist, n_buffer, n_swap, n_checkpoint) "
                    f"{_config(v['a'])} → {_config(v['b'])}"
                )
            elif isinstance(v["a"], (list, dict)):
                size = (
                    f" ({len(v['a'])} → {len(v['b'])} entries)" if isinstance(v["a"], list) else ""
                )
                lines.append(f"                {prefix}.{f} differs{size}")
            else:
                shown = [
                    _short(x) if f == "profile_digest" else _fmt(f, x) for x in (v["a"], v["b"])
                ]
                lines.append(f"                {prefix}.{f} {shown[0]} → {shown[1]}")
    return ["  informational (does not affect equality)", *lines] if lines else []


def _config(c: dict[str, Any]) -> str:
    return f"({c['n_persist']}, {c['n_buffer']}, {c['n_swap']}, {c['n_checkpoint']})"
