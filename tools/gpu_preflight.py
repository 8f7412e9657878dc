"""Pre-flight of a lent GPU: what SDPA saves for backward, and what pinning 1 GiB costs.

The first step of tools/gpu_check.sh, under 60 s. It imports torch and the standard
library only (no protrain, no msgspec: the device image has neither until the script
installs them), and every failure it meets is data in the JSON, not a crash.

1. **SDPA census.** For bf16 and fp32 inputs, a few causal shapes, dropout 0 and 0.1,
   and every SDPA back-end (``sdpa_kernel`` with FLASH_ATTENTION, EFFICIENT_ATTENTION,
   MATH, CUDNN_ATTENTION, and torch's own choice with none forced), record the device,
   dtype, shape and size of every tensor autograd saves for backward, through
   ``saved_tensors_hooks``, and run the backward. Why: flash and efficient SDPA save
   ``philox_seed``/``philox_offset`` as CPU int64 scalars (issue #14), and the executor's
   swap hooks must leave such tensors alone; this says exactly what is saved on the real
   GPU under the image's torch. For the first shape, two swap probes replay what the
   executor's swap does: ``swap_on_device`` moves only tensors on the input's device to
   the host and back (the fix), ``swap_all`` moves every saved tensor (the bug); each
   records whether backward ran and how far its gradients are from the plain backward's.
2. **Pinned upload.** One ``cudaHostRegister`` of 1 GiB of ``torch.empty(uint8)`` host
   memory (as ``executor/transfer.py``'s host arena does), a timed ``non_blocking`` upload
   of it on a side stream between CUDA events (GB/s, and how long the host was held by
   the call: a truly asynchronous copy returns in microseconds), a download back into it,
   then ``cudaHostUnregister``; and the same upload from a pageable buffer for comparison.
   Without CUDA this part is recorded as skipped.

    python tools/gpu_preflight.py --device cuda --out preflight.json
    python tools/gpu_preflight.py --device cpu --out preflight.json   # census only
    python tools/gpu_preflight.py --report preflight.json             # markdown summary
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

SHAPES = [(2, 4, 128, 64), (1, 8, 256, 128), (4, 2, 64, 32)]  # (B, H, T, head_dim)
DTYPES = ("bfloat16", "float32")
DROPOUTS = (0.0, 0.1)
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION", "DEFAULT")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------------------------
# 1. SDPA census


def describe(t, roles: dict[int, str]) -> dict:
    """One saved tensor as data. ``roles`` maps q/k/v/out storage pointers to their names."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (sparse, wrapper): no role
        ptr = None
    return {
        "device": str(t.device),
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": list(t.shape),
        "stride": _stride(t),
        "numel": t.numel(),
        "nbytes": t.numel() * t.element_size(),
        "requires_grad": t.requires_grad,
        "role": roles.get(ptr, "other"),
    }


def _stride(t) -> list[int] | None:
    try:
        return list(t.stride())
    except Exception:  # not strided
        return None


def sdpa_once(torch, F, dev, dtype, shape, p, backend, pack=None, unpack=None):
    """One forward and backward of causal SDPA; returns (output's grad_fn name, saved, grads).

    ``pack``/``unpack`` replace the census hooks (the swap probes). The RNG is reseeded
    first, so dropout draws the same mask in every call with the same arguments.
    """
    from torch.autograd.graph import saved_tensors_hooks

    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, dtype=dtype, device=dev, requires_grad=True) for _ in range(3))
    saved: list = []
    if pack is None:

        def pack(t):
            saved.append(t)
            return t

        def unpack(t):
            return t

    ctx = _kernel_ctx(torch, backend)
    torch.manual_seed(1)
    with ctx, saved_tensors_hooks(pack, unpack):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    roles = {
        x.untyped_storage().data_ptr(): n for n, x in (("q", q), ("k", k), ("v", v), ("out", out))
    }
    described = [describe(t, roles) for t in saved]
    out.float().square().sum().backward()
    return type(out.grad_fn).__name__, described, (q.grad, k.grad, v.grad)


def _kernel_ctx(torch, backend: str):
    import contextlib

    if backend == "DEFAULT":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = getattr(SDPBackend, backend, None)
    if member is None:
        raise RuntimeError(f"SDPBackend.{backend} does not exist in torch {torch.__version__}")
    return sdpa_kernel([member])


