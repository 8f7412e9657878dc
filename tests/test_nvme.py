"""nvme.py [Note: NVMe tier]: offloaded chunks whose fp32 master and Adam moments live in a
file on disk (``placement.nvme``). The tier moves bytes, never the math: fp32 plans train
bit for bit as plain PyTorch, 16-bit ones bit for bit as the same plan with host states;
the host keeps what accounting.py says (12 B per element less), and the file's pages do
not stay in the process beyond ``NVME_WINDOW``."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from pathlib import Path

import msgspec
import pytest
import torch
from harness import (
    CONFIGS,
    assert_same_state,
    assert_same_training,
    lockstep,
    make_model,
    make_plan,
    stop_and_resume,
    train_engine,
)

from protrain import plans
from protrain.executor import AdamWConfig, chunks, nvme, optim, wrap
from protrain.planner.models.data import batches, load_tokens
from protrain.planner.models.zoo import GPT2Config
from protrain.planner.search import memory_walk
from protrain.plans import accounting, homes
from protrain.plans import accounting as A
from protrain.plans.errors import ConfigError, HostMemoryError, PlanError
from tools.emulation import emulate

CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)
V6_FIXTURE = Path(__file__).parent / "fixtures" / "plans" / "v6" / "gpt2-tiny-nvme.json"


def _pieces(monkeypatch, n=192):
    """Pieces of 3 AdamW vectors: every parameter steps, rounds and refreshes in many pieces."""
    for mod in (homes, optim, nvme, chunks):
        monkeypatch.setattr(mod, "STEP_PIECE", n)


STEPS = 4


def _train(model, plan, steps=None, data=None, nvme_dir=None, config=CONFIG):
    return train_engine(model, plan, steps or STEPS, data, nvme_dir, config)


@pytest.mark.parametrize(
    "model,persistent,policies,which,asynchronous",
    [
        ("gpt2-4", [0], "keep swap checkpoint keep", "all", False),
        pytest.param(
            "gpt2-4", [0], "keep swap checkpoint keep", "all", True, marks=pytest.mark.slow
        ),  # (22 s)
        ("llama-4", [], "swap checkpoint keep swap", [0, 2, 3], False),
        pytest.param(
            "llama-4", [], "swap checkpoint keep swap", [0, 2, 3], True, marks=pytest.mark.slow
        ),  # (17 s)
    ],
)
def test_fp32_nvme_chunks_train_exactly_as_plain_pytorch(
    model, persistent, policies, which, asynchronous, tmp_path, monkeypatch
):
    _pieces(monkeypatch)
    plan = make_plan(model, persistent=persistent, n_buffer=2, policies=policies, nvme=which)
    with emulate(5) if asynchronous else contextlib.nullcontext():
        run = lockstep(model, plan, steps=6, nvme_dir=tmp_path)
    assert run.losses == run.ref_losses
    assert_same_state(run)
    # fp32: the home is the master, on the disk with the moments; the accumulator stays
    kept = make_plan(model, persistent=persistent, n_buffer=2, policies=policies)
    moved = sum(accounting.host_numel(plan, c) for c in plan.placement.nvme)
    assert run.engine.ledger.host_bytes == memory_walk.walk(plan).host_bytes
    assert (
        memory_walk.walk(kept).host_bytes - memory_walk.walk(plan).host_bytes
        == 12 * moved - accounting.NVME_WINDOW
    )
    assert memory_walk.walk(plan).disk_bytes == 3 * sum(
        accounting.nvme_span(accounting.host_numel(plan, c)) for c in plan.placement.nvme
    )
    assert list(tmp_path.iterdir()) == []  # the file is unlinked from the start


@pytest.mark.parametrize("policies", ["keep", "checkpoint"])
def test_bf16_nvme_chunks_train_bit_for_bit_as_host_states(policies, tmp_path, monkeypatch):
    """16-bit: homes kept, homeless, and homeless on disk, beside each other; accumulated
    gradients too (the fp32 accumulator read in place). All as host states, bit for bit."""
    _pieces(monkeypatch)
    kw = dict(persistent=[0], n_buffer=2, policies=policies, compute_dtype="bfloat16")
    want = _train(make_model("gpt2-4"), make_plan("gpt2-4", **kw))
    for extra in (
        dict(nvme="all"),
        dict(homeless="all", nvme="all"),
        dict(homeless=[1, 2], nvme=[2, 3]),
    ):
        plan = make_plan("gpt2-4", **kw, **extra)
        with emulate(3):
            got = _train(make_model("gpt2-4"), plan, nvme_dir=tmp_path)
        assert_same_training(got, want)
        assert got[2] == memory_walk.walk(plan).host_bytes
    accum = dict(kw, grad_accum=2)
    want = _train(
        make_model("gpt2-4"), make_plan("gpt2-4", **accum), data=batches(load_tokens(), 4, 32, 0)
    )
    got = _train(
        make_model("gpt2-4"),
        make_plan("gpt2-4", **accum, nvme=[1, 3]),
        nvme_dir=tmp_path,
        data=batches(load_tokens(), 4, 32, 0),
    )
    assert_same_training(got, want)


def _mapped_bytes(engine) -> int:
    """Resident bytes of the engine's NVMe file in this process (/proc/self/smaps)."""
    disk = engine.store.disk
    if not hasattr(disk, "inode"):
        disk.inode = os.fstat(
            disk.file.fileno()
        ).st_ino  # (kept: the descriptor closes before the mapping)
    inode = disk.inode
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            mine = head[4] == str(inode)
        elif mine and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.parametrize(
    "dtype,homeless",
    [("bfloat16", ()), pytest.param("bfloat16", "all", marks=pytest.mark.slow), ("float32", ())],
)
def test_the_file_stays_on_disk_beyond_the_window(dtype, homeless, tmp_path, monkeypatch):
    """What keeps the states off the host is ``drop`` after each piece: at every event of a
    step (fetch, offload, CPU step) and just before every drop in a step, the file's pages mapped in
    this process stay within ``NVME_WINDOW``, though the states (and each chunk's shard, 8M
    elements) are many times larger. fp32: the fetch uploads the home from the file."""
    monkeypatch.setitem(
        CONFIGS,
        "gpt2-wide",
        GPT2Config(n_layer=3, n_head=4, n_embd=384, vocab_size=256, block_size=64),
    )
    plan = make_plan(
        "gpt2-wide",
        persistent=[],
        n_buffer=2,
        policies="checkpoint",
        compute_dtype=dtype,
        chunk_numel=1 << 23,
        nvme="all",
        homeless=homeless,
    )
    assert memory_walk.walk(plan).disk_bytes > 3 * accounting.NVME_WINDOW
    engine = wrap(make_model("gpt2-wide"), plan, CONFIG, device="cpu", nvme_dir=tmp_path)
    seen = [_mapped_bytes(engine)]
    engine.on_event(lambda ev: seen.append(_mapped_bytes(engine)))
    drop = nvme.DiskStates.drop
    monkeypatch.setattr(
        nvme.DiskStates,
        "drop",
        lambda self, *ts: (seen.append(_mapped_bytes(engine)), drop(self, *ts)),
    )
    data = batches(load_tokens(), 4, 32, 0)
    for _ in range(2):
        engine.step(next(data))
    assert len(seen) > 20 and max(seen) <= accounting.NVME_WINDOW, max(seen)
    monkeypatch.setattr(nvme.DiskStates, "drop", drop)
    sd = engine.state_dict()  # (a checkpoint reads one chunk's states at a time, then drops them)
    assert sd["optim"] and _mapped_bytes(engine) <= accounting.NVME_WINDOW
    engine.close()
    assert engine.store.disk.file.closed and _mapped_bytes(engine) == 0  # (close drops it all)


