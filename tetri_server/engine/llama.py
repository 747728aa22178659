"""Llama-family forward (Llama, Qwen2, Mistral): RMSNorm, RoPE (with config scaling), GQA,
SwiGLU, tied or untied embeddings. Weights are fused at load: q|k|v and gate|up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetri_server.engine.attention import BatchMetadata
from tetri_server.engine.kernels import Kernels
from tetri_server.engine.ops.linear import pack_glu_weight, pack_weight
from tetri_server.engine.spec import ModelSpec, check_tied_head


def rope_inv_freq(spec: ModelSpec, hf_config: object) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale, incl. scaling from the config."""
    rope_type = spec.rope.get("rope_type", "default")
    if rope_type == "default":
        dim = spec.head_dim
        theta = float(spec.rope.get("rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scale)


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 window: int = 0) -> None:
        super().__init__()
        s = spec
        self.window = window  # sliding-window attention over the last ``window`` keys; 0: full
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                requires_grad=False)

        self.input_norm = p(s.hidden_size)
        self.qkv = p(qkv_out, s.hidden_size)
        self.qkv_bias = p(qkv_out) if s.attention_bias else None
        self.o = p(s.hidden_size, s.num_heads * s.head_dim)
        self.post_norm = p(s.hidden_size)
        self.gate_up = p(2 * s.intermediate_size, s.hidden_size)
        self.down = p(s.hidden_size, s.intermediate_size)
        self.spec = s
        self.packed: dict[str, torch.Tensor | None] = {}  # oneDNN copies, made by pack()

    def pack(self) -> None:
        """Prepack the matmul weights (after loading them)."""
        self.packed = {n: pack_weight(getattr(self, n)) for n in ("qkv", "o", "down")}
        self.packed["gate_up"] = pack_glu_weight(self.gate_up)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                meta: BatchMetadata, kern: Kernels,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``x`` plus ``pending`` (the last layer's MLP output, None for the
        first layer) -> (the stream, this layer's MLP output). The add is left to the next
        norm (``add_rms_norm``), one pass over the rows instead of two.
        ``rows``: after every row's K/V is written, go on with these rows alone, under
        ``meta.sampled_only`` (the model's last layer, when only they are read)."""
        s = self.spec
        t = x.shape[0]
        linear = kern.linear
        h = kern.rms_norm(x, self.input_norm, s.eps) if pending is None else \
            kern.add_rms_norm(x, pending, self.input_norm, s.eps)  # x += pending
        pk = self.packed
        qkv = linear(h, self.qkv, self.qkv_bias, pk.get("qkv"))
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[:, :nq].view(t, s.num_heads, s.head_dim)
        k = qkv[:, nq:nq + nkv].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, nq + nkv:].view(t, s.num_kv_heads, s.head_dim)
        kern.rope(q, k, cos, sin)  # in place, in qkv
        kern.write_kv(pool_k, pool_v, k, v, meta)
        if rows is not None:
            assert meta.sampled_only is not None
            x, q, meta = x[rows], q[rows], meta.sampled_only
            t = x.shape[0]
            if t == 0:  # nothing sampled: this step only needed the K/V
                return x, x.new_zeros(x.shape)
        attn = kern.attention(q, pool_k, pool_v, meta, window=self.window)
        h = kern.add_rms_norm(x, linear(attn.reshape(t, nq), self.o, None, pk.get("o")),
                              self.post_norm, s.eps)  # x += attention output
        up = kern.glu(h, self.gate_up, pk.get("gate_up"))
        return x, linear(up, self.down, None, pk.get("down"))


class LlamaModel(nn.Module):
    """forward(input_ids [T], meta, pool layers, logits_indices [S]) -> logits [S, vocab].
    With ``meta.sampled_only`` (logits_indices then its rows: the sampled rows, then the prompt
    spans whose logprobs were asked for) the last layer runs those rows alone once every row's
    K/V is written: in a prompt chunk of T tokens it skips T - S rows' attention, o-projection
    and MLP (a 1,024-token prefill of the 8-layer bench model: 1/8 less of those)."""

    def __init__(self, spec: ModelSpec, hf_config: object, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(spec, dtype, device, spec.layer_window(i))
                                    for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.hidden_size, dtype=dtype, device=device),
                                 requires_grad=False)
        self.lm_head = self.embed if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.lm_head_packed: torch.Tensor | None = None
        self.kernels = Kernels()
        inv_freq, self.rope_scale = rope_inv_freq(spec, hf_config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """kv: the pool, [layers, 2, kv_heads, pool_tokens, head_dim]."""
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        freqs = meta.positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None, :]  # [T, 1, D]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None, :]
        last = len(self.layers) - 1 if meta.sampled_only is not None else -1
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, cos, sin, kv[i, 0], kv[i, 1], meta, self.kernels,
                               logits_indices if i == last else None)
        assert pending is not None
        if last < 0:
            x, pending = x[logits_indices], pending[logits_indices]
        x = self.kernels.add_rms_norm(x.contiguous(), pending.contiguous(), self.norm,
                                      self.spec.eps)
        return self.kernels.linear(x, self.lm_head, None, self.lm_head_packed).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """HF names (``model.layers.N.self_attn.q_proj.weight`` ...) -> fused parameters."""
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        with torch.no_grad():
            head = w.pop("lm_head.weight", None)
            if self.spec.tie_word_embeddings:
                check_tied_head(head, w["embed_tokens.weight"])
            self.embed.copy_(w.pop("embed_tokens.weight"))
            self.norm.copy_(w.pop("norm.weight"))
            if not self.spec.tie_word_embeddings:
                if head is None:
                    raise ValueError("checkpoint has no lm_head.weight but tie_word_embeddings"
                                     " is false")
                self.lm_head.copy_(head)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                a = p + "self_attn."
                layer.input_norm.copy_(w.pop(p + "input_layernorm.weight"))
                layer.post_norm.copy_(w.pop(p + "post_attention_layernorm.weight"))
                layer.qkv.copy_(torch.cat([w.pop(a + n + "_proj.weight") for n in "qkv"]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([w.pop(a + n + "_proj.bias") for n in "qkv"]))
                layer.o.copy_(w.pop(a + "o_proj.weight"))
                layer.gate_up.copy_(torch.cat([w.pop(p + "mlp.gate_proj.weight"),
                                               w.pop(p + "mlp.up_proj.weight")]))
                layer.down.copy_(w.pop(p + "mlp.down_proj.weight"))
        leftover = [k for k in w if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
        for layer in self.layers:
            layer.pack()
        self.lm_head_packed = pack_weight(self.lm_head)
