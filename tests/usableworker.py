"""One call of a wrapped model's public entry, in its own process (tests/test_usable.py).

    python tests/usableworker.py PLAN ENTRY [ENTRY ...]

PLAN is ``offloaded`` (chunk 0 persistent, the rest offloaded) or ``persistent`` (every chunk
persistent). Builds a tiny transformers LLaMA, adapts it (``hf.from_model``), wraps it, takes
one step, calls ENTRY and prints ``OK`` when the call gave the right values or ``REFUSED`` with
the ProtrainError. Then it steps again, closes the engine and checks that the model is a plain
module again, printing ``CLOSED``. A crash (SIGSEGV) shows as the process's return code.
"""

from __future__ import annotations

import copy
import sys
import tempfile

import torch
import transformers

from protrain.executor import wrap
from protrain.planner.models import hf
from protrain.planner.search.emit import emit
from protrain.plans import plan as P
from protrain.plans.errors import ProtrainError

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
B, T = 2, 16


def setup(kind: str):
    torch.manual_seed(0)
    user = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model = hf.from_model(user)
    training = P.Training(
        micro_batch=B,
        seq_len=T,
        compute_dtype="float32",
        master_dtype="float32",
        world_size=1,
        grad_accum=1,
    )
    persistent = list(range(6)) if kind == "persistent" else [0]
    plan = emit(
        model,
        name="usable",
        blocks=model.blocks,
        training=training,
        chunk_numel=40000,  # six chunks
        persistent=persistent,
        n_buffer=4,
        policies=["keep", "checkpoint", "swap", "keep"],
    )
    assert len(plan.chunks.items) == 6
    engine = wrap(model, plan, device="cpu")
    return user, model, engine


def reference(engine) -> transformers.LlamaForCausalLM:
    """A plain model holding the engine's weights."""
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    ref.load_state_dict(engine.state_dict()["model"])
    return ref


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def call(entry: str, user, model, engine, kind: str) -> None:
    ids = torch.randint(0, 256, (B, 9), generator=torch.Generator().manual_seed(5))
    ref = reference(engine)
    if entry.startswith("forward"):  # forward-{train,eval}-{nograd,grad}
        _, mode, grad = entry.split("-")
        user.train(mode == "train")
        ref.train(mode == "train")
        with torch.set_grad_enabled(grad == "grad"):
            got = user(input_ids=ids).logits
        with torch.no_grad():
            same(got, ref(input_ids=ids).logits)  # (dropout 0: train mode is deterministic)
    elif entry == "wrapper":  # protrain's adapter, (idx) -> logits
        with torch.no_grad():
            same(model(ids), ref(input_ids=ids).logits)
    elif entry == "inference_mode":
        with torch.inference_mode():
            got = user(input_ids=ids).logits
        same(got, ref(input_ids=ids).logits.detach())
    elif entry == "generate":
        user.eval()
        ref.eval()
        kw = dict(max_new_tokens=20, do_sample=False, use_cache=True, pad_token_id=0)
        same(user.generate(ids[:1, :4], **kw), ref.generate(ids[:1, :4], **kw))
    elif entry == "lm_head":  # a module inside, called on its own
        with torch.no_grad():
            same(user.lm_head(torch.ones(1, 64)), ref.lm_head(torch.ones(1, 64)))
    elif entry in ("state_dict", "state_dict-block"):
        mine = user.state_dict() if entry == "state_dict" else user.model.layers[1].state_dict()
        prefix = "" if entry == "state_dict" else "model.layers.1."
        want = ref.state_dict()
        assert mine and all(torch.equal(v, want[prefix + k]) for k, v in mine.items())
    elif entry == "save_pretrained":
        with tempfile.TemporaryDirectory() as d:
            user.save_pretrained(d)
            again = transformers.LlamaForCausalLM.from_pretrained(d)
        for k, v in ref.state_dict().items():
            same(again.state_dict()[k], v)
    elif entry == "data":
        want = dict(ref.named_parameters())
        for n, p in user.named_parameters():
            same(p.data, want[n])
    elif entry == "metadata":
        shapes = [
            (n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in user.named_parameters()
        ]
        assert shapes == [(n, p.shape, p.dtype, p.device, True) for n, p in ref.named_parameters()]
        assert user.device == torch.device("cpu") and user.dtype == torch.float32
    elif entry == "grad":
        [p.grad.sum() for p in user.parameters()]
    elif entry == "repr":
        print(repr([p for p in user.parameters()]))
    elif entry == "deepcopy":
        copy.deepcopy(user)
    elif entry == "to-noop":
        assert user.to("cpu") is user and user.to(torch.float32) is user
        assert user.model.to("cpu", torch.float32) is user.model
    elif entry in ("to-half", "to-meta"):
        user.to(torch.float16 if entry == "to-half" else "meta")
    elif entry in ("cuda", "cpu", "half", "float", "bfloat16", "double", "to_empty"):
        getattr(user, entry)(**({"device": "cpu"} if entry == "to_empty" else {}))
    elif entry == "type":
        user.type(torch.float64)
    elif entry == "apply":
        user.apply(lambda m: None)
    elif entry == "load_state_dict":
        user.load_state_dict(ref.state_dict())
    elif entry == "train-eval":
        assert user.eval() is user and not user.model.layers[0].training
        assert user.train() is user and user.model.layers[0].training
    elif entry == "zero_grad":
        user.zero_grad()
        model.zero_grad()
    elif entry == "requires_grad-noop":
        assert user.requires_grad_(True) is user
    elif entry == "requires_grad-freeze":
        user.model.layers[0].requires_grad_(False)
    else:
        raise SystemExit(f"unknown entry {entry!r}")


def main(kind: str, entry: str) -> None:
    user, model, engine = setup(kind)
    x = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(1))
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    engine.step(batch)
    try:
        call(entry, user, model, engine, kind)
        print("OK")
    except ProtrainError as e:
        print(f"REFUSED {type(e).__name__}: {e}")
    # The engine is unharmed: its next step equals a plain one from the same state.
    ref = reference(engine)
    ref.train()
    loss = engine.step(batch).loss
    from protrain.planner.models.zoo import lm_loss

    want = lm_loss(ref(input_ids=batch[0]).logits, batch[1]).item()
    assert abs(loss - want) < 1e-5, (loss, want)
    engine.close()
    # A plain module again: no overrides, no hooks; plain Parameters where their chunk has
    # storage (persistent ones), guarded ones where it was released (offloaded ones).
    assert not any(n in m.__dict__ for m in user.modules() for n in ("to", "state_dict", "apply"))
    persistent = kind == "persistent"
    assert all(
        (type(p) is torch.nn.Parameter) == persistent for p in user.model.layers[1].parameters()
    )
    try:
        user.zero_grad()
        assert user.cpu() is user and user.half().double().float() is user
        logits = user(input_ids=batch[0]).logits  # grad enabled: a plain forward
        assert torch.isfinite(logits).all() and logits.requires_grad and persistent
    except ProtrainError:
        assert not persistent
    print("CLOSED")


if __name__ == "__main__":
    kind, *entries = sys.argv[1:]
    for entry in entries:  # several: each on a model of its own, in turn (one process)
        print(f"== {entry}")
        main(kind, entry)
