"""A DeepSeek-style mixture-of-experts decoder (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066):
Llama attention (RMSNorm pre-norm, rotary, GQA), and in each MoE block shared experts (one SwiGLU
of `shared_experts x expert_hidden`, every token) plus `num_experts` fine-grained routed SwiGLU
experts, `top_k` per token chosen by a softmax router. forward(tokens, targets) returns the mean
next-token cross-entropy plus `aux_loss_coef` x the blocks' balance losses.

Written for torch.export and for expert parallelism:

* The routed experts are one module, `RoutedExperts`, with the interface of Hugging Face's
  Mixtral/Qwen-MoE experts: `forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`,
  weights `gate_up_proj (E, 2F, H)` and `down_proj (E, H, F)`. Dropless: the T x k token-expert
  pairs are sorted by expert and multiplied by one grouped GEMM per projection
  (`grouped_mm` with the per-expert offsets), so every captured shape is static (T x k
  rows whatever the routing); only the offsets' values depend on the data. Expert parallelism
  replaces this module at run time (`autopar.runtime.experts`): the pairs go to the rank holding
  their expert by `all_to_all_single` with the counts as split sizes (data dependent, so outside
  the captured graph), the same module runs on its local experts, and the results come back.
* The balance loss is DeepSeek-V3's sequence-wise one (arXiv 2412.19437, eq. 17-20):
  per sequence, sum_i f_i P_i with f_i = E / (k T) x the tokens routing to expert i and P_i the
  mean routing probability; averaged over sequences. Linear in the batch, so a batch split over
  data-parallel ranks or micro-batches gives the one-process loss (a batch-wise f.P would not).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.configs import MoEConfig
from autopar.models.init import init_weights
from autopar.models.llama import Attention, RMSNorm
from autopar.models.registry import register_token_family


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (S, K), sorted by group, times their group's (K, N) matrix of `w` (G, K, N);
    `offs` (G,) the groups' cumulative row ends. One opaque op (torch's `_grouped_mm` takes only
    bf16 on meta tensors and aligned strides on CPU): torch.export records it whole, its FLOPs
    are counted as a grouped GEMM (`capture.flops`), and CUDA bf16 runs torch's kernel."""
    if x.is_cuda and w.dtype == torch.bfloat16:
        # a traced chunk run on a slice of the experts (expert parallelism) keeps the whole
        # model's group count in its offsets: the groups past the weights' are empty
        return torch._grouped_mm(x, w, offs=offs[:w.shape[0]])
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x, grad of w) of `grouped_mm`."""
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            gx[start:end] = grad[start:end] @ w[g].T
            gw[g] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw


@grouped_mm_backward.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _gmm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])


def _gmm_grad(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx, gw = grouped_mm_backward(x, w, offs, grad.contiguous())
    return gx, gw, None


grouped_mm.register_autograd(_gmm_grad, setup_context=_gmm_setup)


class RoutedExperts(nn.Module):
    """`num_experts` SwiGLU experts as two stacked weights (Hugging Face's layout); dropless
    grouped-GEMM forward over the token-expert pairs. The expert count is read off the weights,
    so the same code runs a rank's slice of them (`autopar.runtime.experts`)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape
        E = self.gate_up_proj.shape[0]
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        x = hidden_states[perm // k]
        counts = torch.histc(ids.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w = self.gate_up_proj
        gate, up = grouped_mm(x.to(w.dtype), w.transpose(1, 2), offs).chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = grouped_mm(h.to(w.dtype), self.down_proj.transpose(1, 2), offs)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(hidden_states, dtype=y.dtype)
        return out.index_add(0, perm // k, y).to(hidden_states.dtype)


class Router(nn.Module):
    """Softmax over the experts, the top k kept (not renormalised, as DeepSeekMoE)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return probs, weights, index


class MoE(nn.Module):
    """Shared experts + routed experts; `aux` holds the last forward's balance loss."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.gate = Router(cfg.hidden, cfg.num_experts, cfg.top_k)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden, cfg.expert_hidden)
        self.shared = SwiGLU(cfg.hidden, cfg.shared_experts * cfg.expert_hidden) if cfg.shared_experts else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        probs, weights, index = self.gate(x)
        routed = self.experts(x.reshape(b * s, h), index.reshape(b * s, -1), weights.reshape(b * s, -1))
        out = routed.reshape(b, s, h)
        if self.shared is not None:
            out = out + self.shared(x)
        # sequence-wise balance loss: f (b, E) from the chosen experts, P (b, E) the mean probability
        chosen = torch.zeros_like(probs).scatter(-1, index, 1.0).sum(dim=1)
        f = chosen * (self.num_experts / (self.top_k * s))
        aux = (f * probs.mean(dim=1)).sum(dim=-1).mean()
        return out, aux


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, dense: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.dense_hidden) if dense else MoE(cfg)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        y = self.mlp(self.mlp_norm(x))
        if isinstance(y, tuple):
            y, a = y
            aux = aux + a
        return x + y, aux


class MoEModel(nn.Module):
    """Top-level children run in order (embed, layers, norm, head); the balance losses ride
    along the residual stream as a scalar each block adds to."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, i < cfg.dense_layers) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        init_weights(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        aux = torch.zeros((), device=x.device, dtype=torch.float32)
        for blk in self.layers:
            x, aux = blk(x, aux)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + self.cfg.aux_loss_coef * aux


# the catalogue's moe models, as (config, description)
CONFIGS = register_token_family("moe", MoEModel)