def test_no_space_for_the_file_is_an_error_at_wrap(tmp_path, monkeypatch):
    """The file's blocks are reserved at wrap (posix_fallocate): a full disk is a ConfigError
    there, not a SIGBUS at a page's first write inside a step."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme.os, "posix_fallocate", full)
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", nvme=[1, 2])
    with pytest.raises(ConfigError, match="No space left on device"):
        wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu", nvme_dir=tmp_path)


def test_a_checkpoint_moves_between_disk_and_host_states(tmp_path):
    nv = make_plan(
        "gpt2-4", persistent=[0], n_buffer=2, policies="keep checkpoint keep swap", nvme="all"
    )
    host = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep checkpoint keep swap")
    straight = _train(make_model("gpt2-4"), host)
    for first, second in ((nv, host), (host, nv)):
        losses, sd = stop_and_resume(first, second, tmp_path / "ck", CONFIG, nvme_dir=tmp_path)
        assert losses == straight[0]
        for name, t in straight[1]["model"].items():
            assert torch.equal(sd["model"][name], t), name


def test_refusals_name_the_field_and_the_fix(tmp_path):
    plan = make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", nvme=[1, 2])
    with pytest.raises(ConfigError, match=r"placement\.nvme.*(\n|.)*--nvme DIR"):
        wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu")
    with pytest.raises(ConfigError, match="does not exist"):
        wrap(make_model("gpt2-4"), plan, CONFIG, device="cpu", nvme_dir=tmp_path / "nope")
    with pytest.raises(PlanError, match=r"placement\.nvme"):
        make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", nvme=[0])  # persistent
    with pytest.raises(PlanError, match="device-homed"):
        make_plan("gpt2-4", persistent=[0], n_buffer=2, policies="keep", nvme=[1], device_homed=[1])


def test_a_frozen_nvme_chunk_keeps_its_values_home_on_the_host(tmp_path):
    """Fine-tuning freezes the embeddings, which the planner (planning every parameter
    trainable) may have put on disk: the chunk has no master or moments, so its home stays
    in host memory, as accounting.py counts (the ledger checked wrap), and training is
    plain PyTorch's."""
    plan = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep", nvme=[0, 1])

    def frozen():
        m = make_model("gpt2-4")
        for p in (*m.transformer.wte.parameters(), *m.transformer.wpe.parameters()):
            p.requires_grad_(False)
        return m

    host = make_plan("gpt2-4", persistent=[], n_buffer=2, policies="keep")
    a, b = _train(frozen(), host), _train(frozen(), plan, nvme_dir=tmp_path)
    assert_same_training(a, b)
    assert "transformer.wte.weight" not in b[1]["optim"]
    engine = wrap(frozen(), plan, CONFIG, device="cpu", nvme_dir=tmp_path)
    c0, c1 = engine.store.chunks[:2]
    assert not c0.trainable and c0.home.data_ptr() not in range(
        engine.store.disk.base, engine.store.disk.base + engine.store.disk.nbytes
    )
    assert c1.trainable and c1.home is engine.optim.master[1]  # fp32: on the disk
    engine.close()


