"""Tiny random-weight models made locally, for real servers on a CPU box (no download).

Three shapes cover sglang's host pool families: ``llama`` (MHA, a
``LlamaForCausalLM``), ``deepseek_v2`` (MLA, a ``DeepseekV2ForCausalLM`` with
dense MLPs only) and ``glm5_next`` (GLM-5.3-Flash: MLA KV, a compressed DSA
indexer pool with ``index_kpool=4`` and KDA linear-attention state, a
``Glm5NextForConditionalGeneration`` made with transformers' own config class).
Weights come from a seeded initialisation, so the same spec gives the same
bytes; each model directory carries a word-level tokenizer whose tokens are
``w0 .. w{vocab-1}``, so a text prompt and its token ids map one to one.
:func:`ensure_model` makes a model once per spec under a cache folder, and
:func:`serving_profile` says what a server needs to serve it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "deepseek_v2", "glm5_next")
# Special tokens sit after the words, so word ids equal token ids.
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# What GLM-5.3-Flash's processor looks up in its tokenizer (after the specials).
_GLM_MEDIA_TOKENS = (
    "<|image|>",
    "<|video|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
# A chat template joining the text parts: sglang's start-up request goes through it.
_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %} {% endfor %}"
)
# GLM-5.3-Flash's compressed index keys pool 4 tokens; its indexer head is 128
# wide (sglang requires it); stock sglang 0.5.23 then serves 64 * 4 = 256-token pages.
GLM_INDEX_KPOOL = 4
GLM_INDEX_HEAD_DIM = 128
GLM_PAGE_TOKENS = 64 * GLM_INDEX_KPOOL


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
        return self.vocab_words + len(_SPECIAL_TOKENS) + len(self.media_tokens)

    @property
    def media_tokens(self) -> tuple[str, ...]:
        return _GLM_MEDIA_TOKENS if self.architecture == "glm5_next" else ()

    @property
    def is_mla(self) -> bool:
        return self.architecture in ("deepseek_v2", "glm5_next")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """GLM's layers, alternating KDA and DSA (ending on DSA, as the model does)."""
        return tuple(
            "indexed_attention" if (self.num_layers - 1 - i) % 2 == 0 else "linear_attention"
            for i in range(self.num_layers)
        )

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# GLM-5.3-Flash's tiny shape has two KDA and two DSA layers; the others two layers.
DEFAULT_LAYERS = {"llama": 2, "deepseek_v2": 2, "glm5_next": 4}


def default_spec(architecture: str, **fields: Any) -> TinyModelSpec:
    """The tiny model the tests, the demo and the serving bench use for ``architecture``."""
    if architecture not in DEFAULT_LAYERS:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    fields.setdefault("num_layers", DEFAULT_LAYERS[architecture])
    return TinyModelSpec(architecture=architecture, **fields)


def _config(spec: TinyModelSpec):
    if spec.architecture == "glm5_next":
        return _glm5_next_config(spec)
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


def _glm5_next_config(spec: TinyModelSpec):
    """transformers' own ``Glm5NextConfig``, small, dense MLPs, every DSA layer with an indexer."""
    from transformers import Glm5NextConfig

    head_dim = spec.hidden_size // spec.num_heads
    media = {
        f"{name}_token_id": spec.vocab_words + len(_SPECIAL_TOKENS) + i
        for i, name in enumerate(
            ("image", "video", "image_start", "image_end", "video_start", "video_end")
        )
    }
    text = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        moe_intermediate_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        # Dense MLPs in every layer (sglang's MoE path needs kernels a CPU lacks);
        # transformers reads mlp_layer_types, sglang first_k_dense_replace.
        mlp_layer_types=["dense"] * spec.num_layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=head_dim * 2,
        kv_lora_rank=head_dim * 2,
        qk_rope_head_dim=0,  # DSA layers are NoPE
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        layer_types=list(spec.layer_types),
        indexer_types=["full"] * spec.num_layers,
        index_kpool=GLM_INDEX_KPOOL,
        index_head_dim=GLM_INDEX_HEAD_DIM,
        index_n_heads=2,
        index_topk=GLM_PAGE_TOKENS,
        linear_num_heads=max(1, spec.num_heads // 2),
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=spec.vocab_words,
        bos_token_id=spec.vocab_words + 1,
        eos_token_id=spec.vocab_words + 2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=spec.hidden_size,
        projection_intermediate_size=64,
        swiglu_limit=10.0,
    )
    return Glm5NextConfig(text_config=text, vision_config=vision, **media)


# Keys sglang's Glm5NextTextConfig reads that transformers' strict config does not carry.
_GLM_SGLANG_KEYS = {"mhc": True, "index_kpool_compress": True}


