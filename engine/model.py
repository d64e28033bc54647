"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) over a paged KV cache.

A forward pass takes a flat batch of tokens from many sequences (prefill chunks and decode
steps mixed) with their positions and attention metadata, writes each token's K and V into
the cache, and returns the hidden states of the requested tokens.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import kernel_choice, layer_ops, op_choice
from engine.attention import cpu_kernel
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.model_config import ModelConfig
from engine.op_timer import OpTimer
from engine.torch_ops import add_rms_norm, apply_rope, rms_norm, rope_args, silu_mul

__all__ = ["AttentionFn", "Linear", "LlamaModel", "apply_rope", "rms_norm"]

AttentionFn = Callable[[torch.Tensor, PagedKVCache, int, AttentionMetadata, float], torch.Tensor]


# Batch size the oneDNN weight packing is tuned for (decode batches are up to max_num_seqs).
ONEDNN_BATCH_HINT = 64


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    """y = x @ weight.T, no bias. On CPU in float32 with `panels` (and the C layer ops built) the
    weight is packed in panels for the C matmul (`layer_ops.panel_matmul`), which ran faster than
    oneDNN's packed GEMM, most of all at decode batch sizes (docs/journal/benchmarks-history.md,
    "The linears on our own panel kernel, SwiGLU fused, the last layer on the sampled rows").
    Otherwise on CPU in float32 the weight is packed once for oneDNN (faster than F.linear, MKL
    sgemm, at decode batch sizes: same file, "Engine: `kvpool bench engine`"); elsewhere, or with
    use_onednn=False, it is F.linear. One packed copy replaces the weight."""

    def __init__(self, weight: torch.Tensor, use_onednn: bool = True, panels: bool = False,
                 blocks: tuple[tuple[int, int], ...] = ()) -> None:
        """`blocks`: the panel kernel's rows per call by batch size (`kernel_choice.Choice.blocks`)."""
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.blocks = blocks
        self.panels = layer_ops.pack_panels(weight) if panels and layer_ops.panels_packable(weight) else None
        if self.panels is not None:
            self.weight = None
        elif use_onednn and weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return layer_ops.panel_matmul(x if x.stride(-1) == 1 else x.contiguous(), self.panels,
                                          kernel_choice.block_for(self.blocks, x.shape[0]))
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