def test_the_v6_fixture_trains_as_with_host_states(tmp_path):
    """The frozen v6 fixture (gpt2-tiny, bf16, chunks on disk, one homeless) against the same
    plan with every state on the host: bit for bit. And a v5 plan migrates with none on disk."""
    plan = plans.load(V6_FIXTURE)
    assert plan.placement.nvme and json.loads(V6_FIXTURE.read_bytes())["schema_version"] == 6
    off_disk = {"nvme": "host", "nvme_homeless": "homeless"}
    host = msgspec.structs.replace(
        plan,
        placement=msgspec.structs.replace(
            plan.placement, homes=[off_disk.get(h, h) for h in plan.placement.homes]
        ),
    )
    from protrain.planner.models.zoo import build

    data = [next(batches(load_tokens(), 4, 64, 0)) for _ in range(3)]
    torch.manual_seed(0)
    model = build("gpt2-tiny", device="cpu")
    import copy

    assert_same_training(
        _train(copy.deepcopy(model), plan, 3, iter(data), tmp_path),
        _train(copy.deepcopy(model), host, 3, iter(data)),
    )
    v5 = plans.load(
        Path(__file__).parent / "fixtures" / "plans" / "v5" / "gpt2-tiny-device-homed.json"
    )
    assert v5.placement.nvme == []


# -- the planner: host_tiers.py [NVMe tier]


def _profile(disk_gbps: float | None = 3.0):
    from protrain.planner.profiling.profile import load_profile

    root = Path(__file__).resolve().parent.parent
    prof = load_profile(root / "plans/profiles/gpt2-xl/gpt2-xl-rtx3090-b8-s1024.json")
    if disk_gbps is None:
        return prof
    spec = msgspec.structs.replace(
        prof.hardware,
        disk_read_bytes_per_s=int(disk_gbps * 1e9),
        disk_write_bytes_per_s=int(disk_gbps * 1e9 / 2),
    )
    return msgspec.structs.replace(prof, hardware=spec)


@functools.cache
def _half_host() -> int:
    """Half the host bytes gpt2-xl's plan needs on an rtx3090 at 22 GiB with the host
    unbounded: a host budget that binds (the planner tests below share it)."""
    from protrain.planner.search.planning import make_plan

    roomy, _ = make_plan(_profile(), 22 * 2**30, host_budget_bytes=2**40)
    return int(memory_walk.walk(roomy).host_bytes * 0.5)


