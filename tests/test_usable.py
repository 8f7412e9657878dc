"""The model stays usable after wrap (issue 41.3): every public entry of a wrapped transformers
model, and of the modules inside it, works under the plan or raises a ProtrainError; none
crashes the process. executor/access.py [Note: the model between steps].

Each call runs in its own process (tests/usableworker.py), so a SIGSEGV is a return code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

WORKER = Path(__file__).with_name("usableworker.py")

# entry → what it gives under the offloaded plan and under the all-persistent plan.
OK, REFUSED = "OK", "REFUSED"
ENTRIES = {
    "forward-train-nograd": (OK, OK),
    "forward-eval-nograd": (OK, OK),
    "forward-train-grad": (REFUSED, REFUSED),
    "forward-eval-grad": (REFUSED, REFUSED),
    "wrapper": (OK, OK),
    "inference_mode": (OK, OK),
    "generate": (OK, OK),
    "lm_head": (REFUSED, OK),  # a module inside, alone: its offloaded chunk is released
    "state_dict": (OK, OK),
    "state_dict-block": (OK, OK),
    "save_pretrained": (OK, OK),
    "data": (REFUSED, OK),
    "metadata": (OK, OK),
    "grad": (REFUSED, OK),
    "repr": (REFUSED, OK),
    "deepcopy": (REFUSED, REFUSED),
    "to-noop": (OK, OK),
    "to-half": (REFUSED, REFUSED),
    "to-meta": (REFUSED, REFUSED),
    "cuda": (REFUSED, REFUSED),
    "cpu": (REFUSED, REFUSED),
    "half": (REFUSED, REFUSED),
    "float": (REFUSED, REFUSED),
    "bfloat16": (REFUSED, REFUSED),
    "type": (REFUSED, REFUSED),
    "to_empty": (REFUSED, REFUSED),
    "apply": (REFUSED, REFUSED),
    "load_state_dict": (REFUSED, REFUSED),
    "train-eval": (OK, OK),
    "zero_grad": (OK, OK),
    "requires_grad-noop": (OK, OK),
    "requires_grad-freeze": (REFUSED, REFUSED),
}


def run(kind: str, *entries: str) -> str:
    r = subprocess.run(
        [sys.executable, str(WORKER), kind, *entries], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{kind} {entries}: rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


def _check(kind: str, entry: str, out: str) -> None:
    want = ENTRIES[entry][kind == "persistent"]
    assert out.splitlines()[-1] == "CLOSED", out  # then stepped equal to plain, closed, plain
    if want == OK:
        assert "\nOK\n" in f"\n{out}", out
    else:
        assert "REFUSED" in out and "HINT:" in out, out  # a ProtrainError, with its fix


@pytest.mark.parametrize(
    "kind",
    ["offloaded", pytest.param("persistent", marks=pytest.mark.slow)],  # (~9 s)
)
def test_every_entry_works_or_is_refused_by_name(kind):
    # Every entry in one process, each on a model of its own (a crash fails them all; the
    # "== ENTRY" line before it in the output says which: `python tests/usableworker.py KIND
    # ENTRY` reruns that one alone).
    out = run(kind, *ENTRIES)
    parts = out.split("== ")[1:]
    assert [p.split("\n", 1)[0] for p in parts] == list(ENTRIES)
    for part in parts:
        entry, text = part.split("\n", 1)
        _check(kind, entry, text)


ZOO = """
import torch
from harness import make_model, make_plan
from protrain.executor import wrap
from protrain.plans.errors import ProtrainError
model = make_model("gpt2-tiny")
plan = make_plan("gpt2-tiny", persistent=[0], n_buffer=3, policies="keep")
engine = wrap(model, plan, device="cpu")
x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
engine.step((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
ref = make_model("gpt2-tiny")
ref.load_state_dict(engine.state_dict()["model"])
model.eval(); ref.eval()
with torch.no_grad():
    torch.testing.assert_close(model(x[:, :10]), ref(x[:, :10]), rtol=0, atol=0)
assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
for call in (lambda: model(x[:, :10]), lambda: [p.data.sum() for p in model.parameters()],
             lambda: model.half(), lambda: model.apply(print)):
    try:
        call()
        raise SystemExit("not refused")
    except ProtrainError:
        pass
engine.close()
print("ZOO OK")
"""


def test_a_zoo_model_too():
    r = subprocess.run(
        [sys.executable, "-c", ZOO],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    assert r.returncode == 0 and "ZOO OK" in r.stdout, r.stdout + r.stderr[-3000:]
