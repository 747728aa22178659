"""OPT forward (the paper's model): learned positions with offset 2, LayerNorm (pre- or post-),
ReLU MLP, embeddings tied to the LM head, optional project_in/out (OPT-350m)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetri_server.engine.attention import BatchMetadata
from tetri_server.engine.kernels import Kernels
from tetri_server.engine.ops.linear import pack_weight
from tetri_server.engine.spec import ModelSpec, check_tied_head

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                 requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class _Linear(nn.Linear):
    """nn.Linear whose weight ``pack()`` prepacks (after loading) for ``ops.linear``; called
    with the model's ``Kernels``."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor, kern: Kernels) -> torch.Tensor:
        return kern.linear(x, self.weight, self.bias, self.packed)


def _linear(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device,
            bias: bool = True) -> _Linear:
    lin = _Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    lin.requires_grad_(False)
    return lin


class OPTLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.attn_norm = _LayerNorm(h, spec.eps, dtype, device)
        self.qkv = _linear(h, 3 * h, dtype, device)
        self.out = _linear(h, h, dtype, device)
        self.mlp_norm = _LayerNorm(h, spec.eps, dtype, device)
        self.fc1 = _linear(h, spec.intermediate_size, dtype, device)
        self.fc2 = _linear(spec.intermediate_size, h, dtype, device)
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                meta: BatchMetadata, kern: Kernels,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows``: as in ``LlamaLayer.forward`` (the last layer under
        ``meta.sampled_only``)."""
        s, t = self.spec, x.shape[0]
        pre = s.do_layer_norm_before
        h = self.attn_norm(x) if pre else x
        q, k, v = self.qkv(h, kern).view(t, 3, s.num_heads, s.head_dim).unbind(1)
        kern.write_kv(pool_k, pool_v, k, v, meta)
        if rows is not None:
            assert meta.sampled_only is not None
            x, q, meta = x[rows], q[rows], meta.sampled_only
            t = x.shape[0]
            if t == 0:
                return x
        x = x + self.out(kern.attention(q, pool_k, pool_v, meta).reshape(t, s.hidden_size), kern)
        if not pre:
            x = self.attn_norm(x)
        h = self.mlp_norm(x) if pre else x
        x = x + self.fc2(self.act(self.fc1(h, kern)), kern)
        return x if pre else self.mlp_norm(x)


class OPTModel(nn.Module):
    """forward(input_ids [T], meta, kv pool, logits_indices [S]) -> logits [S, vocab]; the last
    layer runs the sampled rows alone under ``meta.sampled_only`` (see ``LlamaModel``)."""

    def __init__(self, spec: ModelSpec, hf_config: object, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        e = spec.word_embed_proj_dim
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, e, dtype=dtype, device=device),
                                  requires_grad=False)
        self.positions = nn.Parameter(
            torch.empty(spec.max_position_embeddings + POSITION_OFFSET, spec.hidden_size,
                        dtype=dtype, device=device), requires_grad=False)
        proj = e != spec.hidden_size
        self.project_in = _linear(e, spec.hidden_size, dtype, device, bias=False) if proj else None
        self.project_out = _linear(spec.hidden_size, e, dtype, device, bias=False) if proj else None
        self.layers = nn.ModuleList(OPTLayer(spec, dtype, device) for _ in range(spec.num_layers))
        self.embed_packed: torch.Tensor | None = None  # the LM head's (tied) oneDNN copy
        self.kernels = Kernels()
        self.final_norm = (_LayerNorm(spec.hidden_size, spec.eps, dtype, device)
                           if spec.do_layer_norm_before and not spec.remove_final_layer_norm
                           else None)

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        kern = self.kernels
        x = F.embedding(input_ids, self.embed)
        if self.project_in is not None:
            x = self.project_in(x, kern)
        x = x + F.embedding(meta.positions + POSITION_OFFSET, self.positions)  # [T, hidden]
        last = len(self.layers) - 1 if meta.sampled_only is not None else -1
        for i, layer in enumerate(self.layers):
            x = layer(x, kv[i, 0], kv[i, 1], meta, kern, logits_indices if i == last else None)
        if last < 0:
            x = x[logits_indices]
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x, kern)
        return kern.linear(x, self.embed, None, self.embed_packed).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        w = {k.removeprefix("model.").removeprefix("decoder."): v for k, v in weights.items()}
        check_tied_head(w.pop("lm_head.weight", None), w["embed_tokens.weight"],
                        can_untie=False)  # an untied OPT head is refused (``_unsupported``)
        with torch.no_grad():
            self.embed.copy_(w.pop("embed_tokens.weight"))
            self.positions.copy_(w.pop("embed_positions.weight"))
            for name in ("project_in", "project_out"):
                mod = getattr(self, name)
                if mod is not None:
                    mod.weight.copy_(w.pop(f"{name}.weight"))
            if self.final_norm is not None:
                self.final_norm.weight.copy_(w.pop("final_layer_norm.weight"))
                self.final_norm.bias.copy_(w.pop("final_layer_norm.bias"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                a = p + "self_attn."
                for part in ("weight", "bias"):
                    getattr(layer.qkv, part).copy_(
                        torch.cat([w.pop(f"{a}{n}_proj.{part}") for n in "qkv"]))
                    getattr(layer.out, part).copy_(w.pop(f"{a}out_proj.{part}"))
                    getattr(layer.attn_norm, part).copy_(w.pop(f"{p}self_attn_layer_norm.{part}"))
                    getattr(layer.mlp_norm, part).copy_(w.pop(f"{p}final_layer_norm.{part}"))
                    getattr(layer.fc1, part).copy_(w.pop(f"{p}fc1.{part}"))
                    getattr(layer.fc2, part).copy_(w.pop(f"{p}fc2.{part}"))
        if w:
            raise ValueError(f"unexpected weights in checkpoint: {list(w)[:5]}")
        for mod in self.modules():
            if isinstance(mod, _Linear):
                mod.pack()
        self.embed_packed = pack_weight(self.embed)