def test_the_disk_takes_what_homeless_chunks_leave():
    """Under a host cap that every offloaded chunk homeless still misses, the fewest chunks
    (last in execution order first) go to disk instead of the device: the host need fits by
    their 12 B per element less and the window more, the device carries nothing more, and
    the CPU timeline carries their disk traffic (12 B read + 12 B written per element per
    step, 4 B read per fetch of a homeless one); an explicit prediction of the same sets
    gives the same numbers, and host bytes equal accounting.py's for the emitted plan."""
    from protrain.planner.search.cost import (
        choose_chunk_numel,
        evaluate,
        facts_from_profile,
        host_need,
        make_terms,
        policy_grid,
        predict_plan,
    )

    prof = _profile()
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size, world_size=1, nvme=True)
    assert t.nvme_ok and t.disk_step_us_per_elem == pytest.approx(12e6 / 3e9 + 12e6 / 1.5e9)
    grid = policy_grid(t.n_blocks, [(0, t.n_blocks)])
    nb = 2
    _, peak0, free = evaluate(t, 0, nb, grid)
    all_homeless = (
        float(free["host_bytes"][0])
        - float(t.host_numel.sum()) * t.home_bytes_per_elem
        + t.slot_pool_bytes
    )
    cap = 0.6 * all_homeless
    time, peak, parts = evaluate(t, 0, nb, grid, host_cap=cap)
    kn, k = int(parts["n_nvme"][0]), int(parts["n_homeless"][0])
    assert 0 < kn < t.n_chunks and k == t.n_chunks and parts["n_device_homed"][0] == 0
    assert host_need(parts)[0] <= cap and peak[0] == peak0[0]
    on_disk = list(range(t.n_chunks))[-kn:]  # the last in execution order
    moved = sum(int(t.host_numel[c]) for c in on_disk)
    assert parts["host_bytes"][0] == pytest.approx(all_homeless - 12 * moved + A.NVME_WINDOW)
    homeless = list(range(t.n_chunks))
    host_only = predict_plan(t, [], nb, ["checkpoint"] * t.n_blocks, homeless, [])
    assert parts["t_cpu_optim_us"][0] == pytest.approx(
        host_only.breakdown["t_cpu_optim_us"] + moved * t.disk_step_us_per_elem
    )
    assert parts["t_fwd_us"][0] > host_only.breakdown["t_fwd_us"]  # their fetches read the disk
    again = predict_plan(t, [], nb, ["checkpoint"] * t.n_blocks, homeless, [], on_disk)
    assert (again.time_us, again.peak_bytes) == (float(time[0]), float(peak[0]))
    assert again.breakdown["host_bytes"] == float(parts["host_bytes"][0])


def test_plan_with_nvme_fits_a_host_that_refuses_it_without(tmp_path):
    """make_plan(nvme=True): where the host binds, the search weighs device homes against the
    disk (search.py ``_evaluate``). With room on the card the device homes win (no disk
    traffic: the plan without --nvme, 2.57 s against 4.69 s with the disk in their place); at a
    budget that refuses every plan without the disk, the plan keeps states on disk, its predicted
    host need accounting.py's and within the cap. A spec without the disk measured is refused,
    naming the probe."""
    from protrain.planner.search.planning import make_plan

    prof, cap = _profile(), _half_host()
    homes, _ = make_plan(prof, 22 * 2**30, host_budget_bytes=cap)
    either, _ = make_plan(prof, 22 * 2**30, host_budget_bytes=cap, nvme=True)
    assert homes.placement.device_homed and either.placement == homes.placement
    assert either.prediction == homes.prediction
    with pytest.raises(HostMemoryError):
        make_plan(prof, 16 * 2**30, host_budget_bytes=cap)
    plan, _ = make_plan(prof, 16 * 2**30, host_budget_bytes=cap, nvme=True)
    assert plan.placement.nvme and not plan.placement.device_homed
    walk = memory_walk.walk(plan)
    assert walk.host_bytes == plan.prediction.breakdown["host_bytes"] <= cap
    assert walk.disk_bytes >= 12 * sum(accounting.host_numel(plan, c) for c in plan.placement.nvme)
    assert plan.prediction.iter_time_us > homes.prediction.iter_time_us
    with pytest.raises(ConfigError, match="hardware probe --nvme"):
        make_plan(_profile(None), 22 * 2**30, host_budget_bytes=cap, nvme=True)