def swap_probe(torch, F, dev, dtype, shape, p, backend, ref_grads, move_all: bool) -> dict:
    """Backward through hooks that copy saved tensors to the host and back, as swap does.

    ``move_all=False``: only tensors on ``dev`` travel, each back to where it was (the
    fix). ``move_all=True``: every saved tensor travels and comes back on ``dev``, which
    is what ``activations.py`` did at 754c22f; on CUDA that puts SDPA's CPU philox
    scalars on the GPU, which may crash the process, so it runs in a child
    (``isolated_swap_all``).
    """
    host = torch.device("cpu")

    def pack(t):
        if move_all or t.device == dev:
            return (True, t.to(host, copy=True))
        return (False, t)

    def unpack(x):
        moved, t = x
        return t.to(dev) if moved else t

    try:
        _, _, grads = sdpa_once(torch, F, dev, dtype, shape, p, backend, pack, unpack)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref_grads))
        return {"status": "ok", "max_abs_grad_diff": diff}
    except Exception as e:
        return {"status": "error", "error": first_line(e)}


def census(torch, dev, budget_s: float, t_start: float) -> dict:
    import torch.nn.functional as F

    entries = []
    for backend in BACKENDS:
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            for p in DROPOUTS:
                for si, shape in enumerate(SHAPES):
                    e = {
                        "backend": backend,
                        "dtype": dtype_name,
                        "dropout_p": p,
                        "shape": list(shape),
                        "causal": True,
                        "input_device": str(dev),
                    }
                    entries.append(e)
                    if time.perf_counter() - t_start > budget_s:
                        e["status"] = "skipped: time budget"
                        continue
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            grad_fn, saved, grads = sdpa_once(
                                torch, F, dev, dtype, shape, p, backend
                            )
                            e.update(
                                status="ok",
                                grad_fn=grad_fn,
                                saved=saved,
                                saved_off_device=sum(s["device"] != str(dev) for s in saved),
                                saved_bytes=sum(s["nbytes"] for s in saved),
                            )
                        except Exception as err:
                            e.update(status="error", error=first_line(err))
                            grads = None
                    # Why a back-end refused: torch says it in warnings ("Flash attention
                    # does not support ..."), kept short and de-duplicated.
                    msgs = list(
                        dict.fromkeys(
                            str(w.message).split(" (Triggered internally")[0].splitlines()[0][:200]
                            for w in caught
                        )
                    )
                    if msgs:
                        e["warnings"] = msgs[:4]
                    if grads is not None and si == 0:
                        e["swap_on_device"] = swap_probe(
                            torch, F, dev, dtype, shape, p, backend, grads, move_all=False
                        )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"shapes": [list(s) for s in SHAPES], "entries": entries}


def odd_saved(e: dict) -> list[dict]:
    """Saved tensors that swap must leave alone: off the input's device, or a scalar."""
    return [t for t in e.get("saved", []) if t["device"] != e["input_device"] or t["numel"] <= 1]


def census_summary(entries: list[dict]) -> dict:
    """Per (backend, dtype, dropout): shapes that ran, why the rest did not, grad_fn, the
    saved tensors swap must leave alone, and the two swap probes' outcomes."""
    out = {}
    for e in entries:
        key = f"{e['backend']} {e['dtype']} p={e['dropout_p']}"
        s = out.setdefault(
            key, {"ok": 0, "errors": [], "warnings": [], "grad_fn": None, "odd_saved": []}
        )
        if e.get("status") != "ok":
            why = e.get("error") or e.get("status")
            if why and why not in s["errors"]:
                s["errors"].append(why)
            s["warnings"] += [w for w in e.get("warnings", []) if w not in s["warnings"]]
            continue
        s["ok"] += 1
        s["grad_fn"] = e["grad_fn"]
        for t in odd_saved(e):
            odd = {k: t[k] for k in ("device", "dtype", "shape", "role")}
            if odd not in s["odd_saved"]:
                s["odd_saved"].append(odd)
        for probe in ("swap_on_device", "swap_all"):
            if probe in e:
                s[probe] = e[probe]
    return out


