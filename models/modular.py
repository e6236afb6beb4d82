"""A path is a standard `LlamaForCausalLM`; a module is the slice of its state dict one level owns.

A run started from a Hugging Face checkpoint (`model.init_from`, models/hf.py) keeps the checkpoint's
own class and settings: Mistral and Qwen2 name every tensor as Llama does (Qwen2 adds q/k/v biases),
so the key map below is the same for all three; `ModelShape.hf` carries the checkpoint's config.json.

Level l owns a run of consecutive decoder blocks; level 0 also owns the token embedding and the
last level the final norm and LM head (docs/design.md, vocabulary). With `model.path_specific_blocks`
N > 0 a path also has a private module: N blocks after the grid's, before the final norm (DiPaCo's
path-specific parameters), held as one more level, `n_levels`, past the grid's. Splitting and assembling is an
explicit key map, so a path assembled from modules gives exactly the logits of the path it came
from, and `save_pretrained`, `generate` and MLflow's transformers flavour work on it unchanged.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2ForCausalLM,
)

ModuleState = dict[str, torch.Tensor]  # module-local key -> tensor
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
EOS_TOKEN_ID = 50256  # GPT-2's <|endoftext|>
BPE_EOS_TOKEN_ID = 0  # a trained BPE's <|endoftext|>: special tokens come first in its vocabulary
# The families whose decoder blocks carry Llama's tensor names, by config.json's model_type.
MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def eos_token_id(vocab_size: int, tokenizer: str = "gpt2") -> int:
    """The id of <|endoftext|>: GPT-2's (the last id when a test shrinks the vocabulary below
    GPT-2's), or 0 for a BPE trained by the prepare job."""
    if tokenizer == "bpe":
        return BPE_EOS_TOKEN_ID
    return min(EOS_TOKEN_ID, vocab_size - 1)