def test_the_search_weighs_the_disk_against_device_homes():
    """Where both could hold what homeless chunks leave, the faster plan that fits wins
    (search.py ``_evaluate``, per configuration): device homes against a 3 GB/s disk (their
    steps cost no disk traffic), the disk at 300 GB/s (its CPU steps overlap backward and it
    takes no device memory, so fewer chunks need offloading): 2.57 s and 2.47 s planned
    here, the latter faster than the best plan without a disk. At the chosen configuration
    the other tier (the terms with or without the disk) is slower or does not fit."""
    import dataclasses

    from protrain.planner.search.cost import make_terms, predict
    from protrain.planner.search.planning import make_plan

    prof, cap = _profile(), _half_host()
    for gbps, tier, other in ((3, "device_homed", "nvme"), (300, "nvme", "device_homed")):
        spec = msgspec.structs.replace(
            prof.hardware,
            disk_read_bytes_per_s=int(gbps * 1e9),
            disk_write_bytes_per_s=int(gbps * 1e9),
        )
        fast = msgspec.structs.replace(prof, hardware=spec)
        plan, _ = make_plan(fast, 22 * 2**30, host_budget_bytes=cap, nvme=True)
        assert getattr(plan.placement, tier) and not getattr(plan.placement, other), gbps
        t = make_terms(fast, plan.chunks.chunk_numel, 1, plan.schedule.cpu_adam, 1, nvme=True)
        c = plan.provenance.search.chosen
        homes = dataclasses.replace(t, nvme_ok=False)
        mine, theirs = (homes, t) if tier == "device_homed" else (t, homes)
        chosen = predict(mine, c.n_persist, c.n_buffer, c.n_swap, c.n_checkpoint, cap)
        alternative = predict(theirs, c.n_persist, c.n_buffer, c.n_swap, c.n_checkpoint, cap)
        assert round(chosen.time_us) == plan.prediction.iter_time_us
        host = alternative.breakdown["host_bytes"] + alternative.breakdown["host_swap_bytes"]
        assert (
            alternative.time_us > chosen.time_us
            or alternative.peak_bytes > 22 * 2**30
            or host > cap
        ), gbps
        assert alternative.breakdown["n_device_homed" if tier == "nvme" else "n_nvme"] > 0
    without, _ = make_plan(prof, 22 * 2**30, host_budget_bytes=cap)  # (the spec's disk unused)
    assert plan.prediction.iter_time_us < without.prediction.iter_time_us  # (the 300 GB/s one)


def test_the_faster_tier_that_fits_per_strip():
    """search.py ``_evaluate``, the rule itself: per strip, of the disk and device homes
    the faster that fits, else the disk. Device homes step on compute; made 1000x slower
    there, the disk wins where both fit; at a budget below the device homes' peak the disk
    wins however fast they are."""
    import dataclasses

    from protrain.planner.search.cost import (
        choose_chunk_numel,
        evaluate,
        facts_from_profile,
        make_terms,
        policy_grid,
    )
    from protrain.planner.search.exhaustive import _evaluate

    prof = _profile(300)
    size, _ = choose_chunk_numel(facts_from_profile(prof))
    t = make_terms(prof, size, world_size=1, nvme=True)
    grid = policy_grid(t.n_blocks, [(0, t.n_blocks), (0, 0)])
    _, _, free = evaluate(t, 0, 2, grid)
    cap = 0.6 * (
        float(free["host_bytes"][0])
        - float(t.host_numel.sum()) * t.home_bytes_per_elem
        + t.slot_pool_bytes
    )
    picked = set()
    for slow, budget in ((1, math.inf), (1000, math.inf), (1, "below")):
        tt = dataclasses.replace(t, homed_adam_us_per_param=t.homed_adam_us_per_param * slow)
        disk = evaluate(tt, 0, 2, grid, cap)
        homes = evaluate(dataclasses.replace(tt, nvme_ok=False), 0, 2, grid, cap)
        assert (disk[2]["n_nvme"] > 0).all() and (homes[2]["n_device_homed"] > 0).all()
        if budget == "below":
            budget = float(homes[1].min()) - 1
        time, peak, parts = _evaluate(tt, 0, 2, grid, cap, budget)
        for j in range(len(time)):
            use = homes if homes[1][j] <= budget and homes[0][j] < disk[0][j] else disk
            assert (time[j], peak[j], parts["n_nvme"][j]) == (
                use[0][j],
                use[1][j],
                use[2]["n_nvme"][j],
            )
            picked.add("homes" if use is homes else "disk")
    assert picked == {"homes", "disk"}