class Layer:
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, use_onednn: bool = True,
                 panels: dict[str, bool] | None = None, blocks: dict[str, tuple] | None = None) -> None:
        """`panels`: op name (qkv, o, gate_up, down) -> whether it runs on the C panel kernel;
        `blocks`: op name -> its rows per call there (`kernel_choice.Choice.blocks`)."""
        panels, blocks = panels or {}, blocks or {}
        get = lambda name: w[prefix + name].to(dtype)  # noqa: E731
        self.in_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        self.qkv = Linear(torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"),
                                     get("self_attn.v_proj.weight")]).contiguous(), use_onednn, panels.get("qkv", False),
                          blocks.get("qkv", ()))
        self.o = Linear(get("self_attn.o_proj.weight").contiguous(), use_onednn, panels.get("o", False),
                        blocks.get("o", ()))
        gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]).contiguous()
        # Where the panels apply, silu(gate) * up comes out of the matmul itself (gated_panel_matmul).
        gated = panels.get("gate_up", False) and layer_ops.gated_packable(gate_up)
        self.gated = layer_ops.pack_gated_panels(gate_up) if gated else None
        self.gated_blocks = blocks.get("gate_up", ())
        self.gate_up = None if self.gated is not None else Linear(gate_up, use_onednn, panels.get("gate_up", False))
        self.down = Linear(get("mlp.down_proj.weight").contiguous(), use_onednn, panels.get("down", False),
                           blocks.get("down", ()))


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, attention: AttentionFn, use_onednn: bool = True,
                 fused_ops: bool = True, kernels: str = "auto", block_size: int = 16) -> None:
        """`fused_ops`: on CPU in float32, the elementwise steps run as fused C calls
        (engine/layer_ops.py) where that library builds; False keeps the torch ops.
        `kernels`: the linears' matmul there, per op (engine/kernel_choice.py): auto (the faster
        of our C panel kernel and oneDNN on this CPU, batch-invariant either way), c or onednn;
        with auto the attention and layer ops too (engine/op_choice.py, at the cache's `block_size`)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.op_timer: OpTimer | None = None  # engine.op_timer; set by `kvpool bench engine --ops`
        to = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        self.embed = to(weights["model.embed_tokens.weight"])
        ops = kernel_choice.linear_ops(config)
        self.kernel_choices = kernel_choice.choose(ops, kernels) if fused_ops and use_onednn \
            and layer_ops.usable(self.embed) and _onednn_available() else {}
        # the C kernel where it was chosen, or where there was no choice (no oneDNN here)
        chosen = {name: c.kernel for name, c in self.kernel_choices.items()}
        panels = {op.name: fused_ops and chosen.get(op.name, kernel_choice.C) == kernel_choice.C for op in ops}
        blocks = {name: c.blocks for name, c in self.kernel_choices.items()}
        self.lm_head = Linear(self.embed if config.tie_embeddings else to(weights["lm_head.weight"]), use_onednn,
                              panels["lm_head"], blocks.get("lm_head", ()))
        self.norm = to(weights["model.norm.weight"])
        self.layers = [Layer({k: v.to(device) for k, v in weights.items() if k.startswith(f"model.layers.{i}.")},
                             f"model.layers.{i}.", dtype, use_onednn, panels, blocks) for i in range(config.num_layers)]
        # The attention and elementwise ops' C kernels or torch paths (engine/op_choice.py); the
        # SiLU is one of them where the gated panels do not fuse it.
        self.cpu_attention = getattr(attention, "__module__", "").endswith("cpu_backend")
        separate_silu = not self.layers or self.layers[0].gated is None
        self.op_choices = op_choice.choose(op_choice.available_ops(config, self.cpu_attention, block_size,
                                                                   separate_silu), kernels) \
            if fused_ops and layer_ops.usable(self.embed) else {}
        torch_decode, torch_prefill = self._on_torch(op_choice.ATTN_DECODE), self._on_torch(op_choice.ATTN_PREFILL)
        self.attention = functools.partial(attention, c_decode=not torch_decode, c_prefill=not torch_prefill) \
            if torch_decode or torch_prefill else attention
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
        t = torch.arange(config.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.sin_signed = torch.cat((-self.sin[:, :hd // 2], self.sin[:, hd // 2:]), dim=-1)
        self.scale = hd ** -0.5
        self.fused = fused_ops and layer_ops.usable(self.cos, self.norm) and hd <= layer_ops.MAX_HEAD_DIM \
            and not self._on_torch(op_choice.LAYER_OPS)

    def _on_torch(self, name: str) -> bool:
        choice = self.op_choices.get(name)
        return choice is not None and choice.kernel == kernel_choice.TORCH

    def kernel_tag(self) -> str:
        """The KV layout fingerprint's part for the kernels: on CPU the ISA class the C kernels are
        built for, then the linears on oneDNN and the other ops on torch (none: all C, as by default)."""
        isa = kernel_choice.isa_tag() if self.device.type == "cpu" else ""
        return isa + kernel_choice.tag(self.kernel_choices) + op_choice.tag(self.op_choices)

    @torch.inference_mode()
    def kernels(self) -> dict[str, str]:
        """Which implementation each operation runs here (`kvpool bench engine` prints it): the
        C kernels where they apply (CPU, float32, the library built), else torch / oneDNN."""
        def linear(lin: Linear) -> str:
            return "C panels" if lin.panels is not None else "oneDNN packed" if lin.packed is not None else "torch"
        first = self.layers[0]
        blocks = torch.empty((1, 1, 2, 16, self.config.num_kv_heads, self.config.head_dim), dtype=self.dtype,
                             device=self.device)
        q = torch.empty((1, self.config.num_heads, self.config.head_dim), dtype=self.dtype, device=self.device)

        def op(name: str, lin: Linear | None, impl: str = "") -> str:  # and how it was chosen
            choice = self.kernel_choices.get(name) or self.op_choices.get(name)
            return (impl or linear(lin)) + (f" [{choice.describe()}]" if choice else "")  # type: ignore[arg-type]
        decode_c = cpu_kernel.supports(blocks, q.shape[1], blocks.shape[4]) and not self._on_torch(op_choice.ATTN_DECODE)
        prefill_c = cpu_kernel.supports_prefill(q, blocks) and not self._on_torch(op_choice.ATTN_PREFILL)
        return {
            "qkv projection": op("qkv", first.qkv),
            "o projection": op("o", first.o),
            "gate+up projection and SiLU": op("gate_up", None, "C gated panels (fused)" if first.gated is not None
                                              else f"{linear(first.gate_up)} + separate SiLU"),  # type: ignore[arg-type]
            "down projection": op("down", first.down),
            "lm head": op("lm_head", self.lm_head),
            "norms, RoPE, SiLU": op(op_choice.LAYER_OPS, None, "C layer ops" if self.fused else "torch"),
            "attention, decode": op(op_choice.ATTN_DECODE, None, "C paged decode" if decode_c else "torch SDPA")
            if self.cpu_attention else "Triton paged attention",
            "attention, prefill": op(op_choice.ATTN_PREFILL, None, "C flash prefill" if prefill_c else "torch SDPA")
            if self.cpu_attention else "Triton paged attention",
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Run the batch; returns fp32 logits for the tokens at `logits_indices`. `num_layers`: only
        the first that many layers, then the final norm and LM head (a self-draft's early exit).
        Each sublayer's output is added to the residual stream by the next norm (`_norm`): the
        torch ops do the same add then norm as before, the fused path does both in one call."""
        c = self.config
        n = input_ids.shape[0]
        timer = self.op_timer  # `kvpool bench engine --ops`: where the pass's time goes
        if timer is not None:
            timer.start()
            attention_op = ("attention (decode rows)" if all(sp.decode for sp in meta.seqs)
                            else "attention (with prefill)")
        h = self.embed[input_ids]  # a fresh tensor: the residual stream, updated in place
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        rope_args = self._rope_args(positions)  # once per pass, not per layer
        delta: torch.Tensor | None = None  # the last sublayer's output, not yet added to h
        layers = self.layers[:num_layers]
        tail = self._last_layer_rows(meta, logits_indices, n) if layers else None
        if timer is not None:
            timer.mark("embedding, RoPE tables")
        for i, layer in enumerate(layers):
            x = self._norm(h, delta, layer.in_norm)
            if timer is not None:
                timer.mark("norms")
            qkv = layer.qkv(x)
            if timer is not None:
                timer.mark("linear qkv")
            # RoPE on the query and key heads together: [n, heads + kv_heads, head_dim]
            qk = self._rope(qkv[:, :q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), rope_args)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_size + kv_size:].view(n, c.num_kv_heads, c.head_dim)
            cache.write(i, meta.slot_block_ids, meta.slot_offsets, k, v)
            if timer is not None:
                timer.mark("RoPE, KV cache write")
            if tail is not None and i == len(layers) - 1:
                # Past the last layer's K and V only the sampled rows matter: the rest of this layer
                # runs on them alone (rows are independent outside attention, and attention of a
                # query's last tokens reads the same keys).
                rows, meta = tail
                h, q, n = h[rows], q[rows], rows.shape[0]
                logits_indices = torch.arange(n, device=h.device)
                if n == 0:  # no one samples: nothing more to compute
                    delta = None
                    break
            attn = self.attention(q, cache, i, meta, self.scale)
            if timer is not None:
                timer.mark(attention_op)
            o = layer.o(attn.reshape(n, q_size))
            if timer is not None:
                timer.mark("linear o")
            x = self._norm(h, o, layer.post_norm)
            if timer is not None:
                timer.mark("norms")
            gated = self._swiglu(layer, x)
            if timer is not None:
                timer.mark("linear gate+up, SiLU")
            delta = layer.down(gated)
            if timer is not None:
                timer.mark("linear down")
        if delta is not None:
            h.add_(delta)
        h = self._norm(h[logits_indices], None, self.norm)
        logits = self.lm_head(h).float()
        if timer is not None:
            timer.mark("final norm, lm head")
        return logits

    @staticmethod
    def _last_layer_rows(meta: AttentionMetadata, logits_indices: torch.Tensor,
                         n: int) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """The rows the last layer needs past its K/V write, and their attention metadata, where
        that is fewer than the pass's `n` (a prompt's tokens but its last): the logits rows, when
        they are each span's last query tokens (what the runner asks for); else None."""
        if logits_indices.shape[0] >= n:  # decode passes: every row samples (no device-to-host copy)
            return None
        sub = meta.query_tails(logits_indices.tolist())
        return None if sub is None else (logits_indices.to(torch.long), sub)

    # The elementwise steps: fused C calls (engine/layer_ops.py) or torch ops, per `self.fused`.

    def _rope_args(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.fused:
            return rope_args(positions, self.cos, self.sin_signed)
        # The C op indexes the tables itself: check what the torch indexing would have refused.
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} beyond the RoPE table ({self.cos.shape[0]})")
        return positions.contiguous(), self.cos, self.sin_signed

    def _rope(self, qk: torch.Tensor, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not self.fused:
            return apply_rope(qk, *args)
        layer_ops.rope_(qk, *args)  # in place on the QKV projection's output
        return qk

    def _norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """h += delta (if any), in place; returns rms_norm(h) * weight."""
        eps = self.config.rms_eps
        if self.fused:
            return layer_ops.rms_norm(h, weight, eps) if delta is None else layer_ops.add_rms_norm(h, delta, weight, eps)
        return add_rms_norm(h, delta, weight, eps)

    def _swiglu(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T): one C call over the gated panels where packed."""
        if layer.gated is not None:
            return layer_ops.gated_panel_matmul(x, layer.gated, kernel_choice.block_for(layer.gated_blocks, x.shape[0]))
        return self._silu_mul(layer.gate_up(x))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return layer_ops.silu_mul(gate_up) if self.fused else silu_mul(gate_up)
