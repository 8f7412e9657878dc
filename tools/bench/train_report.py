"""Reports of tools/bench/train.py: the markdown table and the BENCHMARKS.md section,
from saved JSON-line records (one per back-end run)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from tools.bench import harness
from tools.bench.train_backends import human


def load_records(paths: list[str]) -> list[dict]:
    recs = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip().startswith("{"):
                recs.append(json.loads(line))
    return recs


def _mib(n) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f}" if n >= 2**24 else f"{n / 2**20:,.2f}"


def report_table(records: list[dict]) -> str:
    """One table per (model, device, dtype, batch, seq, budget): back-ends side by side.

    Tokens/s is the median over every measured step of every repeat; the spread is
    the min–max of the per-repeat medians and the IQR of single steps. Ratios are
    against torch-plain measured in the same run when it ran, else against
    fsdp2-offload.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (
            r["model"],
            r["device"],
            r["dtype"],
            r["micro_batch"],
            r["seq"],
            r["grad_accum"],
            r.get("budget_bytes"),
        )
        groups.setdefault(key, []).append(r)
    out = []
    for (model, device, dtype, mb, seq, ga, budget), recs in groups.items():
        by: dict[str, list[dict]] = {}
        for r in recs:
            by.setdefault(r["backend"], []).append(r)
        med = {}
        for b, rs in by.items():
            ok = [r for r in rs if r.get("fits")]
            if ok:
                # Per-step tokens/s are not stored; the median of run medians stands for them.
                med[b] = statistics.median(r["tokens_per_s"] for r in ok)
        base = (
            "torch-plain"
            if "torch-plain" in med
            else ("fsdp2-offload" if "fsdp2-offload" in med else None)
        )
        dev_name = recs[0].get("device_name", device)
        enforced = any(r.get("budget_enforced") for r in recs)
        out.append(
            f"**{model}** ({human_count(recs[0].get('n_params'))} params) on {device} "
            f"({dev_name}), {dtype}, micro-batch {mb} × grad-accum {ga} × seq {seq}"
            + (
                f", budget {human(budget)} ({'enforced' if enforced else 'planner only'})"
                if budget
                else ""
            )
        )
        out.append("")
        head = (
            "| back-end | runs | tokens/s (median) | run medians min–max | step IQR tokens/s | × "
            f"{base or '—'} | peak device MiB, allocated / reserved | peak host RSS MiB, steps / "
            "run | loss first → last | predicted / measured iter | predicted / measured peak MiB "
            "| note |"
        )
        out += [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for b, rs in by.items():
            ok = [r for r in rs if r.get("fits")]
            note = "; ".join(
                sorted(
                    {
                        str(r.get("skipped") or r.get("reason") or r.get("error"))
                        for r in rs
                        if not r.get("fits")
                    }
                )
            )
            if not ok:
                verdict = (
                    "does not fit" if any(r.get("fits") is False for r in rs) else "did not run"
                )
                out.append(
                    f"| {b} | {len(rs)} | {verdict} | | | | | "
                    f"{_mib(max((r.get('peak_host_rss_bytes') or 0) for r in rs))} | | | | "
                    f"{note.replace('|', '/')[:300]} |"
                )
                continue
            meds = [r["tokens_per_s"] for r in ok]
            q1 = statistics.median(r["tokens_per_s_spread"]["q1"] for r in ok)
            q3 = statistics.median(r["tokens_per_s_spread"]["q3"] for r in ok)
            ratio = f"{med[b] / med[base]:.2f}" if base else "—"
            peak_dev = max((r.get("peak_dev_bytes") or 0) for r in ok) or None
            # What the budget caps: the allocator's reserved peak and its retries (CUDA only).
            reserved = max((r.get("max_memory_reserved_bytes") or 0) for r in ok) or None
            retries = max((r.get("num_alloc_retries") or 0) for r in ok)
            dev_cell = _mib(peak_dev) + (f" / {_mib(reserved)}" if reserved else "")
            if retries:
                note = (note + "; " if note else "") + f"allocator retries {retries}"
            rss = max(
                max(r["peak_host_rss_bytes"], r.get("peak_host_rss_train_bytes") or 0) for r in ok
            )
            train_rss = max((r.get("peak_host_rss_train_bytes") or 0) for r in ok) or None
            pred_it = pred_pk = "—"
            if b == "protrain":
                pi = statistics.median(r["predicted_iter_s"] for r in ok)
                mi = statistics.median(r["measured_iter_s"] for r in ok)
                pp = ok[0]["predicted_peak_bytes"]
                mp = max(r["measured_peak_bytes"] for r in ok)
                pred_it = f"{pi * 1e3:,.1f} / {mi * 1e3:,.1f} ms ({mi / pi:.2f}×)" if pi else "—"
                # A ledger count is predicted from the ledger's own terms: consistency, not
                # fidelity (that needs the allocator's figure from a GPU run).
                src = ok[0].get("measured_peak_source")
                pred_pk = (
                    f"{_mib(pp)} / {_mib(mp)} ({mp / pp:.2f}×, "
                    f"{'ledger, a consistency check' if src == 'ledger' else src})"
                )
                note = (
                    (note + "; " if note else "")
                    + "plan "
                    + ", ".join(f"{k}={v}" for k, v in ok[0]["plan"].items() if v is not None)
                )
            elif b.startswith("deepspeed"):
                z = ok[0]["ds_zero"]
                note = (note + "; " if note else "") + (
                    f"deepspeed {ok[0].get('ds_version')}, "
                    f"prefetch_bucket={z['stage3_prefetch_bucket_size']}, "
                    f"max_live={z['stage3_max_live_parameters']}, "
                    f"persistence={z['stage3_param_persistence_threshold']}"
                )
            elif b.startswith("fsdp2"):
                note = (note + "; " if note else "") + f"AC on {ok[0]['ac']}"
            out.append(
                f"| {b} | {len(ok)} | {med[b]:,.0f} | {min(meds):,.0f}–{max(meds):,.0f} | "
                f"{q1:,.0f}–{q3:,.0f} | {ratio} | {dev_cell} | {_mib(train_rss)} / {_mib(rss)} | "
                f"{ok[0]['loss_first']:.4f} → {ok[0]['loss_last']:.4f} | {pred_it} | "
                f"{pred_pk} | {note.replace('|', '/')[:300]} |"
            )
        out.append("")
    return "\n".join(out)


def human_count(n) -> str:
    if not n:
        return "?"
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def report_section(records: list[dict]) -> str:
    import torch  # noqa: F401  (the machine line names its version)

    commands = list(dict.fromkeys(r["command"] for r in records if r.get("command")))
    commits = sorted({r.get("commit", "unknown") for r in records})
    dates = sorted({r.get("date", "") for r in records})
    devices = sorted({r["device"] for r in records})
    lines = [harness.heading("train"), ""]
    lines += [
        "Commands (each appends its records to a JSON-lines file; "
        "`python -m tools.bench train --report FILE --write` makes this section from it):",
        "",
    ]
    lines += [f"    {c}" for c in commands] + [""]
    lines += [
        f"Commit: {', '.join(commits)} (the working tree at that commit plus the bench tools). "
        f"Dates: {dates[0]} to {dates[-1]}. Report machine: {harness.machine()}.",
        "",
    ]
    torches = sorted({r["torch"] for r in records if r.get("torch")})
    ds = sorted({r["ds_version"] for r in records if r.get("ds_version")})
    lines += [
        f"Software: torch {', '.join(torches)}"
        + (
            f"; deepspeed {', '.join(ds)} (not a project dependency: installed beside it "
            "for this run, its CPU Adam op JIT-built by DeepSpeed)"
            if ds
            else ""
        )
        + ".",
        "",
    ]
    if devices == ["cpu"]:
        lines += [
            "**CPU only. GPU figures are pending a lent device** (`tools/gpu_check.sh` is the "
            "prepared run: gpt2-xl and a reduced-depth llama-7b under a 24 GiB cap on an "
            'H200, protrain against FSDP2 offload). On CPU the "device" is host memory: '
            "offloading copies within RAM and nothing caps any back-end, so these figures "
            "say what each back-end's machinery costs per step, not what it buys on a GPU.",
            "",
        ]
    lines += [report_table(records), reading(records)]
    return "\n".join(lines).rstrip() + "\n"


def reading(records: list[dict]) -> str:
    """The facts a reader should take from the table, computed from the records."""
    parts = []
    # protrain against each offload baseline, repeat by repeat: the two ran back to back in
    # the same invocation, so their ratio is the figure that survives machine drift.
    groups: dict[tuple, dict[tuple[str, int], dict]] = {}
    for r in records:
        if r.get("fits"):
            key = (
                r["model"],
                r["device"],
                r["dtype"],
                r["micro_batch"],
                r["seq"],
                r["grad_accum"],
                r.get("command"),
            )
            groups.setdefault(key, {})[(r["backend"], r.get("repeat", 0))] = r
    for (model, _dev, _dt, mb, seq, _ga, _cmd), runs in groups.items():
        for base in (
            "fsdp2-offload",
            "fsdp2-offload-sac",
            "deepspeed-zero3-offload",
            "torch-plain",
        ):
            ratios = [
                runs[("protrain", rep)]["tokens_per_s"] / runs[(base, rep)]["tokens_per_s"]
                for (b, rep) in runs
                if b == base and ("protrain", rep) in runs
            ]
            if ratios:
                parts.append(
                    f"{model} (micro-batch {mb} × {seq}): protrain / {base} = "
                    f"{statistics.median(ratios):.2f}× (per repeat "
                    f"{min(ratios):.2f}–{max(ratios):.2f}×)"
                )
    text = "Tokens/s ratios, repeat by repeat: " + "; ".join(parts) + "." if parts else ""
    # Same model, data and seed: the losses say whether the back-ends computed the same thing.
    same, differ = set(), {}
    for runs in groups.values():
        for (b, rep), r in runs.items():
            ref = runs.get(("torch-plain", rep))
            if ref is None or b == "torch-plain":
                continue
            d = max(
                abs(r["loss_first"] - ref["loss_first"]), abs(r["loss_last"] - ref["loss_last"])
            )
            if d == 0:
                same.add(b)
            else:
                differ[b] = max(differ.get(b, 0.0), d)
    if same or differ:
        text += (
            " Against torch-plain in the same repeat, the first and last losses of "
            + (
                f"{', '.join(sorted(same - set(differ)))} are equal bit for bit"
                if same - set(differ)
                else "no back-end are equal"
            )
            + "".join(f"; {b} differs by up to {d:.1e}" for b, d in sorted(differ.items()))
            + "."
        )
    notes = [r for r in records if r["backend"] == "protrain" and r.get("fits")]
    if notes:
        worst_peak = max(notes, key=lambda r: r["peak_ratio"])
        its = [r["iter_ratio"] for r in notes if r.get("iter_ratio")]
        text += (
            f" protrain's measured peak was {min(r['peak_ratio'] for r in notes):.2f}–"
            f"{worst_peak['peak_ratio']:.2f}× its plan's prediction over {len(notes)} runs "
            f"({worst_peak['measured_peak_source']} count)"
        )
        if worst_peak["measured_peak_source"] == "ledger":
            text += (
                ", a consistency check rather than fidelity: on CPU the plan predicts the "
                "executor's ledger from the ledger's own terms, so agreement shows the two "
                "count alike; fidelity waits for a real allocator's peak (a GPU run)"
            )
        if its:
            text += (
                f"; its measured iteration time {min(its):.2f}–{max(its):.2f}× the predicted one."
            )
    load = os.getloadavg()[0]
    return (
        text + f" Load average when this report was written: {load:.2f} on "
        f"{os.cpu_count()} cores (other jobs may share the machine; read ratios within the "
        "per-repeat spread as equal)."
    ).strip()
