"""Worker process for tests/test_any_model.py: builds a generated model, plans it several
ways, trains each plan in lock step with plain PyTorch and reports the outcome.

Protocol: one JSON spec per line on stdin, one JSON result per line on stdout. The
parent runs this in a subprocess so that a crash (a SIGSEGV in a copy from freed
storage) fails the example that caused it instead of killing pytest.

Outcomes per plan: ``ok`` (losses, parameters and buffers equal plain PyTorch, zero
tolerance), ``refused`` (a ``ProtrainError``, its class and message reported for the
parent to check against the documented list), ``mismatch`` or ``error`` (anything
else, with a traceback).
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tools.emulation  # noqa: F401  (PROTRAIN_ASYNC_CPU in this process too: executor/transfer.py EMULATION)
from protrain.executor import AdamWConfig, wrap
from protrain.plans import plan as P
from protrain.plans import validation as V
from protrain.plans.errors import ProtrainError

LR, WD = 1e-2, 0.1


class Block(nn.Module):
    """x + fc2(act(fc1(x))), with optional dropout, BatchNorm and an unused 'expert'."""

    def __init__(self, d: int, s: dict):
        super().__init__()
        self.fc1 = nn.Linear(d, s["h"], bias=s["bias"])
        self.fc2 = nn.Linear(s["h"], d, bias=s["bias"])
        self.drop = nn.Dropout(s["dropout"]) if s["dropout"] else None
        self.bn = nn.BatchNorm1d(d) if s["bn"] else None
        self.spare = nn.Linear(d, s["spare"]) if s["spare"] else None  # never routed to
        if s["buffer"]:
            self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):  # (B, T, d)
        y = self.fc2(F.gelu(self.fc1(x)))
        if self.drop is not None:
            y = self.drop(y)
        if self.bn is not None:
            y = self.bn(y.reshape(-1, y.shape[-1])).reshape(y.shape)
        if hasattr(self, "scale"):
            y = y * self.scale
        return x + y


class AnyModel(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        d, v = s["d"], s["vocab"]
        self.vocab = v
        self.wte = nn.Embedding(v, d)
        self.wpe = nn.Embedding(8, d) if s["pos"] else None
        self.blocks = nn.ModuleList([Block(d, b) for b in s["blocks"]])
        self.head = nn.Linear(d, v, bias=False)
        if s["tie_head"]:
            self.head.weight = self.wte.weight
        if s["tie_blocks"] and len(self.blocks) > 1:
            first, last = self.blocks[0].fc1, self.blocks[-1].fc1
            if first.weight.shape == last.weight.shape:
                last.weight = first.weight
        self.unused = nn.Parameter(torch.randn(s["top_unused"])) if s["top_unused"] else None
        self.repeat = s["repeat"]  # call the first block twice (refused: one step per block)

    def forward(self, idx, targets):  # (B, T) each
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        if self.repeat:
            x = self.blocks[0](x)
        logits = self.head(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def build(s: dict) -> nn.Module:
    torch.manual_seed(s["seed"])
    model = AnyModel(s)
    rng = random.Random(s["seed"])
    for _, p in model.named_parameters():
        if rng.random() < s["frozen_frac"]:
            p.requires_grad_(False)
    return model


def plans(s: dict, model: nn.Module) -> list[tuple[str, P.Plan]]:
    """The spec's plans, each as the planner writes it (emit, or the search over a profile)."""
    from protrain.planner.models.zoo import block_paths
    from protrain.planner.search.emit import assemble, model_facts

    blocks = block_paths(model)
    facts = model_facts(model, "any", blocks, s["seq"])
    numel = {n: max(1, _prod(sh)) for n, sh, _ in facts.params}
    training = P.Training(
        micro_batch=s["micro"],
        seq_len=s["seq"],
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=s["accum"],
    )
    out = []
    for k, ps in enumerate(s["plans"]):
        label = f"{k}:{ps['kind']}"
        try:
            if ps["kind"] in ("search", "milp"):
                out.append((label, _searched(s, facts, ps)))
                continue
            chunk = max(numel.values()) * ps["chunk_factor"]
            policies = ps["policies"][: len(blocks)]
            probe = assemble(
                facts,
                training=training,
                chunk_numel=chunk,
                persistent=[],
                n_buffer=len(numel) + 1,
                policies=policies,
            )
            n = len(probe.chunks.items)
            persistent = {
                "persistent": list(range(n)),
                "offloaded": [],
                "mixed": [c for c in range(n) if ps["mask"] >> (c % 16) & 1],
                "homed": [c for c in range(n) if ps["mask"] >> (c % 16) & 1 and c % 3 == 0],
                "nvme": [c for c in range(n) if ps["mask"] >> (c % 16) & 1 and c % 4 == 0],
            }[ps["kind"]]
            # device homes (executor/chunks.py [Note: device homes]): some offloaded chunks,
            # grad_accum 1 only
            homed = [
                c
                for c in range(n)
                if c not in persistent and (ps["mask"] >> ((c + 5) % 16) & 1 or c == n - 1)
            ]
            homed = homed if ps["kind"] == "homed" and s["accum"] == 1 else []
            # the NVMe tier (executor/nvme.py): some offloaded chunks' states on disk, any
            # accumulation
            nvme = [
                c
                for c in range(n)
                if c not in persistent and (ps["mask"] >> ((c + 3) % 16) & 1 or c == 0)
            ]
            nvme = nvme if ps["kind"] == "nvme" else []
            need = max(
                (len(ids - set(persistent)) for ids in V.segment_chunks(probe).values()), default=0
            )
            out.append(
                (
                    label,
                    assemble(
                        facts,
                        training=training,
                        chunk_numel=chunk,
                        persistent=persistent,
                        n_buffer=max(1, need) + ps["extra_buffers"],
                        policies=policies,
                        device_homed=homed,
                        nvme=nvme,
                    ),
                )
            )
        except ProtrainError as e:
            out.append((label, e))
    return out


