"""Delete each stream-ordering guard once and check that a named test fails (issue #14);
and the planner's rules that the tests are meant to hold (issue #17).

Each mutant is one textual edit of one executor (or planner) file. The tool copies the
repository's ``executor/`` (or ``planner/``) into a scratch directory, applies the edit
there (the working tree is never touched), puts a ``protrain`` package in front of the
installed one on ``PYTHONPATH`` and runs the named tests in a subprocess. A mutant is *caught* when
pytest fails (or the process dies on a signal). Prints a Markdown table.

    python tools/mutants.py                 # every mutant, on the working tree
    python tools/mutants.py --only release  # mutants whose name contains "release"
    python tools/mutants.py --rev HEAD      # on a commit (its executor, planner and tests)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under ``package``/
    old: str
    new: str
    tests: tuple[str, ...]  # node ids, relative to the repository
    uncatchable: str = ""  # why no CPU test can see this guard go (a finding, kept in the table)
    package: str = "executor"  # or "planner"


R = "tests/test_races.py"
G = "tests/test_gpu_ready.py"
U = "tests/test_usable.py::test_every_entry_works_or_is_refused_by_name"
H = "tests/test_host_layout.py::test_homeless_chunks_train_bit_for_bit_as_kept_homes"
N = "tests/test_nvme.py"
MUTANTS = [
    Mutant(
        "compute waits for a chunk's upload",
        "chunks.py",
        "            c.upload.wait()\n            c.upload = None\n\n    def release",
        "            c.upload = None\n\n    def release",
        (f"{R}::test_async_matrix_fp32_is_exact",),
    ),
    Mutant(
        "release waits for a prefetch in flight",
        "chunks.py",
        "        self.wait(cid)  # a prefetch never used",
        "        pass  # a prefetch never used",
        (f"{R}::test_evaluate_releases_a_prefetch_in_flight",),
    ),
    Mutant(
        "fetch waits for the chunk's CPU step",
        "chunks.py",
        "        c.settle()  # the updated weights",
        "        pass  # the updated weights",
        (f"{R}::test_parity_with_delays",),
    ),
    Mutant(
        "fetch bounded by n_buffer",
        "chunks.py",
        "        assert len(self.resident_offloaded()) < self.n_buffer",
        "        assert True",
        (f"{G}::test_fetch_beyond_n_buffer_is_an_invariant_error",),
    ),
    Mutant(
        "worker waits for the gradient download",
        "optim.py",
        "            down.synchronize()  # a wait",
        "            pass  # a wait",
        (f"{R}::test_async_matrix_fp32_is_exact", f"{R}::test_async_matrix_equals_sync"),
    ),
    Mutant(
        "offload waits before reusing staging",
        "optim.py",
        "        c.settle()  # the worker may still read dst",
        "        pass  # the worker may still read dst",
        (f"{R}::test_staging_is_reused_only_after_the_worker_landed_it",),
        "redundant today: every offloaded chunk is fetched in forward, and fetch already waits "
        "for the chunk's pending landing; it guards chunks no forward fetches (unused "
        "parameters, issue #15)",
    ),
    Mutant(
        "CPU step waits for the last upload from home",
        "optim.py",
        "            reads_home.synchronize()",
        "            pass",
        (f"{R}::test_cpu_step_writes_home_only_after_the_last_upload_read_it",),
    ),
    Mutant(
        "norm waits for the landed gradients (after_backward)",
        "engine.py",
        "            self.optim.wait_all()  # the accumulators",
        "            pass  # the accumulators",
        (f"{R}::test_async_clipping_is_exact",),
    ),
    Mutant(
        "download records its source on the D2H stream",
        "transfer.py",
        "                self._record(src, stream)  # src's memory",
        "                pass  # src's memory",
        (f"{R}::test_async_matrix_fp32_is_exact",),
    ),
    Mutant(
        "swap-in waits for the swap-out (after=)",
        "transfer.py",
        "                stream.wait_event(after.event)",
        "                pass",
        (f"{R}::test_async_matrix_fp32_is_exact",),
    ),
    Mutant(
        "upload waits for compute (wait_stream)",
        "transfer.py",
        "            self._wait_compute(stream)",
        "            if stream is self.d2h:  # downloads still wait\n                "
        "self._wait_compute(stream)",
        (f"{R}::test_async_matrix_fp32_is_exact",),
        "CPU compute is the host: it has finished before the next copy is issued",
    ),
    Mutant(
        "download waits for compute (wait_stream)",
        "transfer.py",
        "            self._wait_compute(stream)",
        "            if stream is self.h2d:  # uploads still wait\n                "
        "self._wait_compute(stream)",
        (f"{R}::test_async_matrix_fp32_is_exact",),
        "CPU compute is the host: it has finished before the next copy is issued",
    ),
    Mutant(
        "collectives run in issue order (emulation)",
        "transfer.py",
        "        if self.emu is None or self.h2d.on_worker():",
        "        if True:",
        ("tests/test_dist.py::test_async_zero3_equals_sync",),
    ),
    Mutant(
        "unpack waits for the swap-in",
        "activations.py",
        "            h.up.wait()\n",
        "            pass\n",
        (f"{R}::test_async_matrix_fp32_is_exact",),
    ),
    Mutant(
        "swap leaves host scalars alone",
        "activations.py",
        "            if self.store.owns(t) or t.device != self.store.device or t.dim() == 0:",
        "            if self.store.owns(t):",
        (f"{R}::test_a_block_saving_a_host_scalar_trains_under_swap",),
    ),
    Mutant(
        "masters from the user's fp32 values",
        "chunks.py",
        "                image[ps.offset : ps.offset + ps.numel].copy_(p.detach().reshape(-1))",
        "                image[ps.offset: ps.offset + ps.numel].copy_(p.detach().reshape(-1)"
        ".to(self.dtype))",
        (f"{G}::test_masters_equal_the_users_fp32_parameters_after_wrap",),
    ),
    Mutant(
        "forward outside step/evaluate refused",
        "access.py",
        "        if replayer.phase is Phase.IDLE and torch.is_grad_enabled():",
        "        if False:",
        (f"{U}[offloaded]",),
    ),
    Mutant(
        "usable: a released parameter's read refused",
        "access.py",
        "                if isinstance(t, _Guard) and _released(t) and not (name == "
        '"grad" and _none(t)):',
        "                if False:",
        (f"{U}[offloaded]",),
    ),
    Mutant(
        "usable: a root's no-grad forward fetches as the plan says",
        "access.py",
        "            replayer.begin(Phase.FORWARD, PRE)",
        "            pass",
        (f"{U}[offloaded]",),
    ),
    Mutant(
        "usable: state_dict gives the engine's values",
        "access.py",
        "                sd[k] = values[names[id(v)]] if id(v) in names else v.detach()",
        "                sd[k] = v.detach()",
        (f"{U}[offloaded]",),
    ),
    Mutant(
        "usable: a move of device or dtype refused",
        "access.py",
        "            if self._changes_nothing(module, name, args, kwargs):",
        "            if True:",
        (f"{U}[offloaded]",),
    ),
    Mutant(
        "evaluate releases what it fetched",
        "access.py",
        "                    store.release(cid)  # waits",
        "                    pass  # waits",
        (f"{G}::test_evaluate_between_steps_changes_nothing",),
    ),
    Mutant(
        "step's first fetch inside the OOM handler",
        "engine.py",
        "            try:\n                # The root's hooks run the plan's forward",
        "            loss = self.model(x, y, position_ids=p[0]) if p else self.model(x, y)\n"
        "            try:\n                # The root's hooks run the plan's forward",
        (f"{G}::test_out_of_memory_in_the_first_fetch_is_a_budget_error",),
    ),
    Mutant(
        "OOM in a collective passes through",
        "dist.py",
        "        except torch.OutOfMemoryError:\n            raise",
        "        except KeyboardInterrupt:\n            raise",
        (f"{G}::test_out_of_memory_in_a_collective_is_not_a_rank_failure",),
    ),
    Mutant(
        "the ledger counts a release (held to accounting.py)",
        "chunks.py",
        '        self.ledger.free("chunks", c.nbytes)\n',
        "",
        ("tests/test_memory.py::test_after_wrap_and_after_step",),
    ),
    Mutant(
        "a release at the step the plan says (Ledger.check)",
        "schedule.py",
        "        for c in step.release:\n            self.store.release(c)",
        "        for c in step.release[1:]:\n            self.store.release(c)",
        ("tests/test_memory.py::test_after_wrap_and_after_step",),
    ),
    Mutant(
        "home restored when a landed chunk has nothing to step",
        "optim.py",
        "                self._refresh_home(cid)\n            return\n",
        "                pass\n            return\n",
        ("tests/test_host_layout.py::test_a_chunk_with_nothing_to_step_gets_its_home_back",),
    ),
    Mutant(
        "gradients in home or slot read through the scratch",
        "optim.py",
        "                g.copy_(grads[a:b]) if grads is not None else g.zero_()",
        "                g.zero_()",
        (
            "tests/test_host_layout.py::test_gradients_in_home_step_like_a_persistent_chunk",
            f"{H}[False-keep]",
        ),
    ),
    Mutant(
        "homeless: a slot is reused after the upload that read it",
        "chunks.py",
        "            self.slots.append((src, c.upload.synchronize))",
        "            self.slots.append((src, None))",
        (f"{H}[True-keep]",),
    ),
    Mutant(
        "homeless: a slot is reused after the CPU step that read its gradients",
        "optim.py",
        "            self.store.slots.append((grads, c.pending.result))",
        "            self.store.slots.append((grads, None))",
        (f"{H}[True-keep]",),
    ),
    Mutant(
        "device homes: a forward's in-place write reaches the device master",
        "chunks.py",
        "                if a < b and (self.dtype != torch.float32 or c.homed):",
        "                if a < b and self.dtype != torch.float32:",
        ("tests/test_device_homes.py::test_in_place_write_in_forward_reaches_the_device_master",),
    ),
    Mutant(
        "ZeRO-3: gradients reduce-scattered before they go down or step on the device",
        "chunks.py",
        '        self.comm.reduce_scatter(out, c.dev_grad, f"gradients of chunk {cid}")',
        "        out.copy_(c.dev_grad[c.own])",
        # (host and device homes share ChunkStore.own_grad: only the single-process reference sees
        # it)
        ("tests/test_dist.py::test_zero3_matches_single_process[gpt2-tiny-2]",),
    ),
    Mutant(
        "offload: a forward's in-place writes reach home and master before the step",
        "engine.py",
        "        if c.residency is Residency.RESIDENT:\n            self.store.write_back(cid)",
        "        if False:\n            self.store.write_back(cid)",
        (
            "tests/test_device_homes.py::test_in_place_write_in_forward_reaches_the_device_master[6]",
        ),
    ),
    Mutant(
        "arena finaliser unpins",
        "transfer.py",
        "            self._unpin = weakref.finalize(self, _unregister, self.buffer)",
        "            self._unpin = weakref.finalize(self, _unregister, self.buffer)\n"
        "            self._unpin.atexit = False\n            self._unpin.detach()",
        (f"{G}::test_arena_is_unpinned_by_close_and_by_its_finaliser",),
    ),
    Mutant(
        "failed wrap tears down",
        "engine.py",
        "            self._teardown()  # nothing pinned",
        "            pass  # nothing pinned",
        (f"{G}::test_a_failed_wrap_leaves_nothing_pinned_and_no_hooks",),
    ),
    Mutant(
        "clipping refused on a during_backward plan",
        "engine.py",
        "        if config.max_grad_norm is not None:\n            _check_cpu_adam(",
        "        if False:\n            _check_cpu_adam(",
        (f"{G}::test_clipping_needs_an_after_backward_plan",),
    ),
    Mutant(
        "CPU steps deferred as the plan says",
        "engine.py",
        '        self._defer_cpu_steps = plan.schedule.cpu_adam == "after_backward"',
        "        self._defer_cpu_steps = config.max_grad_norm is not None",
        (f"{G}::test_the_executed_cpu_step_schedule_is_the_plans",),
    ),
    Mutant(
        "NVMe step drops each piece",
        "optim.py",
        "                    disk.drop(m[a:b], ea[a:b], es[a:b])",
        "                    pass",
        ("tests/test_nvme.py::test_the_file_stays_on_disk_beyond_the_window",),
    ),
    Mutant(
        "NVMe fetch rounds a piece at a time",
        "chunks.py",
        "                copy_pieces(src[:n], self.masters[cid], self.disk if c.on_disk else None)",
        "                src[:n].copy_(self.masters[cid])",
        ("tests/test_nvme.py::test_the_file_stays_on_disk_beyond_the_window",),
    ),
    Mutant(
        "NVMe fp32 fetch uploads a piece at a time",
        "chunks.py",
        "            for a in range(0, n, STEP_PIECE):\n                b = min(a + STEP_PIECE, n)",
        "            for a in range(0, n, max(n, 1)):\n                b = n",
        ("tests/test_nvme.py::test_the_file_stays_on_disk_beyond_the_window",),
    ),
    Mutant(
        "a padding-only shard steps nothing",
        "optim.py",
        "        if spans:  # (none under ZeRO-3",
        "        if True:  # (none under ZeRO-3",
        ("tests/test_dist.py::test_a_rank_whose_shard_is_padding_steps_nothing",),
    ),
    # The planner's rules for the host tiers (issue 17): the search, fit, the trace.
    Mutant(
        "search: device homes only where the disk does not fit",
        "search/exhaustive.py",
        "    use = fits_h & (~fits_d | (homes[0] < disk[0]))",
        "    use = fits_h & ~fits_d",
        (f"{N}::test_the_faster_tier_that_fits_per_strip",),
        package="planner",
    ),
    Mutant(
        "search: device homes wherever they fit",
        "search/exhaustive.py",
        "    use = fits_h & (~fits_d | (homes[0] < disk[0]))",
        "    use = fits_h",
        (f"{N}::test_the_faster_tier_that_fits_per_strip",),
        package="planner",
    ),
    Mutant(
        "search: the disk alone (no weighing)",
        "search/exhaustive.py",
        "    use = fits_h & (~fits_d | (homes[0] < disk[0]))",
        "    use = fits_h & False",
        (
            f"{N}::test_the_faster_tier_that_fits_per_strip",
            f"{N}::test_plan_with_nvme_fits_a_host_that_refuses_it_without",
        ),
        package="planner",
    ),
    Mutant(
        "search: time bound past the dense buffers from the faster tier",
        "search/exhaustive.py",
        "        else np.minimum(time, evaluate(th, n_persist, n_buffer, grid, host_cap, "
        "time_only=True)[0])\n",
        "        else time\n",
        ("tests/test_search.py::test_buffers_past_the_dense_range_weigh_both_host_tiers",),
        package="planner",
    ),
    Mutant(
        "cost: a fetch reads a master from disk",
        "search/host_tiers.py",
        "    return on_disk & (homeless | t.disk_fetch_with_home)",
        "    return on_disk & False",
        (f"{N}::test_the_disk_takes_what_homeless_chunks_leave",),
        package="planner",
    ),
    Mutant(
        "trace: a chunk on disk adds its traffic to its CPU step",
        "views/trace.py",
        "        disk = int(t.host_numel[c]) * t.disk_step_us_per_elem if c in on_disk else 0.0",
        "        disk = 0.0",
        (f"{N}::test_predicted_trace_charges_the_disk",),
        package="planner",
    ),
    Mutant(
        "fit: probes plan with the disk",
        "commands/fit.py",
        "host_budget_bytes=host_budget, world_size=world_size, nvme=nvme\n",
        "host_budget_bytes=host_budget, world_size=world_size\n",
        ("tests/test_fit.py::test_fit_with_nvme_puts_on_disk_what_the_host_cannot_hold",),
        package="planner",
    ),
    Mutant(
        "fit: no host floor with a disk",
        "commands/fit.py",
        "    if nvme:\n        return 0\n    eb = memory_walk",
        "    eb = memory_walk",
        ("tests/test_fit.py::test_fit_with_nvme_climbs_past_the_host_floor",),
        package="planner",
    ),
]


def scratch(root: Path, package: str = "executor") -> Path:
    """A ``protrain`` package: a copy of ``root``'s ``package`` (executor/ or planner/), the
    other of executor/ and planner/ linked, and plans/ (the stock hardware specs)."""
    top = Path(tempfile.mkdtemp(prefix="protrain-mutant-"))
    pkg = top / "protrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("executor", "planner"):
        if name == package:
            shutil.copytree(root / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (pkg / name).symlink_to(root / name)
    (pkg / "plans").symlink_to(
        root / "plans"
    )  # a copied planner finds plans/hardware beside it (spec.py)
    return top


def checkout(rev: str) -> Path:
    """The tree of commit ``rev`` in a scratch directory (``git archive``)."""
    where = Path(tempfile.mkdtemp(prefix="protrain-rev-"))
    archive = subprocess.run(
        ["git", "archive", rev], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def run(m: Mutant, timeout_s: float, root: Path = ROOT) -> tuple[str, float, str]:
    top = scratch(root, m.package)
    try:
        path = top / "protrain" / m.package / m.file
        text = path.read_text()
        if text.count(m.old) != 1:
            return "stale (the guard's text is not found once)", 0.0, ""
        path.write_text(text.replace(m.old, m.new))
        env = {
            **os.environ,
            "PYTHONPATH": str(top),
            "PROTRAIN_SLOW": "1",
        }  # a named slow test runs too
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n0",
            "-x",
            "-p",
            "no:cacheprovider",
            *m.tests,
        ]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return "caught (hang: timed out)", time.perf_counter() - t0, ""
        dt = time.perf_counter() - t0
        last = (p.stdout.strip().splitlines() or [""])[-1]
        if p.returncode < 0:
            return f"caught (signal {-p.returncode})", dt, last
        return ("caught" if p.returncode != 0 else "NOT caught"), dt, last
    finally:
        shutil.rmtree(top, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the mutants whose name contains this")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    ap.add_argument("--rev", help="mutate this commit's tree instead of the working tree")
    args = ap.parse_args()
    root = checkout(args.rev) if args.rev else ROOT
    rows = []
    print("| guard deleted | file | test | result |\n|---|---|---|---|")
    for m in MUTANTS:
        if args.only not in m.name:
            continue
        result, dt, last = run(m, args.timeout, root)
        if m.uncatchable and result.startswith("NOT"):
            result = f"not caught, as expected: {m.uncatchable}"
        rows.append(result)
        tests = ", ".join(t.split("::")[-1] for t in m.tests)
        print(
            f"| {m.name} | {m.package}/{m.file} | {tests} | {result} ({dt:.0f} s; {last}) |",
            flush=True,
        )
    missed = sum(r.startswith("NOT") or r.startswith("stale") for r in rows)
    expected = sum(r.startswith("not caught, as expected") for r in rows)
    print(
        f"\n{len(rows) - missed - expected} of {len(rows)} mutants caught; {expected} not "
        f"catchable on CPU (listed); {missed} missed"
    )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