def _finish_glm5_next(spec: TinyModelSpec, model) -> None:
    """Give the indexer's compression non-trivial weights, then the sglang-only config keys.

    transformers initialises the compression gate to ones and its positional
    term to zeros, which makes every channel weigh a pool's tokens alike; the
    checks of the compressed keys need them to differ.
    """
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("index_kpool_compress_gate"):
            param.data = torch.randn(param.shape, generator=generator) * 0.2
        elif name.endswith("index_kpool_compress_ape"):
            param.data = torch.randn(param.shape, generator=generator)


def _glm_config_json(spec: TinyModelSpec, directory: Path) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["text_config"].update(_GLM_SGLANG_KEYS, first_k_dense_replace=spec.num_layers)
    path.write_text(json.dumps(config, indent=1))


def _save_tokenizer(spec: TinyModelSpec, directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(spec.vocab_words)}
    for offset, token in enumerate((*_SPECIAL_TOKENS, *spec.media_tokens)):
        vocab[token] = spec.vocab_words + offset
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(spec.media_tokens),
    )
    if not spec.media_tokens:
        fast.save_pretrained(directory)
        return
    # sglang's tokenizer manager loads GLM-5.3-Flash's processor (image and video
    # processors beside the tokenizer) and sends a chat request at start-up.
    from transformers.models.glm5_next import Glm5NextProcessor
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    fast.chat_template = _CHAT_TEMPLATE
    processor = Glm5NextProcessor(
        image_processor=Glm5NextImageProcessor(),
        tokenizer=fast,
        video_processor=Glm5NextVideoProcessor(),
        chat_template=_CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)


def make_model(spec: TinyModelSpec, directory: Path) -> Path:
    """Write the model (config, safetensors weights, tokenizer) into ``directory``."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    if spec.architecture == "glm5_next":
        from transformers import Glm5NextForConditionalGeneration

        model = Glm5NextForConditionalGeneration(_config(spec)).float()
        _finish_glm5_next(spec, model)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_config(spec), dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    if spec.architecture == "glm5_next":
        _glm_config_json(spec, directory)
    _save_tokenizer(spec, directory)
    (directory / "tiny_model_spec.json").write_text(json.dumps(asdict(spec), indent=1))
    return directory


def ensure_model(spec: TinyModelSpec, cache_dir: Path) -> Path:
    """The model directory for ``spec`` under ``cache_dir``, made on first use."""
    target = cache_dir / f"{spec.architecture}-{spec.digest()}"
    if (target / "tiny_model_spec.json").exists():
        return target
    # Processes sharing the cache (parallel test workers) make each model once:
    # the others wait for the lock and then find it made.
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "tiny_model_spec.json").exists():
            return target
        staging = cache_dir / f".{target.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        make_model(spec, staging)
        staging.rename(target)
    logger.info("made tiny %s model at %s", spec.architecture, target)
    return target


@dataclass(frozen=True)
class ServingProfile:
    """What ``sglang.launch_server`` needs beyond the common flags to serve a tiny model."""

    page_size_tokens: int
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    max_total_tokens: int = 4096

    def server_fields(self, extra_args: tuple[str, ...] = (), env: Any = ()) -> dict[str, Any]:
        """``ServerOptions`` fields for this model, with a caller's own flags and env added."""
        return {
            "page_size_tokens": self.page_size_tokens,
            "max_total_tokens": self.max_total_tokens,
            "extra_args": (*self.extra_args, *extra_args),
            "env": {**dict(self.env), **dict(env)},
        }


# Requests a GLM server keeps Mamba/KDA state for: sglang caps running requests
# by it (5 state slots per request with the radix cache's snapshots).
GLM_MAMBA_CACHE_SLOTS = 48


def serving_profile(spec: TinyModelSpec) -> ServingProfile:
    if spec.architecture != "glm5_next":
        return ServingProfile(page_size_tokens=64)
    return ServingProfile(
        page_size_tokens=GLM_PAGE_TOKENS,
        extra_args=(
            "--max-mamba-cache-size",
            str(GLM_MAMBA_CACHE_SLOTS),
            # A prefill keeps the KDA state only at the end of each chunk (the
            # last page boundary it reaches): one page per chunk leaves a state
            # at every page, so any page-aligned prefix is restorable, as
            # GLM-5.3-Flash's radix cache needs (a prompt prefilled in one
            # chunk keeps a state only past its last page, which no later
            # request can restore: sglang always computes the last page).
            "--chunked-prefill-size",
            str(GLM_PAGE_TOKENS),
        ),
        # The KDA conv window in the model's dtype (sglang keeps it in bf16 by
        # default, and the fp32 tiny model's activations would not fit it).
        env=(("SGLANG_MAMBA_CONV_DTYPE", "float32"),),
        max_total_tokens=8192,
    )


def prompt_text(token_ids: list[int]) -> str:
    """The text the tiny tokenizer turns into exactly ``token_ids`` (words only)."""
    return " ".join(f"w{i}" for i in token_ids)