def _searched(s: dict, facts, ps: dict) -> P.Plan:
    """A plan from the planner's search (exhaustive or MILP) over a synthetic profile, at a
    budget on its Pareto front (index 0 is the tightest)."""
    from planfactory import gpu_spec, synthetic_profile

    from protrain.planner.search.cost import choose_chunk_numel, facts_from_profile, make_terms
    from protrain.planner.search.exhaustive import exhaustive
    from protrain.planner.search.planning import make_plan

    profile = synthetic_profile(
        facts,
        gpu_spec(),
        block_us=100.0,
        act_bytes=4096 * s["d"],
        micro_batch=s["micro"],
        seq_len=s["seq"],
        dtype="float32",
        rng=random.Random(s["seed"]),
    )
    terms = make_terms(profile, choose_chunk_numel(facts_from_profile(profile))[0])
    front = sorted(exhaustive(terms, 2**62, None).front, key=lambda c: c.peak_bytes)
    budget = int(front[min(ps["front"], len(front) - 1)].peak_bytes) + 1
    solver = "milp" if ps["kind"] == "milp" else "exhaustive"
    return make_plan(
        profile, budget, solver=solver, grad_accum=s["accum"], host_budget_bytes=2**62
    )[0]


def _prod(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def train(s: dict, plan: P.Plan) -> dict:
    """Lock step against plain PyTorch: AdamW(fused=True), checkpointed blocks wrapped in
    ``torch.utils.checkpoint`` (non-reentrant) on the reference too, same data and RNG."""
    model = build(s)
    ref = copy.deepcopy(model)
    for a in plan.activations:
        if a.policy == "checkpoint":
            block = ref.get_submodule(a.block)
            block.forward = (lambda f: lambda *args: checkpoint(f, *args, use_reentrant=False))(
                block.forward
            )
    engine = wrap(
        model,
        plan,
        AdamWConfig(lr=LR, weight_decay=WD),
        device="cpu",
        nvme_dir=tempfile.gettempdir(),
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    g = torch.Generator().manual_seed(s["seed"])
    k = s["accum"]
    data = [
        [
            (
                torch.randint(0, s["vocab"], (s["micro"], s["seq"]), generator=g),
                torch.randint(0, s["vocab"], (s["micro"], s["seq"]), generator=g),
            )
            for _ in range(k)
        ]
        for _ in range(s["steps"])
    ]
    torch.manual_seed(1234)
    rng_ours = rng_ref = torch.get_rng_state()
    try:
        for step, batch in enumerate(data):
            torch.set_rng_state(rng_ours)
            loss = engine.step(batch).loss
            rng_ours = torch.get_rng_state()
            torch.set_rng_state(rng_ref)
            opt.zero_grad(set_to_none=True)
            micro = []
            for x, y in batch:
                ref_loss = ref(x, y)
                (ref_loss if k == 1 else ref_loss / k).backward()
                micro.append(ref_loss.detach())
            opt.step()
            rng_ref = torch.get_rng_state()
            want = micro[0].item() if k == 1 else torch.stack(micro).float().mean().item()
            if loss != want:
                return {
                    "status": "mismatch",
                    "detail": f"step {step}: loss {loss!r} != plain {want!r}",
                }
        sd = engine.state_dict()["model"]
        for name, p in ref.named_parameters():
            if not torch.equal(sd[name], p.detach()):
                diff = (sd[name] - p.detach()).abs().max().item()
                return {
                    "status": "mismatch",
                    "detail": f"parameter {name} {tuple(p.shape)} "
                    f"frozen={not p.requires_grad}: max |diff| {diff:.3g}",
                }
        ours = dict(model.named_buffers())
        for name, b in ref.named_buffers():
            if not torch.equal(ours[name], b):
                return {"status": "mismatch", "detail": f"buffer {name} differs"}
    finally:
        engine.close()
    return {"status": "ok"}


def run(s: dict) -> list[dict]:
    results = []
    try:
        made = plans(s, build(s))
    except ProtrainError as e:  # refused while tracing the model: no plan at all
        made = [("trace", e)]
    for label, plan in made:
        try:
            if isinstance(plan, ProtrainError):
                raise plan
            res = train(s, plan)
        except ProtrainError as e:
            res = {"status": "refused", "type": type(e).__name__, "detail": e.message}
        except Exception:  # noqa: BLE001 - reported to the parent with the example
            res = {"status": "error", "detail": traceback.format_exc(limit=6)}
        res["plan"] = label
        results.append(res)
    return results


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        try:
            out = run(json.loads(line))
        except Exception:  # noqa: BLE001
            out = [{"status": "error", "plan": "build", "detail": traceback.format_exc(limit=6)}]
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])  # planfactory
    main()