def isolated_swap_all(args, entries: list[dict], deadline: float, all_entries: bool) -> None:
    """Run the ``swap_all`` probe in child processes, one result line per probe.

    Only for entries (first shape, backward ran) that saved something off the input's
    device, unless ``all_entries`` (a CPU rehearsal of this path): elsewhere moving
    everything is the same as ``swap_on_device``. A child that dies (a segfault from a
    host-side read of a device pointer, a sticky CUDA error) marks the probe it was in
    and a fresh child goes on with the rest while time is left.
    """
    todo = [
        e for e in entries if "swap_on_device" in e and (all_entries or e.get("saved_off_device"))
    ]
    for e in entries:
        if "swap_on_device" in e and e not in todo:
            e["swap_all"] = {"status": "same as swap_on_device (nothing saved off the device)"}
    while todo:
        left = deadline - time.perf_counter()
        if left < 3:
            for e in todo:
                e["swap_all"] = {"status": "skipped: time budget"}
            return
        spec = [[e["backend"], e["dtype"], e["dropout_p"], e["shape"]] for e in todo]
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--device",
            args.device,
            "--child-swap-all",
            json.dumps(spec),
        ]
        current = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            rc, stdout = proc.returncode, proc.stdout
            tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
        except subprocess.TimeoutExpired as t:
            rc, tail = "timeout", []
            stdout = t.stdout.decode() if isinstance(t.stdout, bytes) else (t.stdout or "")
        done = set()
        for line in stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "START":
                current = int(rest)
            elif kind == "RESULT":
                i, _, payload = rest.partition(" ")
                todo[int(i)]["swap_all"] = json.loads(payload)
                done.add(int(i))
                current = None
        if current is not None:  # the child died inside this probe
            todo[current]["swap_all"] = {
                "status": "crashed",
                "child_exit": rc if rc != "timeout" else None,
                "error": (
                    f"child killed by signal {-rc}"
                    if isinstance(rc, int) and rc < 0
                    else f"child ended ({rc}) inside this probe"
                )
                + (f": {tail[0][:200]}" if tail else ""),
            }
            done.add(current)
        elif rc != 0 and not done:  # died before any probe: do not loop on it
            for e in todo:
                e["swap_all"] = {"status": "error", "error": f"child exited {rc}: {tail[:1]}"}
            return
        todo = [e for i, e in enumerate(todo) if i not in done]


