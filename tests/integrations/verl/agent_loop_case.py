"""verl 0.9.1's own rollout half on CPU: its real `AgentLoopWorker`, built from verl's own config, with one fake.

Only the LLM server is faked (`ScriptedServer.generate`: verl's servers need vLLM / SGLang on a GPU). Everything
else is verl's: the config is verl's generated `ppo_trainer` YAML with `actor_rollout_ref.model.external_lib =
routereplay.integrations.verl.fsdp_engine` (the documented "turn it on" line, nothing else of routereplay's), the
worker is `AgentLoopWorker(config, llm_client)` (its `HFModelConfig` loads the checkpoint's config and tokenizer
and imports `external_lib`), the loops are whatever verl's registry names `single_turn_agent` / `tool_agent`, the
tool is a verl function tool loaded from `multi_turn.function_tool_path`, its call parsed by verl's hermes parser,
and the batch comes out of verl's `generate_sequences` / `_postprocess`.

The checkpoint folder holds a tiny dense-first Qwen3-MoE's config (layer 0 dense, layers 1-2 routed, 16
experts, top-2) and a word-level ChatML tokenizer (`<|im_start|>`, `<|im_end|>`, a one-token newline: what
verl's Qwen Continuous Token builder requires). The fake server answers like a model would (a tool call when
the user asks for the tool and no tool has answered, else a short answer ending in `<|im_end|>`) and returns
the routes the rollout model really picks for `prompt_ids + token_ids`, in vLLM's in-process form: uint8
(num_tokens - 1, num_hidden_layers, K), the dense layer zero-filled (`rollout_case.engine_routes`).

Legend: N tokens of a sample, L MoE layers, K top-k.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from routereplay.testing.vllm_models import tiny_vllm_model
from tests.integrations.verl.rollout_case import engine_routes

FAMILY = "qwen3_moe_dense_first"
MODULE = "routereplay.integrations.verl.fsdp_engine"
PROMPT_LENGTH, RESPONSE_LENGTH = 16, 32
CALL = '{"name":"lookup","arguments":{}}'  # one token: the whole tool call's JSON
SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>", "\n", "<tool_call>", "</tool_call>", CALL)
ROLES = ("system", "user", "assistant", "tool")
PAD, IM_START, IM_END, UNK, NEWLINE, CALL_START, CALL_END, CALL_ID = range(len(SPECIALS))
FIRST_WORD = len(SPECIALS) + len(ROLES)
ASK_TOOL = "w40"  # a user prompt holding this word asks for the tool
TOOL_ANSWER = "w30 w31 w32"
TEMPLATE = (  # ChatML, tokens space-separated (the tokenizer splits on spaces and isolates "\n")
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> \n {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
TOOL_FILE = f'''
from verl.tools.function_tool import function_tool


@function_tool
def lookup() -> str:
    """Look the answer up."""
    return "{TOOL_ANSWER}"
'''


def chatml_tokenizer(vocab_size: int) -> Any:
    """Word-level fast tokenizer: the specials, the role names, then `w{i}` for every other id below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + ROLES)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(  # "\n" a token of its own, spaces dropped
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.Split(" ", behavior="removed")]
    )
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_model(seed: int = 0) -> nn.Module:
    model = tiny_vllm_model(FAMILY, seed=seed)
    model.config.use_cache = False
    return model


def write_model_folder(folder: Path, model: nn.Module) -> Path:
    """The checkpoint folder verl's `HFModelConfig` reads: the model's config and the tokenizer (no weights:
    the fake server routes with the model object, and the trainer side is built from the same model)."""
    config: Any = model.config
    config.save_pretrained(folder)
    chatml_tokenizer(int(config.vocab_size)).save_pretrained(folder)
    return folder


def trainer_config(model_folder: Path, tool_file: Path, *, external_lib: str | None = MODULE) -> Any:
    """verl's generated ppo_trainer config, set up for R3 with vLLM and the given model and function tool."""
    import verl
    from omegaconf import OmegaConf

    config: Any = OmegaConf.load(
        os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml")
    )
    model, rollout = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    model.path = str(model_folder)
    model.external_lib = external_lib
    rollout.name = "vllm"
    rollout.prompt_length, rollout.response_length = PROMPT_LENGTH, RESPONSE_LENGTH
    rollout.enable_rollout_routing_replay = True
    rollout.multi_turn.function_tool_path = str(tool_file)
    config.trainer.project_name, config.trainer.experiment_name = "routereplay", "agent-loops"
    return config


class ScriptedServer:
    """The one fake: verl's LLM server client. Answers like a model would and returns the rollout model's real
    routes of `prompt_ids + token_ids` in vLLM's in-process form (uint8, every layer, dense layer zero). A plain
    class, like verl's client: hydra's `instantiate` would turn a dataclass argument into a config node."""

    def __init__(self, model: nn.Module, global_steps: int = 3) -> None:
        self.model, self.global_steps = model, global_steps
        self.with_routes = True  # False: enable_rollout_routing_replay off, the server returns no routes
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt_ids, token_ids) per call

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        prompt = list(prompt_ids)
        asked = int(ASK_TOOL[1:]) in prompt and ROLES.index("tool") + len(SPECIALS) not in prompt
        tokens = [CALL_START, CALL_ID, CALL_END, IM_END] if asked else [50 + len(prompt) % 7, 61, 62, IM_END]
        self.calls.append((prompt, tokens))
        return TokenOutput(
            token_ids=tokens,
            routed_experts=engine_routes(self.model, prompt + tokens) if self.with_routes else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )


def agent_loop_worker(config: Any, server: ScriptedServer) -> Any:
    """verl's own AgentLoopWorker (the class Ray wraps), built by its own __init__."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    return AgentLoopWorker(config, llm_client=server)


def prompts(samples: list[tuple[str, str]]) -> Any:
    """verl's input batch: per sample its agent loop name and a one-message chat (raw_prompt)."""
    from verl import DataProto

    names, chats = np.empty(len(samples), dtype=object), np.empty(len(samples), dtype=object)
    for b, (name, words) in enumerate(samples):
        names[b], chats[b] = name, [{"role": "user", "content": words}]
    index = np.arange(len(samples))
    return DataProto(non_tensor_batch={"agent_name": names, "raw_prompt": chats, "index": index}, meta_info={})


def write_tool_file(folder: Path) -> Path:
    path = folder / "lookup_tool.py"
    path.write_text(TOOL_FILE)
    return path


__all__ = [
    "ASK_TOOL",
    "CALL_START",
    "ScriptedServer",
    "agent_loop_worker",
    "prompts",
    "tiny_model",
    "trainer_config",
    "write_model_folder",
    "write_tool_file",
]
