"""What the engine needs to know about a checkpoint, read from its Hugging Face config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tetri.engine")
LLAMA_FAMILY = {"llama", "qwen2", "mistral"}
FAMILIES = LLAMA_FAMILY | {"opt"}
OPT_ACTIVATIONS = ("relu", "gelu", "silu")  # engine/opt.py's ACTIVATIONS


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
        from tetri_server.modelinfo import rope_context, serving_max_model_len

        return serving_max_model_len(configured,
                                     rope_context(self.max_position_embeddings, self.rope))

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
    if rp["rope_type"] in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rp['rope_type']!r} is not supported (its frequencies "
                         "depend on the sequence's length); use a checkpoint with static RoPE "
                         "scaling")
    return rp


def _unsupported(family: str, hf: Any) -> str | None:
    """What in a config of a supported family this engine would serve wrong or fail to load
    (named, so the user sees which field), or None."""
    if family == "opt":
        if not getattr(hf, "tie_word_embeddings", True):
            return "tie_word_embeddings = false (an LM head of its own)"
        if not getattr(hf, "enable_bias", True):
            return "enable_bias = false"
        if not getattr(hf, "layer_norm_elementwise_affine", True):
            return "layer_norm_elementwise_affine = false"
        if hf.activation_function not in OPT_ACTIVATIONS:
            return (f"activation_function = {hf.activation_function!r} (supported: "
                    f"{', '.join(OPT_ACTIVATIONS)})")
        return None
    if getattr(hf, "hidden_act", "silu") != "silu":
        return f"hidden_act = {hf.hidden_act!r} (the MLP runs SiLU only)"
    if family == "llama" and getattr(hf, "attention_bias", False):
        return "attention_bias = true (biases on q/k/v and o_proj)"
    if (family == "llama" and getattr(hf, "sliding_window", None)
            and "sliding_attention" in (getattr(hf, "layer_types", None) or ())):
        # transformers' Llama applies no window in its forward but its DynamicCache trims to
        # it when generating; vLLM applies it: no one answer to match
        return "sliding_window with sliding_attention layer_types (Llama has no window)"
    if getattr(hf, "mlp_bias", False):
        return "mlp_bias = true"
    return None


def spec_from_hf_config(hf: Any) -> ModelSpec:
    family = getattr(hf, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {sorted(FAMILIES)}")
    reason = _unsupported(family, hf)
    if reason is not None:
        raise ValueError(f"unsupported {family} config: {reason}")
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
    bias = family == "qwen2"  # q/k/v biases (a llama with attention_bias is refused above)
    window = getattr(hf, "sliding_window", None)
    if family == "llama" and window and not getattr(hf, "layer_types", None):
        # Llama has no window: vLLM ignores the field, and so does transformers' forward
        # (transformers 5's DynamicCache still keeps only the last `window` tokens, so its
        # generate() attends to all of the prompt but to a window when decoding)
        log.warning("llama config sets sliding_window=%s: ignored (Llama attends to the whole "
                    "context, as vLLM serves it)", window)
        window = None
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


def check_tied_head(head: Any, embed: Any, *, can_untie: bool = True) -> None:
    """config.json ties the LM head to the embeddings, and the checkpoint also holds an
    ``lm_head.weight``: if it differs, transformers serves that head (it warns, and does not
    tie) while vLLM serves the embeddings. Neither can be matched for both, so it is refused,
    saying how to choose (``can_untie``: the family serves a head of its own; OPT does not).
    Raises ``ValueError``."""
    import torch

    if head is None or torch.equal(head, embed):
        return
    untie = ("set it to false to serve that head (as transformers does), or "
             if can_untie else "")
    raise ValueError(f"the checkpoint's lm_head.weight differs from embed_tokens.weight, but "
                     f"config.json says tie_word_embeddings = true: {untie}drop lm_head.weight "
                     f"from the checkpoint to serve the embeddings (as vLLM does)")
