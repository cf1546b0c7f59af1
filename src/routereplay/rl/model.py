"""The demo model: a tiny MoE that has learned digit addition, trained by the project and cached.

Two architectures:
- `qwen3_moe` (the default): softmax router, top-2 of 8 experts, 4 MoE layers.
- `deepseek_v3`: sigmoid router with a selection bias and group limits, a dense first layer, then
  3 MoE layers.
The model is trained with supervised next-token loss on "a+b=sum<eos>", answer tokens only. This
took about a minute on a 2-core AMD EPYC (longer on busy cores), and the result is cached with save_pretrained and
its tokenizer under `~/.cache/routereplay` (or `$ROUTEREPLAY_CACHE`). `load_or_train(arch, vllm=True)`
is the variant vLLM's CPU backend serves (`VLLM_SERVABLE`: the same architecture with head_dim 64,
the smallest head size its CPU attention runs; the default head_dim 16 is refused there), trained
the same way and cached under its own key. `load_checkpoint` loads any
local HF MoE checkpoint, with clear errors for a missing path, a checkpoint without a tokenizer,
and a model without MoE layers. Nothing is downloaded. Training runs with the intra-op thread count
of `routereplay.threads.ThreadPolicy` (1 unless `threads=` or OMP_NUM_THREADS says otherwise): the
model is far too small to gain from threads, and spinning threads collapse under contention.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from routereplay.enums import StrEnum
from routereplay.errors import AttachError, CheckpointError, ConfigError, NoRoutersError, UnservableModelError
from routereplay.rl.tasks import AdditionTask, build_tokenizer
from routereplay.threads import ThreadPolicy

TRAIN_VERSION = 10  # bump when the recipe changes, so caches are rebuilt
WARMUP_FRACTION = 0.1  # OneCycleLR's pct_start: share of the steps spent warming the learning rate up


class Arch(StrEnum):
    QWEN3_MOE = "qwen3_moe"
    DEEPSEEK_V3 = "deepseek_v3"


# config overrides that make the demo model one vLLM 0.30's CPU backend serves (see
# engines/vllm/checkpoint.check_servable); an arch absent here has no servable variant (DeepSeek-V3's
# CPU MLA needs kv_lora_rank 512: far from a tiny demo model)
VLLM_SERVABLE: dict[Arch, dict[str, Any]] = {Arch.QWEN3_MOE: {"head_dim": 64}}


def vllm_overrides(arch: Arch | str) -> dict[str, Any]:
    """The config overrides of `arch`'s vLLM-servable variant; `UnservableModelError` if it has none."""
    arch = Arch(arch)
    if arch not in VLLM_SERVABLE:
        raise UnservableModelError(
            f"the demo model --arch {arch} has no variant vLLM's CPU backend serves (its MLA needs "
            f"kv_lora_rank 512); use --arch {', '.join(VLLM_SERVABLE)} or pass --model with a checkpoint vLLM serves"
        )
    return dict(VLLM_SERVABLE[arch])


