"""The benchmark tools against FSDP2 / DeepSpeed: ``python -m tools.bench train`` and ``fit``,
gpu_check.sh on CPU.

Each tool runs as a user would run it (a subprocess from the repository root) on tiny
models, and its output is checked for what the GPU run will rely on: one JSON record
per run with the fields the report reads, positive throughput, protrain's predicted
and measured figures, and clean records for back-ends that cannot run here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
COMMON = [
    "--device",
    "cpu",
    "--model",
    "gpt2-tiny",
    "--micro-batch",
    "2",
    "--seq",
    "32",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--hardware",
    "cpu",
    "--threads",
    "1",
]
FIELDS = {
    "backend",
    "model",
    "n_params",
    "device",
    "dtype",
    "micro_batch",
    "seq",
    "global_batch",
    "steps",
    "warmup",
    "fits",
    "tokens_per_s",
    "tokens_per_s_spread",
    "peak_dev_bytes",
    "peak_host_rss_bytes",
    "loss_first",
    "loss_last",
    "budget_bytes",
    "budget_enforced",
    "max_memory_reserved_bytes",
    "num_alloc_retries",
    "command",
    "commit",
    "date",
}
ALLOCATOR = ("max_memory_reserved_bytes", "num_alloc_retries")  # in every record; null on CPU


def run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def train_records(tmp_path_factory) -> dict[str, dict]:
    """One bench_train run of every back-end on gpt2-tiny (fp32, CPU), by back-end name."""
    jsonl = tmp_path_factory.mktemp("bench") / "runs.jsonl"
    proc = run(
        [
            "-m",
            "tools.bench",
            "train",
            *COMMON,
            "--budget",
            "3MiB",
            "--jsonl",
            str(jsonl),
            "--backend",
            "protrain",
            "--backend",
            "torch-plain",
            "--backend",
            "fsdp2-offload",
            "--backend",
            "deepspeed-zero3-offload",
        ]
    )
    recs = records(proc.stdout)
    assert [r["backend"] for r in recs] == [
        "protrain",
        "torch-plain",
        "fsdp2-offload",
        "deepspeed-zero3-offload",
    ], proc.stdout
    assert records(jsonl.read_text()) == recs  # --jsonl holds exactly what was printed
    return {r["backend"]: {**r, "_jsonl": str(jsonl)} for r in recs}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["protrain", "torch-plain"])
def test_bench_train_records_a_measured_run(train_records, backend):
    r = train_records[backend]
    assert FIELDS <= r.keys(), FIELDS - r.keys()
    assert r["fits"] is True and "error" not in r
    assert (r["model"], r["device"], r["dtype"], r["micro_batch"], r["seq"]) == (
        "gpt2-tiny",
        "cpu",
        "float32",
        2,
        32,
    )
    assert r["global_batch"] == 2 and r["budget_bytes"] == 3 * 2**20
    assert r["budget_enforced"] is False  # no device memory to cap on CPU
    assert r["peak_dev_bytes"] is None
    assert r["max_memory_reserved_bytes"] is None and r["num_alloc_retries"] is None
    s = r["tokens_per_s_spread"]
    assert 0 < s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"]
    assert r["tokens_per_s"] == s["median"] > 0
    assert r["peak_host_rss_bytes"] > 10 * 2**20  # a Python process with torch in it
    assert 0 < r["peak_host_rss_train_bytes"] <= r["peak_host_rss_bytes"]
    assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])


@pytest.mark.slow
def test_bench_train_protrain_reports_prediction_against_measurement(train_records):
    r = train_records["protrain"]
    assert r["predicted_iter_s"] > 0 and r["measured_iter_s"] > 0
    assert r["iter_ratio"] == pytest.approx(r["measured_iter_s"] / r["predicted_iter_s"])
    # On CPU the measured peak is the executor's ledger, which the planner predicts
    # exactly: a plan must never under-predict, and within the 3 MiB budget.
    assert r["measured_peak_source"] == "ledger"
    assert 0 < r["measured_peak_bytes"] <= r["predicted_peak_bytes"] <= r["budget_bytes"]
    assert r["peak_ratio"] == pytest.approx(r["measured_peak_bytes"] / r["predicted_peak_bytes"])
    # 3 MiB is less than keeping everything (~3.7 MiB): the plan must trade something.
    plan = r["plan"]
    assert plan["n_persist"] < plan["n_chunks"] or plan["n_swap"] + plan["n_checkpoint"] > 0, plan
    # The engine's own allocator figures: 0 on CPU, or None from an executor without them.
    assert r["engine_reserved_peak_bytes"] in (None, 0)
    assert r["engine_alloc_retries"] in (None, 0)


@pytest.mark.slow
def test_bench_train_every_record_carries_allocator_fields(train_records):
    # Skipped (deepspeed not importable) and failed records too: a report over a GPU run
    # must not have to guess whether a missing field means "none" or "not measured".
    for name, r in train_records.items():
        assert {k: r.get(k, "missing") for k in ALLOCATOR} == dict.fromkeys(ALLOCATOR), name


@pytest.mark.slow
def test_bench_train_back_ends_train_the_same_model_on_the_same_data(train_records):
    # fp32 on CPU: a plan moves tensors and never changes arithmetic, so protrain's
    # losses are plain PyTorch's bit for bit; FSDP2 (one rank, fp32) computes the same.
    plain = train_records["torch-plain"]
    for name in ("protrain", "fsdp2-offload"):
        r = train_records[name]
        if r.get("fits"):
            assert (r["loss_first"], r["loss_last"]) == (plain["loss_first"], plain["loss_last"]), (
                name
            )


@pytest.mark.slow  # (the module's bench_train run of four back-ends: 17 s)
def test_bench_train_fsdp2_runs_or_skips_cleanly(train_records):
    r = train_records["fsdp2-offload"]
    if r["fits"] is None:  # torch refused: the record says why, and nothing else broke
        assert r["skipped"].startswith("torch refused"), r
    else:
        assert r["fits"] is True and r["tokens_per_s"] > 0
        assert r["ac"] == "every block" and r["offload"].startswith("CPUOffloadPolicy")


@pytest.mark.slow  # (the module's bench_train run of four back-ends: 17 s)
def test_bench_train_deepspeed_record(train_records):
    r = train_records["deepspeed-zero3-offload"]
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        assert r["fits"] is None and r["skipped"].startswith("deepspeed is not importable"), r
        return
    assert r["fits"] is True or r.get("skipped") or r.get("reason"), r
    if r["fits"]:
        z = r["ds_zero"]
        assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu"


@pytest.mark.slow  # (the module's bench_train run of four back-ends: 17 s)
def test_bench_train_report_renders_every_back_end(train_records, tmp_path):
    proc = run(["-m", "tools.bench", "train", "--report", train_records["protrain"]["_jsonl"]])
    table = proc.stdout
    assert "**gpt2-tiny**" in table and "× torch-plain" in table
    rows = {
        line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")
    }
    for name in ("protrain", "torch-plain", "fsdp2-offload", "deepspeed-zero3-offload"):
        assert name in rows, table
    assert "| 1.00 |" in rows["torch-plain"]  # the baseline against itself
    assert "ledger, a consistency check" in rows["protrain"]
    assert "allocated / reserved" in table


@pytest.mark.slow
def test_bench_train_does_not_fit_is_a_clean_record():
    # 256 KiB is below anything the planner can do for gpt2-tiny: a "fits": false
    # record naming the planner's reason, exit status 0, no traceback.
    proc = run(
        ["-m", "tools.bench", "train", *COMMON, "--budget", "256KiB", "--backend", "protrain"]
    )
    (r,) = records(proc.stdout)
    assert r["fits"] is False and r["reason"].startswith("planner: no configuration"), r
    assert {k: r[k] for k in ALLOCATOR} == dict.fromkeys(ALLOCATOR)
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_fit_tiny_ladder(tmp_path):
    jsonl = tmp_path / "fit.jsonl"
    proc = run(
        [
            "-m",
            "tools.bench",
            "fit",
            "--device",
            "cpu",
            "--tiny",
            "--family",
            "gpt2",
            "--budget",
            "1MiB",
            "--backend",
            "protrain",
            "--backend",
            "torch-plain",
            "--micro-batches",
            "1",
            "2",
            "4",
            "--threads",
            "1",
            "--jsonl",
            str(jsonl),
        ]
    )
    lines = records(proc.stdout)
    assert records(jsonl.read_text()) == lines
    results = {r["backend"]: r for r in lines if r["kind"] == "result"}
    probes = [r for r in lines if r["kind"] == "probe"]
    assert set(results) == {"protrain", "torch-plain"}
    pt, plain = results["protrain"], results["torch-plain"]
    # Plain PyTorch is not capped on CPU: it trains every rung, the top is its answer.
    assert plain["budget_enforced"] is False
    assert (
        plain["largest_index"] == plain["ladder_rungs"] - 1
        and plain["limit"] == "end of the ladder"
    )
    assert plain["largest_micro_batch"] == 4
    # protrain plans for the 1 MiB budget: a smaller rung, stopped by the planner.
    assert 0 <= pt["largest_index"] < plain["largest_index"]
    assert pt["limit"].startswith("planner: no configuration")
    assert pt["largest_micro_batch"] in (1, 2, 4)
    # Bisection: the rung above protrain's answer was probed and did not fit.
    above = f"tiny:gpt2:{pt['largest_index'] + 1}"
    assert any(
        p["backend"] == "protrain" and p["model"] == above and p["fits"] is False for p in probes
    )
    assert len([p for p in probes if p["backend"] == "torch-plain"]) <= 3 + 2  # log2 of 6, of 3


@pytest.mark.slow  # (8 s)
def test_gpu_preflight_on_cpu(tmp_path):
    # The census runs on CPU; the pinned part is recorded as skipped; back-ends CPU lacks
    # are records with their error, not crashes. --isolate-all runs the move-everything
    # swap probe in a child process for every back-end that ran, as a GPU run does for
    # those that save tensors off the device.
    out = tmp_path / "preflight.json"
    proc = run(
        [str(TOOLS / "gpu_preflight.py"), "--device", "cpu", "--isolate-all", "--out", str(out)],
        timeout=120,
    )
    rec = json.loads(out.read_text())
    assert rec["host_register"] == {"status": "skipped: no CUDA"}
    assert rec["env"]["torch"] and isinstance(rec["seconds"], float)
    entries = rec["sdpa"]["entries"]
    assert (
        len(entries) == 5 * 2 * 2 * 3
    )  # back-ends (and torch's own choice) × dtypes × dropout × shapes
    assert {e["status"] for e in entries} <= {"ok", "error"}
    maths = [e for e in entries if e["backend"] == "MATH"]
    assert all(e["status"] == "ok" for e in maths), maths  # the math back-end runs everywhere
    for e in maths:
        assert e["saved"] and all(
            t["device"] == "cpu"
            and t["nbytes"]
            == t["numel"] * {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}[t["dtype"]]
            for t in e["saved"]
        )
    assert all(e["error"] for e in entries if e["status"] == "error")
    first = [e for e in maths if e["shape"] == rec["sdpa"]["shapes"][0]]
    for e in first:  # the round trip through host memory leaves gradients exact
        assert e["swap_on_device"] == {"status": "ok", "max_abs_grad_diff": 0.0}, e
        assert e["swap_all"] == {"status": "ok", "max_abs_grad_diff": 0.0}, e
    assert "## Pre-flight" in proc.stdout and "MATH bfloat16 p=0.1 | 3/3" in proc.stdout
    report = run([str(TOOLS / "gpu_preflight.py"), "--report", str(out)]).stdout
    assert report == proc.stdout
    # Asked for CUDA where there is none: exit 1 and a record that says so.
    bad = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "gpu_preflight.py"),
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "bad.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1
    assert "sees no CUDA device" in json.loads((tmp_path / "bad.json").read_text())["error"]


@pytest.mark.bench
def test_gpu_preflight_on_cpu_under_a_minute(tmp_path):
    # The whole census of the test above, as its record times it.
    out = tmp_path / "preflight.json"
    run(
        [str(TOOLS / "gpu_preflight.py"), "--device", "cpu", "--isolate-all", "--out", str(out)],
        timeout=120,
    )
    assert json.loads(out.read_text())["seconds"] < 60


def test_gpu_preflight_flags_what_swap_must_leave_alone():
    # What flash SDPA saves on a GPU with dropout (issue #14): CPU int64 philox scalars
    # beside device tensors. The summary lists exactly those.
    from tools import gpu_preflight

    def t(device, dtype, shape, role="other"):
        numel = math.prod(shape)
        return {
            "device": device,
            "dtype": dtype,
            "shape": shape,
            "numel": numel,
            "nbytes": 2 * numel,
            "role": role,
        }

    e = {
        "backend": "FLASH_ATTENTION",
        "dtype": "bfloat16",
        "dropout_p": 0.1,
        "input_device": "cuda:0",
        "status": "ok",
        "grad_fn": "ScaledDotProductFlashAttentionBackward0",
        "saved": [
            t("cuda:0", "bfloat16", [2, 4, 128, 64], "q"),
            t("cuda:0", "float32", [2, 4, 128]),
            t("cpu", "int64", []),
            t("cpu", "int64", []),
        ],
    }
    summary = gpu_preflight.census_summary([e, {**e, "shape": [1]}])
    s = summary["FLASH_ATTENTION bfloat16 p=0.1"]
    assert s["ok"] == 2 and s["odd_saved"] == [
        {"device": "cpu", "dtype": "int64", "shape": [], "role": "other"}
    ]
    assert "other int64 [] on cpu" in gpu_preflight.report({"sdpa": {"summary": summary}})


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(TOOLS / "gpu_check.sh"), "--device", "cpu", "--tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        # (never an editable install from a test: it would re-point the environment's protrain)
        env=dict(os.environ, OUT=str(out), GPU_CHECK_NO_INSTALL="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "artifacts.tar.gz",
        "bench.jsonl",
        "env.txt",
        "log.txt",
        "preflight.json",
        "pytest-gpu.txt",
        "steps.tsv",
        "summary.md",
    ]  # the device tool returns ≤ 8
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert steps[0][0] == "pre-flight" and int(steps[0][4]) <= 60, steps  # first, under 60 s
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["host_register"] == {"status": "skipped: no CUDA"} and pre["sdpa"]["entries"]
    # Every step ran and passed, but DeepSpeed's, which a CPU rehearsal leaves out.
    assert steps and all(s[1] == "ok" for s in steps if not s[0].endswith("deepspeed")), steps
    assert [s[1] for s in steps if s[0].endswith("deepspeed")] == [
        "skipped (not importable, or CPU without --with-deepspeed)"
    ], steps
    recs = records((out / "bench.jsonl").read_text())
    ran = {(r["backend"], r["model"], r["micro_batch"]) for r in recs if r["fits"]}
    for model in ("gpt2-tiny", "llama-tiny"):
        for mb in (2, 4):
            assert {("protrain", model, mb), ("fsdp2-offload", model, mb)} <= ran, ran
    for r in recs:
        if r["backend"] == "protrain":
            assert r["measured_peak_bytes"] <= r["predicted_peak_bytes"] <= 3 * 2**20
    summary = (out / "summary.md").read_text()
    assert "predicted / measured peak" in summary and "## Steps" in summary
    assert "## Pre-flight" in summary and "PROTRAIN_ASYNC_CPU=1 for the bench runs" in summary
    assert (
        "## Host bytes per offloaded parameter, cpu" in summary and "| cpu | gpt2-tiny |" in summary
    )
    assert (out / "env.txt").read_text().startswith("=== environment")
    assert "skipped" in (out / "pytest-gpu.txt").read_text()  # no CUDA here: skipped, not failed
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    assert sum(n.endswith(".plan.json") for n in names) == 4, names
    assert sum(n.endswith(".profile.json") for n in names) == 4, names
    assert any(n.endswith("spec-cpu.json") for n in names), names
    assert any(n.endswith("host.jsonl") for n in names), names


@pytest.mark.slow  # (the module's bench_train run of four back-ends: 17 s)
def test_bench_train_write_replaces_only_its_own_section(train_records, tmp_path, monkeypatch):
    from tools.bench import harness
    from tools.bench import train as bench_train

    md = tmp_path / "BENCHMARKS.md"
    other = "## executor: Executor step time on CPU\n\nkeep me\n"
    md.write_text(harness.HEADER + "\n" + other)
    monkeypatch.setattr(harness, "BENCHMARKS_MD", md)
    jsonl = train_records["protrain"]["_jsonl"]
    section = harness.heading("train")
    for _ in range(2):  # the second write replaces the first
        assert bench_train.main(["--report", jsonl, "--write"]) == 0
    text = md.read_text()
    assert other in text and text.count(section) == 1
    assert text.index(other) < text.index(section)
    assert "GPU figures are pending a lent device" in text


def test_paper_sizes_section_says_what_binds():
    # tools/bench/paper_sizes.py's table, from made-up rows (the real run takes minutes): the
    # ratio to the paper, the binding resource, the device-only size, the four-rank note.
    from tools.bench import harness
    from tools.bench import paper_sizes as ps

    def row(world: int, paper: float, needs: str) -> dict:
        return dict(
            command=f"protrain fit --hardware rtx3090 --host-memory 384GiB --world-size {world}",
            server=f"{world} x rtx3090, 384GiB host RAM",
            params_b=25.42,
            shape="66L × 5632 (44 heads)",
            paper_b=paper,
            micro_batch=8,
            iter_s=38.6,
            binds="host memory (97% of the host budget; device 95%)",
            next=f"27.37B: host memory: {needs}",
            host_budget=0,
            device_bound_b=261.57,
            device_next="end of the ladder",
            seconds=1.0,
            placement=f"{world} / 60 / 3 of 72",
        )

    text = ps.section(
        [
            row(1, 34, "needs 349 GiB, 343 GiB usable"),
            row(4, 37, "needs 86.5 GiB, 84.4 GiB usable"),
        ],
        "llama-70b: plans.",
        2.0,
    )
    assert text.startswith(harness.heading("paper-sizes"))
    assert (
        "| 1 x rtx3090, 384GiB host RAM | 25.42B | 66L × 5632 (44 heads) | 34B | 0.75 | 8, 38.6 |"
        in text
    )
    assert "≥ 261.57B (the ladder's end)" in text and "llama-70b: plans." in text
    assert "stopped by host memory in 2 of 2 servers" in text
    assert (
        "persistent / homeless / device-homed of all: 1 / 60 / 3 of 72, 4 / 60 / 3 of 72." in text
    )
    assert (
        "4 x rtx3090 fits no larger a model than one card: at the next size the four ranks need "
        "346.0 GiB of host RAM in all against one rank's 349.0"
    ) in text
    assert "but have 337.6 GiB usable against 343.0" in text
    # a limit that is not a probe's host need (the host floor's "needs at least") says no totals
    floor = ps.section(
        [
            row(1, 34, "needs at least 400 GiB, 343 GiB usable"),
            row(4, 37, "needs 86.5 GiB, 84.4 GiB usable"),
        ],
        "llama-70b: plans.",
        2.0,
    )
    assert "fits no larger a model" not in floor


def test_bench_host_reads_its_rows():
    # tools/bench/host.py's section from made-up rows (the real run builds 355M and 774M
    # models): the table's ratios and the reading's figures, the marginal cost included.
    from tools.bench import host as bh

    def row(model, n, homeless, predicted, measured, mmap, dtype="bfloat16", accum=1):
        return dict(
            model=model,
            dtype=dtype,
            grad_accum=accum,
            homeless=homeless,
            slots=int(homeless),
            params=n,
            offloaded=n,
            wrapped_per_param=12.0,
            measured_per_param=measured,
            device_peak_per_param=1.0,
            predicted_per_param=predicted,
            chunk_numel=50_000_000,
            step_s=1.0,
            measured_mmap_per_param=mmap,
            steps=3,
            first_step_per_param=measured - 0.1,
        )

    rows = [
        row("small", 100, True, 12.5, 13.0, 12.6),
        row("large", 300, True, 12.2, 12.4, 12.3),
        row("small", 100, False, 14.0, 14.2, 14.1),
    ]
    text = bh.render(rows, "python -m tools.bench host --write")
    assert text.startswith("## host: Host bytes per offloaded parameter")
    assert (
        "| small | 0M | bfloat16 | 1 | none (homeless, 1 slot) | 50.0M | 12.50 | 12.00 | 13.00 "
        "| 1.040 | 12.60 | 1.008 | nan |"
    ) in text
    assert "Peak over predicted, rows in host memory: 1.007 to 1.040." in text
    assert "The fp32 row reads below" not in text  # (no fp32 row here)
    assert (
        "trains 3 step(s)" in text
        and "After the first step alone, under glibc's default: small 12.90, large 12.30" in text
    )
    # (12.4*300 - 13.0*100) / 200 = 12.10; (12.3*300 - 12.6*100) / 200 = 12.15; (12.2*300 -
    # 12.5*100) / 200 = 12.05
    assert (
        "From small to large each added parameter cost 12.10 B (12.15 with the threshold "
        "fixed; predicted 12.05)"
    ) in text
    # an NVMe row against the same layout in host memory: what moved off the host
    disk = dict(row("small", 100, True, 0.5, 0.9, 0.7), nvme=True, disk_per_param=12.01)
    text = bh.render([*rows, disk], "python -m tools.bench host --write")
    assert "| none (homeless, 1 slot); master and moments on disk |" in text
    assert (
        "peak 0.90 B per parameter (predicted 0.50) with master and moments on disk against "
        "13.00 in host memory, a drop of 12.10 B (whole-process peaks 0.90 and 13.00; 11.90 "
        "with the threshold fixed)"
    ) in text


def test_bench_host_device_rows(tmp_path, capsys):
    # tools/bench/host.py --row/--device rows (tools/gpu_check.sh's host bytes step) as a
    # table from a --jsonl file; --write refuses them (it replaces the CPU table only).
    from tools.bench import host as bh

    row = dict(
        device="cuda",
        model="gpt2-medium",
        params=354_823_168,
        dtype="bfloat16",
        homeless=True,
        predicted_per_param=12.31,
        measured_per_param=16.2,
        train_peak_per_param=12.40,
        train_peak_mmap_per_param=12.38,
        first_step_per_param=12.35,
        file_growth_per_param=0.04,
        step_s=0.51,
    )
    jsonl = tmp_path / "host.jsonl"
    jsonl.write_text(
        json.dumps(row)
        + "\n"
        + json.dumps(
            {**row, "model": "gpt2-large", "nvme": True, "train_peak_mmap_per_param": None}
        )
        + "\n"
    )
    assert bh.main(["--report", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Host bytes per offloaded parameter, cuda")
    assert (
        "| cuda | gpt2-medium | 355M | bfloat16 | none | 12.31 | 16.20 | 12.40 | 1.007 | 12.38 "
        "| 12.35 | 0.04 | 0.51 |"
    ) in out
    assert (
        "| cuda | gpt2-large | 355M | bfloat16 | none; disk | 12.31 | 16.20 | 12.40 | 1.007 | - |"
        in out
    )
    with pytest.raises(SystemExit, match="--write replaces the CPU table"):
        bh.main(["--device", "cuda", "--write"])
    with pytest.raises(SystemExit, match="expected MODEL,DTYPE"):
        bh.main(["--row", "gpt2-medium,bfloat16"])


def test_bench_host_measures_on_the_device_it_is_given(tmp_path, monkeypatch, capsys):
    # The GPU run (tools/gpu_check.sh) cannot run here: what it rests on is checked on its
    # own. Each row's two processes get the device and the two allocators; a row whose
    # process fails is skipped with the others kept and the run failed; on a GPU nothing of
    # the device's is subtracted from the host's peak.
    import subprocess as sp

    from tools.bench import host as bh

    assert bh.host_share(7, "cuda") == 0 and bh.host_share(7, "cpu") == 7
    calls = []

    def fake_run(cmd, stdout, text, env, cwd=None):
        calls.append((cmd, env))
        case = cmd[cmd.index("--case") + 1]
        if case.startswith("broken"):
            return sp.CompletedProcess(cmd, 1, stdout="")
        row = dict(
            device=cmd[cmd.index("--device") + 1],
            model=case.split(",")[0],
            params=1,
            dtype="bfloat16",
            homeless=True,
            predicted_per_param=12.0,
            measured_per_param=12.5 if not env.get("MALLOC_MMAP_THRESHOLD_") else 12.1,
            train_peak_per_param=12.5,
            first_step_per_param=12.4,
            step_s=1.0,
        )
        return sp.CompletedProcess(cmd, 0, stdout="log line\n" + json.dumps(row) + "\n")

    monkeypatch.setattr(bh.subprocess, "run", fake_run)
    jsonl = tmp_path / "host.jsonl"
    assert (
        bh.main(
            [
                "--device",
                "cuda",
                "--row",
                "gpt2-medium,bfloat16,1,1,0",
                "--row",
                "broken,bfloat16,1,1,0",
                "--row",
                "gpt2-large,bfloat16,1,1,0",
                "--jsonl",
                str(jsonl),
            ]
        )
        == 1
    )
    assert all(c[c.index("--device") + 1] == "cuda" for c, _ in calls)
    # (the broken row stops after its first process)
    assert [
        (c[c.index("--case") + 1].split(",")[0], e.get("MALLOC_MMAP_THRESHOLD_")) for c, e in calls
    ] == [
        ("gpt2-medium", None),
        ("gpt2-medium", "1048576"),
        ("broken", None),
        ("gpt2-large", None),
        ("gpt2-large", "1048576"),
    ]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["model"], r["device"], r["measured_mmap_per_param"]) for r in rows] == [
        ("gpt2-medium", "cuda", 12.1),
        ("gpt2-large", "cuda", 12.1),
    ]
    out = capsys.readouterr()
    assert "broken,bfloat16,1,1,0 on cuda failed" in out.err and "1 of 3 rows failed" in out.err
    assert "| cuda | gpt2-large |" in out.out


@pytest.mark.slow
def test_bench_moe_spread_reports_each_run_and_the_ranges():
    """One run of the probed-CPU fixture in a fresh process: its ratios, and the section's table."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "moe-spread", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PROTRAIN_PROBED_ROUNDS": "1"},  # the report's shape, not its figures
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("run 1: ") and "MoE/dense paired" in out, out
    assert "| MoE/dense forward, paired | " in out and "| check | range |" in out, out
