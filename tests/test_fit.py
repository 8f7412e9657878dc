"""``protrain fit``: the ladders, and the largest fitting model on a small synthetic card."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
from planfactory import gpu_spec

from protrain.planner.commands.fit import (
    gpt2_ladder,
    host_need_bytes,
    largest_fitting,
    llama_ladder,
    n_params,
    run_fit,
)
from protrain.planner.hardware.spec import dump_spec
from protrain.planner.hardware.units import human_bytes
from protrain.planner.models.zoo import GPT2, ZOO, GPT2Config, Llama, count_params
from protrain.plans import validation as V
from protrain.plans.errors import BudgetError, ConfigError

GiB = 2**30

# A 2 GiB "GPU" with 8 GiB of host memory: small enough that the fitting models are a
# few hundred million parameters (each analytic profile well under 2 s), and both
# limits (device memory, host memory) are met across the budgets below.
SMALL = msgspec.structs.replace(gpu_spec(mem_gib=2), name="small-2g", host_memory_bytes=8 * GiB)
SEQ = 256
MICRO = (1, 2, 4)


def test_ladders_grow_and_pass_through_the_zoo():
    for ladder in (gpt2_ladder(), llama_ladder()):
        sizes = [n_params(c) for c in ladder]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    gpt2 = gpt2_ladder()
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-4b", "gpt2-10b"):
        assert ZOO[name] in gpt2, name
    for name in ("llama-7b", "llama-13b", "llama-70b"):
        assert ZOO[name] in llama_ladder(), name
    assert (
        dataclasses.replace(ZOO["llama-34b"], max_seq_len=4096, rope_theta=10000.0)
        in llama_ladder()
    )
    assert {c.block_size for c in gpt2_ladder(2048)} == {2048}


def test_parameter_count_formula_is_the_models():
    sample = gpt2_ladder()[::12] + llama_ladder()[::6]
    for cfg in sample:
        with torch.device("meta"):
            model = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
        assert n_params(cfg) == count_params(model), cfg


@pytest.mark.slow
def test_largest_gpt2_grows_with_the_budget():
    results = [
        largest_fitting("gpt2", SMALL, budget_bytes=b, seq_len=SEQ, micro_batches=MICRO)
        for b in (GiB // 2, GiB, 2 * GiB)
    ]
    sizes = [r.n_params for r in results]
    assert sizes == sorted(sizes), sizes  # a bigger budget never fits a smaller model
    assert sizes[0] < sizes[-1]
    ladder = gpt2_ladder(SEQ)
    for r, budget in zip(results, (GiB // 2, GiB, 2 * GiB)):
        plan = r.plan
        V.validate(plan)  # a well-formed plan …
        assert plan.prediction.peak_memory_bytes <= budget  # … that fits the device …
        assert r.host_bytes <= SMALL.host_memory_bytes  # … and the host
        assert plan.training.micro_batch == r.micro_batch in MICRO
        assert r.n_params == plan.model.n_params == n_params(r.config)
        assert r.tokens_per_s == pytest.approx(r.micro_batch * SEQ / (r.iter_time_us / 1e6))
        # The next rung was ruled out, for a reason that names the memory that ran out.
        nxt = r.next_config  # the next rung, or a deeper model of this width ([Between rungs])
        assert nxt in ladder or dataclasses.replace(nxt, n_layer=nxt.n_layer - 1) == r.config
        assert not any(p.fits for p in r.probes if p.config == nxt)
        assert r.limit.startswith(("device memory", "host memory")), r.limit
        # A larger micro-batch than the one chosen did not fit (or none was offered).
        bigger = [p for p in r.probes if p.config == r.config and p.micro_batch > r.micro_batch]
        assert all(not p.fits for p in bigger)
    assert {r.limit.split(":")[0] for r in results} == {"device memory", "host memory"}


def test_fit_refines_between_rungs_by_depth(monkeypatch):
    """[Between rungs] in fit.py: past the largest fitting rung, deeper models of its width
    that stay below the next rung are bisected; the answer is the deepest that fits, and
    the next size up is one layer more. A stand-in probe fits every model up to a size
    between two rungs."""
    import protrain.planner.commands.fit as F
    from protrain import plans

    ladder = gpt2_ladder(SEQ)
    rung, after = ladder[70], ladder[71]
    cap = (n_params(rung) + n_params(after)) // 2
    plan = plans.load(
        Path(__file__).parent / "fixtures" / "plans" / "v5" / "gpt2-tiny-device-homed.json"
    )
    monkeypatch.setattr(F, "_host_floor_bytes", lambda *a, **k: 0)
    monkeypatch.setattr(
        F,
        "_probe",
        lambda cfg, mb, **kw: F.Probe(
            cfg,
            n_params(cfg),
            mb,
            n_params(cfg) <= cap,
            "fits" if n_params(cfg) <= cap else "device memory: no",
            0.0,
            plan if n_params(cfg) <= cap else None,
        ),
    )
    r = largest_fitting("gpt2", SMALL, seq_len=SEQ, micro_batches=(1,))
    assert r.config.n_embd == rung.n_embd and r.config.n_layer > rung.n_layer
    assert n_params(r.config) <= cap < n_params(r.next_config) < n_params(after)
    assert r.next_config == dataclasses.replace(r.config, n_layer=r.config.n_layer + 1)
    assert r.limit == "device memory: no"


def test_run_fit_prints_one_row_per_family(tmp_path):
    path = tmp_path / "small.json"
    path.write_bytes(dump_spec(SMALL))
    lines: list[str] = []
    (r,) = run_fit(
        str(path),
        budget="1GiB",
        seq_len=SEQ,
        families=("gpt2",),
        micro_batches=MICRO,
        echo=lines.append,
    )
    table = lines[-1].splitlines()
    # 8 GiB of host RAM, one rank: 8 x 0.9 - 2 = 5.2 GiB usable (planning.default_host_budget).
    assert table[0].startswith(
        "fit on small-2g: 1.00 GiB device budget per rank, 8.00 GiB host RAM "
        "(5.20 GiB per rank usable), seq 256"
    )
    assert table[0].endswith("one device")
    assert table[1].split()[:4] == ["family", "params", "shape", "micro-batch"]
    assert table[3].startswith("gpt2") and f"{r.n_params / 1e9:.2f}B" in table[3]
    # What binds at the winner (with both shares), and what stopped the next size up.
    assert table[-1].startswith(
        f"gpt2: binds {r.binds}; next size ({n_params(r.next_config) / 1e9:.2f}B) "
        f"stopped by {r.limit}"
    )
    assert r.binds.startswith(("device memory (", "host memory (")) and r.next_binds in (
        "device memory",
        "host memory",
    )


def test_host_budget_per_rank_is_the_share_less_the_reserve():
    # --host-memory SIZE --world-size N: each rank gets SIZE / N, less 10% and 2 GiB, the
    # rule a spec's own host RAM gets at one rank.
    from protrain.planner.search.planning import default_host_budget, host_budget_per_rank

    assert host_budget_per_rank(384 * GiB, 4) == int(96 * GiB * 0.9) - 2 * GiB
    assert host_budget_per_rank(384 * GiB) == int(384 * GiB * 0.9) - 2 * GiB
    assert default_host_budget(SMALL) == host_budget_per_rank(SMALL.host_memory_bytes, 1)
    assert host_budget_per_rank(GiB, 8) == 0  # less than the reserve: nothing, never negative


@pytest.mark.slow  # (25 s: two ladders)
def test_more_ranks_shard_the_host():
    # The same host RAM per rank (8 GiB for one, 32 GiB for four): offloaded states
    # shard over the ranks (ZeRO-3), so four ranks fit a larger model.
    from protrain.planner.commands.fit import _host_floor_bytes

    one = largest_fitting(
        "gpt2", SMALL, budget_bytes=GiB, seq_len=SEQ, micro_batches=MICRO, host_memory_bytes=8 * GiB
    )
    four = largest_fitting(
        "gpt2",
        SMALL,
        budget_bytes=GiB,
        seq_len=SEQ,
        micro_batches=MICRO,
        host_memory_bytes=32 * GiB,
        world_size=4,
    )
    assert one.host_budget_bytes == four.host_budget_bytes == int(8 * GiB * 0.9) - 2 * GiB
    assert four.n_params > one.n_params
    for r, world in ((one, 1), (four, 4)):
        assert r.plan.training.world_size == r.plan.request.world_size == world
        assert r.peak_bytes <= GiB and r.host_bytes <= r.host_budget_bytes
        assert r.tokens_per_s == pytest.approx(world * r.micro_batch * SEQ / (r.iter_time_us / 1e6))
        # The pre-profile floor never exceeds what a fitting plan needs (it only skips rungs).
        for p in r.probes:
            if p.fits:
                assert _host_floor_bytes(p.n_params, GiB, "bfloat16", world) <= host_need_bytes(
                    p.plan
                ), (world, p.n_params)
    # Without --host-memory, N ranks get N times the spec's host RAM (one rank's share each).
    two = largest_fitting(
        "gpt2", SMALL, budget_bytes=GiB, seq_len=SEQ, micro_batches=MICRO, world_size=2
    )
    assert two.host_memory_bytes == 2 * SMALL.host_memory_bytes
    assert two.host_budget_bytes == one.host_budget_bytes


def test_fit_command_passes_host_memory_and_world_size(monkeypatch):
    from click.testing import CliRunner

    from protrain.planner.commands import fit as F
    from protrain.planner.commands.cli import main

    seen = {}
    monkeypatch.setattr(F, "run_fit", lambda hardware, **kw: seen.update(kw, hardware=hardware))
    r = CliRunner().invoke(
        main, ["fit", "--hardware", "rtx3090", "--host-memory", "384GiB", "--world-size", "4"]
    )
    assert r.exit_code == 0, r.output
    assert (seen["hardware"], seen["host_memory"], seen["world_size"], seen["nvme"]) == (
        "rtx3090",
        "384GiB",
        4,
        False,
    )
    r = CliRunner().invoke(main, ["fit", "--hardware", "rtx3090", "--nvme"])
    assert r.exit_code == 0 and seen["nvme"] is True, r.output


def test_fit_takes_a_zoo_model_by_name():
    # Issue 39: `fit` had --hf-config for one model but no --model for the zoo's.
    from click.testing import CliRunner

    from protrain.planner.commands.cli import main

    r = CliRunner().invoke(
        main, ["fit", "--hardware", "rtx3090", "--model", "gpt2-tiny", "--seq", "128"]
    )
    assert r.exit_code == 0, r.output
    assert "fit gpt2-tiny on rtx3090" in r.output and "verdict: fits at micro-batch" in r.output
    r = CliRunner().invoke(main, ["fit", "--hardware", "rtx3090", "--model", "gpt2-tiy"])
    assert r.exit_code == 1 and "did you mean 'gpt2-tiny'" in r.output
    r = CliRunner().invoke(
        main, ["fit", "--hardware", "rtx3090", "--model", "gpt2", "--hf-config", "mixtral-8x7b"]
    )
    assert r.exit_code != 0 and "both name the model" in r.output


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="did you mean 'llama'"):
        largest_fitting("lama", SMALL)
    with pytest.raises(BudgetError, match="not even the smallest gpt2") as info:
        largest_fitting("gpt2", SMALL, budget_bytes=64 * 2**20, seq_len=SEQ, micro_batches=MICRO)
    assert "HINT: raise --budget" in str(info.value)


def test_fit_with_nvme_puts_on_disk_what_the_host_cannot_hold():
    """`fit --nvme`: where the host binds, plans keep optimizer states on disk, so a larger
    model fits (then the device binds); the report names the state file's size, which is
    accounting.py's; a spec whose disk was not measured is refused, naming the probe."""
    from protrain.planner.commands.fit import render_fit
    from protrain.planner.search import memory_walk
    from protrain.plans import accounting

    disk = msgspec.structs.replace(
        SMALL, disk_read_bytes_per_s=3 * 10**9, disk_write_bytes_per_s=15 * 10**8
    )
    kw = dict(budget_bytes=GiB // 2, seq_len=SEQ, micro_batches=(1,), host_memory_bytes=4 * GiB)
    host = largest_fitting("gpt2", disk, **kw)
    nvme = largest_fitting("gpt2", disk, **kw, nvme=True)
    assert (
        host.next_binds == "host memory" and not host.plan.placement.nvme and host.disk_bytes == 0
    )
    assert nvme.n_params > host.n_params and nvme.plan.placement.nvme
    assert nvme.next_binds == "device memory" and nvme.host_bytes <= nvme.host_budget_bytes
    assert (
        nvme.disk_bytes
        == memory_walk.walk(nvme.plan).disk_bytes
        >= 12 * sum(accounting.host_numel(nvme.plan, c) for c in nvme.plan.placement.nvme)
    )
    text = render_fit([nvme])
    assert "optimizer states may go to disk (--nvme)" in text and "disk" in text.splitlines()[1]
    with pytest.raises(ConfigError, match="hardware probe --nvme"):
        largest_fitting("gpt2", SMALL, **kw, nvme=True)


@pytest.mark.slow
def test_fit_with_nvme_climbs_past_the_host_floor():
    """The ladder skips the rungs whose host floor (fit._host_floor_bytes: what no plan
    without a disk can keep off the host) exceeds the host; with a disk that floor is none.
    At a 1 GiB budget the largest plan with --nvme is ten times the host's (1.68B against
    0.17B), and its floor without a disk is eight times the host: a floor kept with a disk
    would have stopped the climb there. (~30 s: the rungs' analytic profiles.)"""
    from protrain.planner.commands.fit import _host_floor_bytes

    disk = msgspec.structs.replace(
        SMALL, disk_read_bytes_per_s=3 * 10**9, disk_write_bytes_per_s=15 * 10**8
    )
    kw = dict(budget_bytes=GiB, seq_len=SEQ, micro_batches=(1,), host_memory_bytes=4 * GiB)
    host = largest_fitting("gpt2", disk, **kw)
    nvme = largest_fitting("gpt2", disk, **kw, nvme=True)
    assert host.next_binds == "host memory" and nvme.next_binds == "device memory"
    assert nvme.n_params > 5 * host.n_params
    assert _host_floor_bytes(nvme.n_params, GiB, "bfloat16") > 4 * nvme.host_budget_bytes


def test_fit_a_model_with_nvme_names_the_disk():
    """`fit --hf-config … --nvme` (``fit_model``): a model the host cannot hold fits with its
    optimizer states on disk, and the verdict says how much the disk holds."""
    from protrain.planner.commands.fit_config import fit_model, render_model_fit
    from protrain.planner.models.zoo import build
    from protrain.planner.search import memory_walk

    disk = msgspec.structs.replace(
        SMALL, disk_read_bytes_per_s=3 * 10**9, disk_write_bytes_per_s=15 * 10**8
    )
    model = build("gpt2-medium", device="meta")
    kw = dict(
        name="gpt2-medium",
        spec=disk,
        seq_len=SEQ,
        budget_bytes=GiB,
        host_budget_bytes=GiB,
        micro_batches=(1,),
    )
    assert not fit_model(model, **kw).fits
    r = fit_model(model, **kw, nvme=True)
    plan = r.best.plan
    assert r.fits and plan.placement.nvme
    assert (
        "keep their optimizer states on disk "
        f"({human_bytes(memory_walk.walk(plan).disk_bytes)} per rank)"
    ) in render_model_fit(r)
    with pytest.raises(ConfigError, match="hardware probe --nvme"):
        fit_model(model, **{**kw, "spec": SMALL}, nvme=True)