def demo_config(arch: Arch | str, vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides: Any) -> Any:
    """The demo model's config; `overrides` replace fields (tests use smaller models)."""

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    arch = Arch(arch)
    config = _arch_config(arch, common)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _arch_config(arch: Arch, common: dict[str, Any]) -> Any:
    import transformers

    if arch is Arch.QWEN3_MOE:
        return transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=8,
            head_dim=16,  # type: ignore[call-arg]  # a config kwarg the stub does not list
            num_experts=128,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=0.05,  # trained with the load-balancing loss, like real MoEs
        )
    return transformers.DeepseekV3Config(
        **common,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        first_k_dense_replace=1,  # layer 0 dense, like DeepSeek-V3 / Moonlight: MoE layers are 1..7
        n_routed_experts=128,
        num_experts_per_tok=2,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


def cache_dir() -> Path:
    return Path(os.environ.get("ROUTEREPLAY_CACHE", Path.home() / ".cache" / "routereplay"))


def load_or_train(
    arch: Arch | str = Arch.QWEN3_MOE,
    *,
    steps: int = 800,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
    threads: int | None = None,
    vllm: bool = False,
) -> tuple[torch.nn.Module, Any, str]:
    """The cached demo model for `arch` (trained now if absent): (model, tokenizer, where it came from).

    `threads`: intra-op threads while training (None: OMP_NUM_THREADS if set, else 1).
    `vllm`: the variant vLLM's CPU backend serves (`vllm_overrides`), cached under its own key."""
    overrides = vllm_overrides(arch) if vllm else {}
    variant = "".join(f"-{name}{value}" for name, value in sorted(overrides.items()))
    folder = cache_dir() / f"demo-{Arch(arch)}{variant}-v{TRAIN_VERSION}-s{steps}-seed{seed}"
    if (folder / "config.json").exists():
        try:
            model, tokenizer = load_checkpoint(folder)
        except ConfigError as exc:  # a truncated model.safetensors (disk full, killed mid-save, a bad copy)
            raise CheckpointError(
                f"the cached demo model {folder} cannot be loaded: delete that folder (rm -r {folder}) and run again, "
                f"and the model is trained anew and cached (what failed: {_cause(exc)})"
            ) from None
        return model, tokenizer, f"cached: {folder}"
    try:  # an unwritable cache fails now, not after minutes of training
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder.parent):
            pass
    except OSError as exc:
        raise ConfigError(
            f"the demo model cache {folder.parent} cannot be written ({exc.strerror or exc}), so the model would "
            "train and then not be saved; set ROUTEREPLAY_CACHE to a writable folder (default ~/.cache/routereplay), "
            "or pass --model with a local checkpoint"
        ) from exc
    model, tokenizer = train_demo_model(arch, steps=steps, seed=seed, progress=progress, threads=threads, **overrides)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    model.save_pretrained(staging)  # type: ignore[operator]
    tokenizer.save_pretrained(staging)
    if folder.exists():  # another process won the race: keep its copy
        shutil.rmtree(staging)
    else:
        staging.rename(folder)
    # the saved copy, not the in-memory model: its name_or_path is the folder (TRL's colocated vLLM starts
    # from model.name_or_path; the trained model's is ''), exactly as a later cached call returns it
    model, tokenizer = load_checkpoint(folder)
    return model, tokenizer, f"trained now, cached in {folder}"


def train_demo_model(
    arch: Arch | str,
    *,
    steps: int = 600,
    seed: int = 0,
    batch: int = 64,
    lr: float = 5e-3,
    progress: Callable[[int, int, float], None] | None = None,
    threads: int | None = None,
    **overrides: Any,
) -> tuple[torch.nn.Module, Any]:
    """Supervised training on addition (answer tokens only); returns the model in eval mode and its tokenizer.

    `threads`: intra-op threads while training (None: OMP_NUM_THREADS if set, else 1); the caller's
    torch thread count is restored afterwards."""
    if isinstance(steps, bool) or steps < 1 or batch < 1:
        raise ConfigError(f"train_demo_model: steps={steps!r} and batch={batch!r} must be integers >= 1")
    with ThreadPolicy(threads=threads).applied():
        return _train(arch, steps=steps, seed=seed, batch=batch, lr=lr, progress=progress, **overrides)


