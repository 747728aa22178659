"""What the engine needs to know about a checkpoint, read from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_FAMILY = {"llama", "qwen2", "mistral"}
FAMILIES = LLAMA_FAMILY | {"opt"}


@dataclass(frozen=True)
class ModelSpec:
    family: str  # llama | qwen2 | mistral | opt
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # llama family
    attention_bias: bool = False
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    # per layer: True = sliding-window attention (transformers' layer_types); () = every layer
    sliding_layers: tuple[bool, ...] = ()
    # opt
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    activation: str = "silu"
    remove_final_layer_norm: bool = False

    def max_model_len(self, configured: int = 0) -> int:
        """The context length served: ``configured`` (0 = the model's), never above the
        model's positions. The one rule for the control process, the workers and the engine;
        a sliding window does not shorten it (attention applies the window)."""
        from tetri_server.modelinfo import serving_max_model_len

        return serving_max_model_len(configured, self.max_position_embeddings)

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` attends to at most (its last ones); 0 = all of them."""
        if not self.sliding_window:
            return 0
        if self.sliding_layers and not self.sliding_layers[layer]:
            return 0
        return self.sliding_window

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of K+V per token over all layers (times the dtype's size for bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def blocks_in_budget(self, budget_bytes: float, element_size: int, block_size: int) -> int:
        """KV blocks of ``block_size`` tokens that fit in ``budget_bytes``."""
        return int(budget_bytes // (self.kv_elems_per_token * element_size * block_size))


def _eos_ids(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _rope_params(hf: Any) -> dict[str, Any]:
    """transformers 5 keeps ``rope_parameters``; 4.x keeps ``rope_theta`` + ``rope_scaling``."""
    rp = getattr(hf, "rope_parameters", None)
    if not rp:
        rp = dict(getattr(hf, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    if rp["rope_type"] == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported (its frequencies depend on the "
                         "batch's length); use a checkpoint with static RoPE scaling")
    return rp


def spec_from_hf_config(hf: Any) -> ModelSpec:
    family = getattr(hf, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {sorted(FAMILIES)}")
    if family == "opt":
        heads = hf.num_attention_heads
        return ModelSpec(
            family=family, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
            head_dim=hf.hidden_size // heads, intermediate_size=hf.ffn_dim,
            max_position_embeddings=hf.max_position_embeddings, eps=1e-5,
            tie_word_embeddings=True, eos_token_ids=_eos_ids(hf),
            bos_token_id=getattr(hf, "bos_token_id", None),
            do_layer_norm_before=hf.do_layer_norm_before,
            word_embed_proj_dim=hf.word_embed_proj_dim or hf.hidden_size,
            activation=hf.activation_function,
            remove_final_layer_norm=getattr(hf, "_remove_final_layer_norm", False),
        )
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    bias = family == "qwen2" or bool(getattr(hf, "attention_bias", False))
    window = getattr(hf, "sliding_window", None)
    if family == "qwen2" and not getattr(hf, "use_sliding_window", False):
        window = None
    sliding_layers: tuple[bool, ...] = ()
    layer_types = getattr(hf, "layer_types", None)
    if window and layer_types:
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    elif window and family == "qwen2":  # transformers 4.x: layers from max_window_layers on
        first = getattr(hf, "max_window_layers", 0)
        sliding_layers = tuple(i >= first for i in range(hf.num_hidden_layers))
    return ModelSpec(
        family=family, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(hf), bos_token_id=getattr(hf, "bos_token_id", None),
        attention_bias=bias, rope=_rope_params(hf), sliding_window=window,
        sliding_layers=sliding_layers,
        activation=getattr(hf, "hidden_act", "silu"),
    )
