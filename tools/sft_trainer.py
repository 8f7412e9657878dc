"""A TRL SFTTrainer script, with protrain or without: what ``python -m tools.bench trainer``
times and tests/test_trainer_dist.py runs under torchrun.

    python tools/sft_trainer.py '{"tokenizer": DIR, "data": JSONL, "out": DIR, ...}'

The JSON's keys: ``protrain`` (false: the plain script; true: the 2 lines of
planner/commands/hf_trainer.py's docstring added); ``plan`` (a plan file; "planner": the
planner's plan for the script's settings at ``budget``, default "8GiB"; "persistent": that
plan with every chunk persistent and every block kept); ``steps``; ``batch``
(per_device_train_batch_size); ``seq`` (max_length); ``hidden``/``layers`` (the llama's
size); ``gradient_checkpointing`` (TRL's default is on; a persistent plan recomputes
nothing, so the benchmark turns it off in both); ``threads`` (torch.set_num_threads;
default torch's). Prints one JSON line on rank 0: the per-step losses and gradient norms,
the plan's world size and chunks, and the input tokens per second over the steps after
``warmup`` (Trainer's ``num_input_tokens_seen`` against the time between the ends of those
steps: start-up and the first steps' warm-up are left out).
"""

from __future__ import annotations

import json
import sys
import time

import datasets
import torch
import transformers
import trl


class StepClock(transformers.TrainerCallback):
    """The time and Trainer's count of input tokens at the end of every step."""

    def __init__(self):
        self.ends: list[tuple[float, int]] = []  # (perf_counter s, num_input_tokens_seen)

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), state.num_input_tokens_seen))


def _all_persistent(model, plan):
    """``plan`` with every chunk persistent and every block's activations kept: the plan
    moves nothing and recomputes nothing, so a run times only the drop-in's machinery."""
    from protrain.planner.models.hf import from_model
    from protrain.planner.search.emit import emit

    adapted = from_model(model)  # (the adapter only reads the model: prepare makes its own)
    return emit(
        adapted,
        name=plan.model.name,
        blocks=plan.model.blocks,
        training=plan.training,
        chunk_numel=plan.chunks.chunk_numel,
        persistent=list(range(len(plan.placement.homes))),
        n_buffer=0,
        policies=["keep"] * len(plan.model.blocks),
        cpu_adam=plan.schedule.cpu_adam,
    )


def main(cfg: dict) -> None:
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(cfg["tokenizer"])
    hidden = cfg.get("hidden", 32)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=cfg.get("layers", 2),
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    )
    args = trl.SFTConfig(
        output_dir=cfg["out"],
        max_length=cfg.get("seq", 64),
        packing=True,
        assistant_only_loss=True,
        per_device_train_batch_size=cfg.get("batch", 2),
        gradient_accumulation_steps=2,
        gradient_checkpointing=cfg.get("gradient_checkpointing", True),
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        learning_rate=3e-3,
        max_steps=cfg["steps"],
        optim="adamw_torch_fused",
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        include_num_input_tokens_seen="all",
        seed=0,
    )
    optimizers, shown = (None, None), None
    if cfg.get("protrain"):
        from protrain.planner.commands.hf_trainer import plan_for, prepare

        plan = cfg.get("plan", "planner")
        if plan in ("planner", "persistent"):
            plan = plan_for(model, args, budget=cfg.get("budget", "8GiB"))
        if cfg.get("plan") == "persistent":
            plan = _all_persistent(model, plan)
        model, optimizer = prepare(model, plan, args)
        optimizers = (optimizer, None)
        shown = model.engine.plan
        shown = {  # what the plan is, for the reader of the output
            "world_size": shown.training.world_size,
            "chunks": len(shown.placement.homes),
            "persistent": shown.placement.n_persist,
        }
    dataset = datasets.load_dataset("json", data_files=cfg["data"])["train"]
    clock = StepClock()
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        optimizers=optimizers,
        callbacks=[clock],
    )
    trainer.train()
    warmup = cfg.get("warmup", 2)
    (t0, n0), (t1, n1) = clock.ends[warmup - 1], clock.ends[-1]
    if args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        rate = (n1 - n0) / (t1 - t0)
        print(
            json.dumps({"losses": losses, "grad_norms": norms, "tokens_per_s": rate, "plan": shown})
        )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
