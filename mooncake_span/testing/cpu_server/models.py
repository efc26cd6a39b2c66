"""Tiny random-weight models made locally, for real servers on a CPU box (no download).

Two shapes cover sglang's two KV host pool families: ``llama`` (MHA, a
``LlamaForCausalLM``) and ``deepseek_v2`` (MLA, a ``DeepseekV2ForCausalLM`` with
dense MLPs only). Weights come from a seeded initialisation, so the same spec
gives the same bytes; each model directory carries a word-level tokenizer whose
tokens are ``w0 .. w{vocab-1}``, so a text prompt and its token ids map one to
one. :func:`ensure_model` makes a model once per spec under a cache folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "deepseek_v2")
# Special tokens sit after the words, so word ids equal token ids.
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class TinyModelSpec:
    architecture: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    vocab_words: int = 509
    max_position_embeddings: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_words"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def vocab_size(self) -> int:
        return self.vocab_words + len(_SPECIAL_TOKENS)

    @property
    def is_mla(self) -> bool:
        return self.architecture == "deepseek_v2"

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _config(spec: TinyModelSpec):
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=spec.vocab_words + 1,
        eos_token_id=spec.vocab_words + 2,
        pad_token_id=spec.vocab_words,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if not spec.is_mla:
        from transformers import LlamaConfig

        return LlamaConfig(head_dim=spec.hidden_size // spec.num_heads, **common)
    from transformers import DeepseekV2Config

    head_dim = spec.hidden_size // spec.num_heads
    return DeepseekV2Config(
        kv_lora_rank=head_dim * 2,
        q_lora_rank=None,
        qk_rope_head_dim=head_dim,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        # Dense MLPs in every layer: sglang's MoE path needs kernels a CPU lacks.
        first_k_dense_replace=spec.num_layers,
        moe_layer_freq=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=spec.hidden_size,
        # sglang's CPU rope accepts only DeepSeek's yarn; factor 1 makes it plain rope.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": spec.max_position_embeddings,
        },
        **common,
    )


def _save_tokenizer(spec: TinyModelSpec, directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(spec.vocab_words)}
    for offset, token in enumerate(_SPECIAL_TOKENS):
        vocab[token] = spec.vocab_words + offset
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


def make_model(spec: TinyModelSpec, directory: Path) -> Path:
    """Write the model (config, safetensors weights, tokenizer) into ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_config(spec), dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(spec, directory)
    (directory / "tiny_model_spec.json").write_text(json.dumps(asdict(spec), indent=1))
    return directory


def ensure_model(spec: TinyModelSpec, cache_dir: Path) -> Path:
    """The model directory for ``spec`` under ``cache_dir``, made on first use."""
    target = cache_dir / f"{spec.architecture}-{spec.digest()}"
    if (target / "tiny_model_spec.json").exists():
        return target
    staging = cache_dir / f".{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    make_model(spec, staging)
    try:
        staging.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("made tiny %s model at %s", spec.architecture, target)
    return target


def prompt_text(token_ids: list[int]) -> str:
    """The text the tiny tokenizer turns into exactly ``token_ids`` (words only)."""
    return " ".join(f"w{i}" for i in token_ids)