def _train(
    arch: Arch | str,
    *,
    steps: int,
    seed: int,
    batch: int,
    lr: float,
    progress: Callable[[int, int, float], None] | None,
    **overrides: Any,
) -> tuple[torch.nn.Module, Any]:
    import transformers

    tokenizer = build_tokenizer()
    task = AdditionTask(tokenizer)
    config = demo_config(arch, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps, pct_start=_warmup_fraction(steps)
    )
    for step in range(steps):
        problems = task.problems(batch, seed=seed * 1_000_003 + step)
        sequences = [task.target_ids(p) for p in problems]
        width = max(len(s) for s in sequences)
        ids = torch.full((batch, width), task.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, (problem, sequence) in enumerate(zip(problems, sequences, strict=True)):
            ids[b, : len(sequence)] = torch.tensor(sequence)
            mask[b, : len(sequence)] = 1
            answer_from = len(task.encode(problem.prompt))
            labels[b, answer_from : len(sequence)] = ids[b, answer_from : len(sequence)]
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(step + 1, steps, loss.item())
    return model.eval(), tokenizer


def _warmup_fraction(steps: int) -> float:
    """OneCycleLR's pct_start for `steps`: WARMUP_FRACTION, nudged where OneCycleLR would divide by
    zero (its warm-up phase ends at pct_start * steps - 1, and 0 there is a ZeroDivisionError: steps=10)."""
    return WARMUP_FRACTION if WARMUP_FRACTION * steps != 1 else 1.5 / steps


def load_checkpoint(path: str | Path) -> tuple[torch.nn.Module, Any]:
    """Load a local HF MoE checkpoint and its tokenizer (no network), with clear errors."""
    import transformers

    folder = Path(path)
    if folder.is_file():
        raise ConfigError(
            f"--model {path} is a file, not a folder: pass the checkpoint folder that holds config.json, the weights "
            f"and the tokenizer (save_pretrained's folder; this file's is {folder.parent})"
        )
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise ConfigError(
            f"--model {path}: not a checkpoint folder (no config.json there); pass a save_pretrained folder"
        )
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((folder / name).exists() for name in tokenizer_files):
        raise ConfigError(
            f"--model {path}: the checkpoint has no tokenizer ({', '.join(tokenizer_files)}); save one with "
            "tokenizer.save_pretrained(path)"
        )
    _check_model_type(folder, path)
    from safetensors import SafetensorError

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except SafetensorError as exc:  # a truncated or corrupt model.safetensors: the header does not cover the file
        raise CheckpointError(
            f"--model {path}: its weights (*.safetensors) are truncated or corrupt ({_first_paragraph(exc)}); copy or "
            "save the checkpoint again"
        ) from None
    except (OSError, ValueError, KeyError) as exc:  # e.g. a model_type this transformers does not know
        raise CheckpointError(
            f"--model {path}: cannot load it with transformers ({type(exc).__name__}: {_first_paragraph(exc)})"
        ) from None
    from routereplay.runtime import attach

    try:
        attach(model).detach()
    except NoRoutersError:
        raise NoRoutersError(
            f"--model {path}: {type(model).__name__} has no MoE layers; router replay needs an MoE model"
        ) from None
    except AttachError as exc:
        raise type(exc)(f"--model {path}: {exc}") from None
    return model.eval(), tokenizer


def _check_model_type(folder: Path, path: str | Path) -> None:
    """A config.json whose model_type this transformers does not know: said as a fact, with no guess about why
    (transformers' own error guesses that it is out of date)."""
    import json

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # transformers' own loading names what is wrong with the file
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"--model {path}: its config.json says model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not have; pass a checkpoint of a model type it has"
        )


def _first_paragraph(exc: BaseException) -> str:
    """An exception's message up to its first blank line, on one line (transformers appends paragraphs of advice
    on upgrading it to an unknown model_type's error)."""
    return " ".join(str(exc).split("\n\n", 1)[0].split())


def _cause(exc: ConfigError) -> str:
    """What `load_checkpoint` said, without its `--model PATH: ` head and its advice for a --model (after its last
    `; `): the cache is not a --model, and its fix is to delete the folder."""
    text = str(exc)
    text = text.split(": ", 1)[1] if text.startswith("--model ") else text
    head, _, advice = text.rpartition("; ")
    return head if head and advice.count("(") == advice.count(")") else text


__all__ = [
    "VLLM_SERVABLE",
    "Arch",
    "cache_dir",
    "demo_config",
    "load_checkpoint",
    "load_or_train",
    "train_demo_model",
    "vllm_overrides",
]