@dataclass(frozen=True)
class ModelShape:
    """What an assembled path looks like; built from the `model` config section."""

    blocks_per_level: tuple[int, ...]
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tokenizer: str = "gpt2"  # gpt2 | bpe: where <|endoftext|> sits in the vocabulary
    path_blocks: int = 0  # model.path_specific_blocks: the path's own blocks, after the grid's
    hf: str | None = None  # model.init_from: the checkpoint's config.json (sorted JSON: the shape stays hashable)

    @property
    def eos_id(self) -> int:
        if self.hf is not None:  # the checkpoint's own end of text (a list in some configs: its first)
            eos = json.loads(self.hf).get("eos_token_id")
            return int(eos[0] if isinstance(eos, list) else eos)
        return eos_token_id(self.vocab_size, self.tokenizer)

    @property
    def model_class(self) -> type[PreTrainedModel]:
        """LlamaForCausalLM, or the checkpoint's own family (same tensor names, its own attention details)."""
        return MODEL_CLASSES[json.loads(self.hf)["model_type"]] if self.hf is not None else LlamaForCausalLM

    @classmethod
    def from_config(cls, model_config) -> "ModelShape":
        checkpoint = getattr(model_config, "init_config", None)
        if checkpoint:  # model.init_from resolved: every dimension is the checkpoint's
            return cls.from_checkpoint(
                checkpoint, model_config.blocks_per_level, model_config.path_specific_blocks, model_config.seq_len
            )
        hidden = model_config.hidden_size
        # Llama's SwiGLU width: 8/3 of the hidden size, rounded up to a multiple of 64.
        intermediate = model_config.intermediate_size or 64 * -(-(8 * hidden // 3) // 64)
        return cls(
            blocks_per_level=tuple(model_config.blocks_per_level),
            hidden_size=hidden,
            num_heads=model_config.num_heads,
            intermediate_size=intermediate,
            vocab_size=model_config.vocab_size,
            max_positions=model_config.seq_len,
            tokenizer=model_config.tokenizer,
            path_blocks=model_config.path_specific_blocks,
        )

    @classmethod
    def from_checkpoint(
        cls, checkpoint: dict, blocks_per_level, path_blocks: int = 0, seq_len: int = 2048
    ) -> "ModelShape":
        """A path of a Hugging Face checkpoint's family: its config.json's dimensions (heads, KV
        heads, RoPE, norm epsilon, biases travel in `hf`), its layers split as blocks_per_level asks."""
        return cls(
            blocks_per_level=tuple(blocks_per_level),
            hidden_size=checkpoint["hidden_size"],
            num_heads=checkpoint["num_attention_heads"],
            intermediate_size=checkpoint["intermediate_size"],
            vocab_size=checkpoint["vocab_size"],
            max_positions=checkpoint.get("max_position_embeddings") or seq_len,
            tokenizer="hf",
            path_blocks=path_blocks,
            hf=json.dumps(checkpoint, sort_keys=True),
        )

    @property
    def largest_parameter(self) -> int:
        """Elements of the path's largest tensor: the embedding or head (vocab x hidden), or an MLP
        projection when the intermediate width exceeds the vocabulary."""
        return self.hidden_size * max(self.vocab_size, self.intermediate_size, self.hidden_size)

    @property
    def parameter_count(self) -> int:
        """Elements of every trainable tensor of the path, counted on a meta-device model (no memory)."""
        with torch.device("meta"):
            model = self.model_class(self.llama_config())
        return sum(p.numel() for p in model.parameters())

    @property
    def n_levels(self) -> int:
        """The grid's levels (shared modules); the last of them owns the final norm and head."""
        return len(self.blocks_per_level)

    @property
    def module_blocks(self) -> tuple[int, ...]:
        """Blocks per module of a path, in order: the grid's levels, then the private level if any."""
        return self.blocks_per_level + ((self.path_blocks,) if self.path_blocks else ())

    @property
    def n_module_levels(self) -> int:
        """Modules per path: one per grid level, plus its private module when path_blocks > 0."""
        return len(self.module_blocks)

    def first_block(self, level: int) -> int:
        return sum(self.module_blocks[:level])

    def level_of_block(self, block: int) -> int:
        for level in range(self.n_module_levels):
            if block < self.first_block(level + 1):
                return level
        raise KeyError(f"block {block} is beyond the {sum(self.module_blocks)} blocks of the path")

    def llama_config(self) -> PretrainedConfig:
        """The path's transformers config: Llama's from the model section, or the checkpoint's own."""
        if self.hf is not None:
            settings = json.loads(self.hf)
            settings.pop("architectures", None)
            settings.update(
                num_hidden_layers=sum(self.module_blocks),
                tie_word_embeddings=False,  # embedding and head belong to different levels (models/hf.py unties)
                architectures=[self.model_class.__name__],
            )
            return AutoConfig.for_model(settings.pop("model_type"), attn_implementation="sdpa", **settings)
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=sum(self.module_blocks),
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions,
            # Embedding and head belong to different levels, so they cannot share one tensor.
            tie_word_embeddings=False,
            bos_token_id=self.eos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.eos_id,
            attn_implementation="sdpa",
        )


def to_module_key(shape: ModelShape, hf_key: str) -> tuple[int, str]:
    """A Hugging Face key -> (level, module-local key). The explicit half of the key map."""
    if hf_key == EMBED:
        return 0, "embed_tokens.weight"
    if hf_key == NORM:
        return shape.n_levels - 1, "norm.weight"
    if hf_key == HEAD:
        return shape.n_levels - 1, "lm_head.weight"
    match = _LAYER_KEY.match(hf_key)
    if not match:
        raise KeyError(f"{hf_key!r} belongs to no module")
    block = int(match.group(1))
    level = shape.level_of_block(block)
    return level, f"blocks.{block - shape.first_block(level)}.{match.group(2)}"


def to_hf_key(shape: ModelShape, level: int, local_key: str) -> str:
    """(level, module-local key) -> the Hugging Face key. The inverse of to_module_key."""
    if local_key == "embed_tokens.weight" and level == 0:
        return EMBED
    if local_key == "norm.weight" and level == shape.n_levels - 1:
        return NORM
    if local_key == "lm_head.weight" and level == shape.n_levels - 1:
        return HEAD
    match = _BLOCK_KEY.match(local_key)
    if not match or not 0 <= level < shape.n_module_levels or int(match.group(1)) >= shape.module_blocks[level]:
        raise KeyError(f"{local_key!r} is not a key of a level-{level} module")
    return f"model.layers.{shape.first_block(level) + int(match.group(1))}.{match.group(2)}"


def split_path_state(shape: ModelShape, state: dict[str, torch.Tensor]) -> list[ModuleState]:
    """A path's state dict -> one module state per level (its private module last, if any)."""
    modules: list[ModuleState] = [{} for _ in range(shape.n_module_levels)]
    for hf_key, tensor in state.items():
        level, local_key = to_module_key(shape, hf_key)
        modules[level][local_key] = tensor
    return modules


def assemble_path_state(shape: ModelShape, modules: list[ModuleState]) -> dict[str, torch.Tensor]:
    """One module state per level -> a path's Hugging Face state dict."""
    if len(modules) != shape.n_module_levels:
        raise ValueError(f"a path needs {shape.n_module_levels} modules, got {len(modules)}")
    return {to_hf_key(shape, level, k): t for level, module in enumerate(modules) for k, t in module.items()}


_GLOBAL_RNG_LOCK = threading.Lock()


def build_path_model(shape: ModelShape, modules: list[ModuleState] | None = None, seed: int = 0) -> PreTrainedModel:
    """A LlamaForCausalLM (or the checkpoint's family) for one path: seeded fresh weights, or the given
    modules loaded strictly.

    The weights are drawn from torch's one global generator, so the seeding and the drawing hold a
    lock: a sweep's lanes build their round-0 models in threads of one process, and two builds at
    once would interleave their draws (each point's start would depend on its neighbour's timing)."""
    with _GLOBAL_RNG_LOCK:
        torch.manual_seed(seed)
        model = shape.model_class(shape.llama_config())
    if modules is not None:
        missing, unexpected = model.load_state_dict(assemble_path_state(shape, modules), strict=False)
        if missing or unexpected:
            raise ValueError(f"modules do not fit the path model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def path_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The trainable state of a path (buffers such as rotary frequencies are rebuilt, not stored)."""
    return {name: param.detach() for name, param in model.named_parameters()}


def initial_level_states(shape: ModelShape, seed: int) -> list[ModuleState]:
    """Round-0 weights, one state per level: every module of a level starts from the same tensors,
    so every path starts from the same shared model (docs/design.md, round numbering); private modules too."""
    return split_path_state(shape, path_state(build_path_model(shape, seed=seed)))