def child_swap_all(args) -> int:
    """The child side of ``isolated_swap_all``: plain backward, then the move-all probe."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    for i, (backend, dtype_name, p, shape) in enumerate(json.loads(args.child_swap_all)):
        print(f"START {i}", flush=True)
        dtype = getattr(torch, dtype_name)
        try:
            _, _, grads = sdpa_once(torch, F, dev, dtype, tuple(shape), p, backend)
            res = swap_probe(torch, F, dev, dtype, tuple(shape), p, backend, grads, move_all=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # an asynchronous fault surfaces here, in this probe
        except Exception as e:
            res = {"status": "error", "error": first_line(e)}
        print(f"RESULT {i} {json.dumps(res)}", flush=True)
    return 0


# ---------------------------------------------------------------------------
# 2. Pinned (cudaHostRegister) against pageable upload


def timed_copies(torch, dst, src, stream, reps: int) -> list[dict]:
    """``dst.copy_(src, non_blocking=True)`` on ``stream`` between timing events, ``reps`` times."""
    runs = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        host_held_s = time.perf_counter() - t0  # the call's own time: ~µs when truly async
        end.synchronize()
        ms = start.elapsed_time(end)
        runs.append(
            {
                "ms": round(ms, 3),
                "gb_per_s": round(src.numel() / ms / 1e6, 2),
                "host_held_ms": round(host_held_s * 1e3, 3),
            }
        )
    return runs


def pinned_upload(torch, dev, nbytes: int, reps: int) -> dict:
    res: dict = {"bytes": nbytes, "reps": reps}
    cudart = torch.cuda.cudart()
    side = torch.cuda.Stream(dev)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))  # dev_buf was allocated on the compute stream
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)  # fault the pages in, so registering times the pinning and not the page faults
    registered = False
    try:
        t0 = time.perf_counter()
        err = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))
        res["register_s"] = round(time.perf_counter() - t0, 4)
        res["register_error"] = err
        registered = err == 0
        # Whether torch treats registered memory as pinned decides if non_blocking copies
        # from the executor's host arena are asynchronous at all.
        res["is_pinned_after_register"] = bool(host.is_pinned())
        if registered:
            res["upload"] = timed_copies(torch, dev_buf, host, side, reps)
            res["upload_ok"] = bool(torch.equal(dev_buf[-4096:].cpu(), host[-4096:]))
            dev_buf.fill_(3)
            torch.cuda.current_stream(dev).synchronize()
            res["download"] = timed_copies(torch, host, dev_buf, side, reps)
            res["download_ok"] = bool(int(host[-4096:].sum()) == 3 * 4096)
    except Exception as e:
        res["error"] = first_line(e)
    finally:
        if registered:
            t0 = time.perf_counter()
            res["unregister_error"] = int(cudart.cudaHostUnregister(host.data_ptr()))
            res["unregister_s"] = round(time.perf_counter() - t0, 4)
        del host
    try:
        page = torch.empty(nbytes, dtype=torch.uint8)
        page.fill_(2)
        res["pageable_is_pinned"] = bool(page.is_pinned())
        res["pageable_upload"] = timed_copies(torch, dev_buf, page, side, reps)
        res["pageable_upload_ok"] = bool(torch.equal(dev_buf[-4096:].cpu(), page[-4096:]))
        del page
    except Exception as e:
        res["pageable_error"] = first_line(e)
    del dev_buf
    torch.cuda.empty_cache()
    best = {
        k: max(r["gb_per_s"] for r in res[k])
        for k in ("upload", "download", "pageable_upload")
        if res.get(k)
    }
    res["best_gb_per_s"] = best
    res["status"] = "ok" if registered and "error" not in res else "error"
    return res


# ---------------------------------------------------------------------------


def environment(torch, dev) -> dict:
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "machine": platform.machine(),
        "device": str(dev),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            gpu_memory_bytes=p.total_memory,
            cudnn=torch.backends.cudnn.version(),
        )
        b = torch.backends.cuda
        for name in (
            "flash_sdp_enabled",
            "mem_efficient_sdp_enabled",
            "math_sdp_enabled",
            "cudnn_sdp_enabled",
            "is_flash_attention_available",
        ):
            fn = getattr(b, name, None)
            env[name] = bool(fn()) if fn else None
    return env


def run(args, save) -> dict:
    """The whole pre-flight; ``save(rec)`` after each part, so a kill keeps what was done."""
    t_start = time.perf_counter()
    rec: dict = {
        "tool": "gpu_preflight",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "requested_device": args.device,
        "budget_s": args.budget_s,
    }
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        rec["error"] = f"--device {args.device}: torch {torch.__version__} sees no CUDA device"
        rec["env"] = environment(torch, torch.device("cpu"))
        return rec
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
        torch.empty(1, device=dev)  # the CUDA context, so its start is not timed as a kernel
    rec["env"] = environment(torch, dev)
    rec["context_s"] = round(time.perf_counter() - t_start, 2)
    save(rec)

    # Time shares of the soft budget: the census stops starting entries at half of it, the
    # pinned part needs a few seconds, the isolated probes get the rest plus a small margin.
    t0 = time.perf_counter()
    try:
        rec["sdpa"] = census(torch, dev, args.budget_s * 0.5, t_start)
    except Exception as e:
        rec["sdpa"] = {"error": first_line(e), "traceback": traceback.format_exc()[-2000:]}
    rec["sdpa_s"] = round(time.perf_counter() - t0, 2)
    save(rec)

    t0 = time.perf_counter()
    if dev.type != "cuda":
        rec["host_register"] = {"status": "skipped: no CUDA"}
    elif time.perf_counter() - t_start > args.budget_s * 0.8:
        rec["host_register"] = {"status": "skipped: time budget"}
    else:
        try:
            rec["host_register"] = pinned_upload(torch, dev, int(args.host_gib * 2**30), args.reps)
        except Exception as e:
            rec["host_register"] = {
                "status": "error",
                "error": first_line(e),
                "traceback": traceback.format_exc()[-2000:],
            }
    rec["host_register_s"] = round(time.perf_counter() - t0, 2)
    save(rec)

    if "entries" in rec["sdpa"]:
        t0 = time.perf_counter()
        isolated_swap_all(
            args, rec["sdpa"]["entries"], t_start + args.budget_s + 5, all_entries=args.isolate_all
        )
        rec["swap_all_s"] = round(time.perf_counter() - t0, 2)
        rec["sdpa"]["summary"] = census_summary(rec["sdpa"]["entries"])
    rec["seconds"] = round(time.perf_counter() - t_start, 2)
    return rec


def report(rec: dict) -> str:
    """A few markdown lines for summary.md and the log."""
    lines = ["## Pre-flight (tools/gpu_preflight.py)", ""]
    env = rec.get("env", {})
    lines.append(
        f"{rec.get('requested_device')}: torch {env.get('torch')} (CUDA {env.get('cuda_build')}), "
        f"python {env.get('python')}"
        + (
            f", {env['gpu']} sm {env['capability']}, cuDNN {env.get('cudnn')}"
            if env.get("gpu")
            else ""
        )
        + f"; {rec.get('seconds')} s."
    )
    if rec.get("error"):
        lines += ["", f"**error:** {rec['error']}"]
    lines.append("")
    sd = rec.get("sdpa", {})
    if "summary" in sd:
        lines += [
            "| SDPA back-end, dtype, dropout | ran | grad_fn | saved off-device or ≤ 1 element "
            "| swap on-device only | swap all |",
            "|---|---:|---|---|---|---|",
        ]
        for key, s in sd["summary"].items():
            odd = (
                "; ".join(
                    f"{o['role']} {o['dtype']} {o['shape']} on {o['device']}"
                    for o in s["odd_saved"]
                )
                or "none"
            )
            if not s["ok"]:
                odd = ("refused: " + "; ".join(s["warnings"] or s["errors"]))[:200].replace(
                    "|", "/"
                )
            probes = [_probe(s.get(p)) for p in ("swap_on_device", "swap_all")]
            lines.append(
                f"| {key} | {s['ok']}/{len(SHAPES)} | {s['grad_fn'] or '—'} | {odd} | "
                f"{probes[0]} | {probes[1]} |"
            )
    elif sd:
        lines.append(f"SDPA census failed: {sd.get('error')}")
    lines.append("")
    hr = rec.get("host_register", {})
    if hr.get("best_gb_per_s"):
        b = hr["best_gb_per_s"]
        held = max((r["host_held_ms"] for r in hr.get("upload", [])), default=None)
        lines.append(
            f"cudaHostRegister of {hr['bytes'] / 2**30:.2f} GiB: {hr.get('register_s')} s "
            f"(error {hr.get('register_error')}), is_pinned {hr.get('is_pinned_after_register')}; "
            f"upload {b.get('upload')} GB/s (host held ≤ {held} ms), download "
            f"{b.get('download')} GB/s, pageable upload {b.get('pageable_upload')} GB/s; "
            f"unregister error {hr.get('unregister_error')}."
        )
    else:
        lines.append(
            f"cudaHostRegister: {hr.get('status')}"
            + (f" ({hr['error']})" if hr.get("error") else "")
        )
    return "\n".join(lines) + "\n"


def _probe(p) -> str:
    if not p:
        return "—"
    if p["status"] == "ok":
        return f"ok, Δgrad {p['max_abs_grad_diff']:.1e}"
    if p["status"].startswith("same as"):
        return "= on-device only"
    return f"{p['status']}: {p.get('error', '')}"[:100].replace("|", "/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--out", default=None, help="write the JSON record here (default: stdout only)")
    ap.add_argument(
        "--host-gib", type=float, default=1.0, help="host buffer to register (default 1 GiB)"
    )
    ap.add_argument("--reps", type=int, default=3, help="timed copies of each kind (default 3)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=45.0,
        help="soft time budget: no census entry starts past half of it, and the "
        "isolated swap probes stop 5 s past it (default 45 s, inside "
        "gpu_check.sh's 60 s step)",
    )
    ap.add_argument(
        "--isolate-all",
        action="store_true",
        help="run the move-everything swap probe in a child for every back-end that "
        "ran, not only those that saved something off the device (to rehearse "
        "that path on CPU)",
    )
    ap.add_argument(
        "--report", default=None, metavar="JSON", help="print the markdown summary of a record"
    )
    ap.add_argument("--child-swap-all", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())), end="")
        return 0
    if args.child_swap_all:
        return child_swap_all(args)

    def save(rec: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")

    rec = run(args, save)
    save(rec)
    print(report(rec), end="")
    return 1 if rec.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