def test_predicted_trace_charges_the_disk():
    """`protrain trace` of a plan with chunks on disk: each one's CPU step carries its disk
    traffic, each homeless upload waits for its rounding (and disk read) on the main thread,
    and the trace agrees with the prediction as for any plan (0.96; it read 0.24 without them)."""
    from test_trace import TOLERANCE, TRACKS, x_events

    from protrain.planner.search.planning import make_plan
    from protrain.planner.views.trace import predicted_trace

    prof = _profile()
    plan, _ = make_plan(
        prof, 16 * 2**30, host_budget_bytes=_half_host(), nvme=True
    )  # (16 GiB: no room for device homes)
    on_disk, homeless = plan.placement.nvme, plan.placement.homeless
    assert on_disk and set(on_disk) <= set(homeless)
    doc = predicted_trace(prof, plan)
    steps = {e["args"]["chunk"]: e["dur"] for e in x_events(doc, TRACKS["CPU Adam"])}
    c0 = min(set(steps) - set(on_disk))  # a chunk in host memory: its AdamW alone
    per_param = steps[c0] / sum(p.numel for p in plan.chunks.items[c0].params)
    for c in on_disk:
        adam = per_param * sum(p.numel for p in plan.chunks.items[c].params)
        disk = accounting.host_numel(plan, c) * (12 / 3e9 + 12 / 1.5e9) * 1e6
        assert steps[c] == pytest.approx(adam + disk, rel=1e-3)
    rounds = [
        e["args"]["chunk"]
        for e in x_events(doc, TRACKS["compute"])
        if e["name"].startswith("round ")
    ]
    uploads = [
        e["args"]["chunk"]
        for e in x_events(doc, TRACKS["H2D"])
        if e["name"].startswith(("fetch ", "prefetch "))
    ]
    assert sorted(rounds) == sorted(c for c in uploads if c in homeless)
    converted = sum(
        e["dur"] for e in x_events(doc, TRACKS["compute"]) if e["name"].startswith("round ")
    )
    assert converted == pytest.approx(plan.prediction.breakdown["t_convert_us"], rel=1e-3)
    low, high = TOLERANCE["gpu"]
    assert low <= doc["metadata"]["trace_iter_time_us"] / plan.prediction.iter_time_us <= high


def test_cli_plans_for_a_disk_and_trains_with_it(tmp_path):
    """`hardware probe --nvme DIR` measures the disk into the spec, `plan --nvme` uses it where
    the host binds, `train --nvme DIR` runs it (and refuses the plan without a directory)."""
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main
    from protrain.planner.hardware.spec import load_spec

    run = CliRunner().invoke
    r = run(
        main,
        [
            "plan",
            "--model",
            "gpt2-tiny",
            "--hardware",
            "cpu",
            "--batch",
            "4",
            "--seq",
            "64",
            "--nvme",
            "-o",
            str(tmp_path / "p.json"),
        ],
    )
    assert r.exit_code == 1 and "hardware probe --nvme" in r.output
    spec = msgspec.structs.replace(
        load_spec(Path(__file__).resolve().parent.parent / "plans/hardware/cpu.json"),
        disk_read_bytes_per_s=2 * 10**9,
        disk_write_bytes_per_s=10**9,
    )
    (tmp_path / "disk.json").write_bytes(msgspec.json.encode(spec))
    # gpt2 (124M), bf16: with the host at 1.2 GB, its chunks' states go partly to the disk
    plan_args = [
        "plan",
        "--model",
        "gpt2",
        "--hardware",
        str(tmp_path / "disk.json"),
        "--batch",
        "1",
        "--seq",
        "256",
        "--dtype",
        "bfloat16",
        "--budget",
        "600MiB",
        "--host-memory",
        "1200MiB",
    ]
    r = run(main, [*plan_args, "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 1 and "host memory" in r.output  # (no disk: no plan)
    r = run(main, [*plan_args, "--nvme", "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert plans.load(tmp_path / "p.json").placement.nvme
    assert "on disk (master and moments in a file: train with --nvme DIR)" in r.output  # (show)
    train = ["train", "--plan", str(V6_FIXTURE), "--model", "gpt2-tiny", "--steps", "2"]
    r = run(main, train)
    assert r.exit_code == 1 and "--nvme DIR" in r.output
    r = run(main, [*train, "--nvme", str(tmp_path / "states")])
    assert r.exit_code == 0 and "trained 2 steps" in r.output, r.output
    assert list((tmp_path / "states").iterdir()) == []
