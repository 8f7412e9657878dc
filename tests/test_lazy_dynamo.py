"""planner/profiling/lazy_dynamo.py: meta's Python kernels run without importing torch._dynamo,
compute what they computed, and hand over to torch's own path once torch._dynamo is imported."""

from __future__ import annotations

import subprocess
import sys

BODY = r"""
import sys
import torch
from torch import _compile
from protrain.planner.profiling.lazy_dynamo import defer_dynamo, _ATTR
from protrain.planner.profiling.analytic import analytic_profile
from protrain.planner.profiling.profile import dump_profile
from protrain.planner.hardware.spec import find_spec
from protrain.planner.models.zoo import build, block_paths

def profile():
    model = build("llama-tiny", device="meta")
    torch.nn.init.normal_(model.lm_head.weight)  # (normal_ on meta: a Python reference too)
    return dump_profile(analytic_profile(
        model, name="llama-tiny", blocks=block_paths(model), micro_batch=2, seq_len=32,
        compute_dtype="bfloat16", spec=find_spec("rtx3090")))

assert defer_dynamo() > 0 and defer_dynamo() == 0  # once per process
inner = torch._refs.add.__wrapped__  # (out_wrapper's _fn around _disable_dynamo's inner)
assert inner.__code__.co_name == "inner", inner
fn = inner.__closure__[inner.__code__.co_freevars.index("fn")].cell_contents
stand_in = getattr(fn, _ATTR)
assert stand_in.__qualname__ == "_stand_in.<locals>.call", stand_in
deferred = profile()
assert "torch._dynamo" not in sys.modules, "the meta kernels imported torch._dynamo"
import torch._dynamo  # now torch's own path: the stand-ins step aside as they are called
again = profile()
assert again == deferred, "the profile changed with torch._dynamo imported"
# torch's own disable(fn):
assert getattr(fn, _ATTR) is not stand_in, "the stand-in did not step aside"
print("OK")
"""


def test_meta_kernels_run_without_dynamo_and_compute_the_same():
    out = subprocess.run([sys.executable, "-c", BODY], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_a_process_with_dynamo_imported_is_left_alone():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch._dynamo\n"
            "from protrain.planner.profiling.lazy_dynamo import defer_dynamo\n"
            "print(defer_dynamo())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "0"
