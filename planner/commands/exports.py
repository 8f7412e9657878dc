"""What a training run writes when it ends or fails: the exported model (``--export``,
``--export-merged``, a LoRA adapter) and, when a save fails for want of room, the rescued
checkpoint (``rescue``). The trained state stays in a checkpoint until an export succeeds,
so a failed export loses nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..models.zoo import build, is_hf_name


def export_keeper(export_dir: str) -> Path:
    """Where a run with ``--export`` and no ``--save-dir`` keeps its final checkpoint until the
    export has succeeded: beside the export directory."""
    out = Path(export_dir)
    return out.with_name(f"{out.name}.checkpoint")


def export_model(
    engine, model, model_name, export_dir, save_dir, tok_dir, rank, echo, chat_template=None
) -> None:
    """Export the trained model; the state stays in a checkpoint until the export succeeded
    (the run's last one, or one written for it), and a failed export names it."""
    from protrain.plans.errors import CheckpointError, ProtrainError

    from ..models.hf import export, parse_hf_name
    from ..models.hf_checkpoint import write_hint

    config = parse_hf_name(model_name)[0]
    keeper = None
    if save_dir is None:  # the end-of-run checkpoint a --save-dir would have had
        keeper = export_keeper(export_dir)
        try:
            engine.save(keeper, keep=1)
        except CheckpointError as e:  # a full disk beside the export: the state goes elsewhere
            failed, keeper = keeper, rescue(engine, {}, e, echo)
            if keeper is None:
                if failed_write(e) is None:
                    raise
                raise CheckpointError(
                    e.message, write_hint(failed_write(e), failed.parent, "train again")
                ) from failed_write(e)
            if rank == 0 and not any(p.name.startswith("step-") for p in failed.iterdir()):
                import shutil

                shutil.rmtree(failed, ignore_errors=True)  # (its lock file alone)
    kept = engine.last_checkpoint
    state = engine.state_dict()["model"]  # a collective on several ranks
    if rank != 0:
        return
    try:
        export(
            model,
            state,
            export_dir,
            config_path=config,
            tokenizer_dir=tok_dir,
            chat_template=chat_template,
        )
    except ProtrainError as e:
        raise type(e)(
            f"{e.message}; the trained model is safe in the checkpoint {kept}",
            write_hint(
                e.__context__,
                Path(export_dir).parent,
                f"`protrain export --resume {kept} --hf-config {config} -o {export_dir}`",
            ),
        ) from None
    echo(f"exported {export_dir} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    if keeper is not None:
        import shutil

        shutil.rmtree(keeper, ignore_errors=True)


RESCUE_PREFIX = "protrain-rescue-"


def rescue_dirs() -> list[Path]:
    """Where a checkpoint whose own directory could not be written goes instead: the temporary
    directory ($TMPDIR, else the system's) and the home directory, in that order."""
    import tempfile

    seen, out = set(), []
    for d in (os.environ.get("TMPDIR") or tempfile.gettempdir(), os.path.expanduser("~")):
        if d and os.path.isdir(d) and os.path.realpath(d) not in seen:
            seen.add(os.path.realpath(d))
            out.append(Path(d))
    return out


def failed_write(error: BaseException) -> BaseException | None:
    """The write error behind a ``CheckpointError`` (``checkpoint._save_failed`` raises it from
    the ``OSError`` or ``SafetensorError`` of a full disk, a file-size limit, a permission), or
    None when the save was refused for another reason (a non-finite state)."""
    from safetensors import SafetensorError

    cause = error.__context__
    return cause if isinstance(cause, OSError | SafetensorError) else None


def rescue(engine, data: dict, failed, echo, lr_schedule: dict | None = None) -> Path | None:
    """Save the trained state somewhere with room after ``failed`` (a ``CheckpointError`` from a
    write that failed: ``failed_write``): the first of ``rescue_dirs`` with room for it; return
    the checkpoint root written, or None (not a failed write, none had room, or several ranks:
    a rescue directory would have to be one all ranks see). Says where on ``echo``."""
    import shutil

    from protrain.plans.errors import CheckpointError

    if engine.comm.world != 1 or failed_write(failed) is None:
        return None
    need = sum(
        t.numel() * t.element_size()
        for group in engine.state_dict(trainable_only=bool(engine.base_fingerprint)).values()
        for v in group.values()
        for t in (v.values() if isinstance(v, dict) else [v])
    )
    for d in rescue_dirs():
        try:
            if shutil.disk_usage(d).free < need + (1 << 20):
                continue
        except OSError:
            continue
        root = d / f"{RESCUE_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            engine.save(root, data=data, keep=1, lr_schedule=lr_schedule)
        except CheckpointError:
            shutil.rmtree(root, ignore_errors=True)
            continue
        echo(f"{failed.message}; saved the trained state to {root} instead")
        return root
    return None


def export_lora(
    engine,
    model,
    model_name,
    lora,
    export_dir,
    export_merged,
    tok_dir,
    rank,
    echo,
    base_name=None,
    chat_template=None,
) -> None:
    """``--export`` of a LoRA run: the adapter in peft's format, naming its base ``base_name``
    (as the user gave it: ``lora.base_name``); ``--export-merged``: the base with it merged in,
    as a Hugging Face directory (planner/models/lora.py)."""
    from ..models import lora as L

    state = engine.state_dict()["model"]  # a collective on several ranks
    if rank != 0:
        return
    base = L.base_name(base_name or model_name) if is_hf_name(model_name) else ""
    if export_dir is not None:
        L.export_adapter(
            model,
            state,
            lora,
            export_dir,
            base_name=base,
            tokenizer_dir=tok_dir,
            chat_template=chat_template,
        )
        echo(f"exported {export_dir} (peft.PeftModel.from_pretrained(base, DIR) loads the adapter)")
    if export_merged is not None:
        from ..models.hf import export, parse_hf_name

        config = parse_hf_name(model_name)[0]
        export(
            build(model_name, device="meta"),
            L.merged_state_dict(model, state),
            export_merged,
            config_path=config,
            tokenizer_dir=tok_dir,
            chat_template=chat_template,
        )
        echo(
            f"exported {export_merged} (the adapter merged in; "
            "AutoModelForCausalLM.from_pretrained loads it)"
        )
