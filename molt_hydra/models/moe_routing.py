"""MoE routing in the trainer (HF transformers' Qwen3-MoE blocks, and Qwen3-VL-MoE's text decoder, whose router is
the same top-k softmax): R3 replay, gate precision, router freeze and routing statistics, split between image and
text tokens for a VLM.

R3 (rollout routing replay, arXiv 2510.11370; NeMo AutoModel's `RouterReplay`): the experts each token uses in the
trainer's forward are the ones the engine selected during rollout, while the router's logits and softmax stay live,
so the gate still gets a gradient: the combine weights are the trainer's softmax probabilities gathered at the
replayed experts and renormalised as the config says (`norm_topk_prob`). Tokens the engine did not route (-1 rows:
the last generated token, padding) use the trainer's own top-k.

Gate precision: the gate matmul, softmax and top-k run in `gate_precision` whatever the compute dtype (Molt's
MOLT_GATE_PRECISION, default float32 under bf16 mixed precision).

The router module is swapped in place (compat/transformers.py: `install_routers`) so parameter names, checkpoints
and weight sync are unchanged.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from molt_hydra.compat import transformers as transformers_compat


def is_moe_config(config) -> bool:
    config = config.get_text_config()  # a VLM's experts are in its decoder's config
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0) > 0


def routing_stats(config) -> "RoutingStats":
    """Empty statistics for a model's MoE layers (a VLM's: its decoder's)."""
    text = config.get_text_config()
    return RoutingStats(text.num_hidden_layers, text.num_experts)


def expert_counts(ids: torch.Tensor, num_experts: int, dtype: torch.dtype,
                  real: torch.Tensor | None = None) -> torch.Tensor:
    """Selections per expert, counted by scatter-add: bincount sizes its output from the data (a CUDA sync).
    `real` ([tokens] 0/1, the rows of `ids`): only those rows count (padding does not)."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=dtype, device=flat.device)
    ones = torch.ones_like(ids, dtype=dtype) if real is None else real.to(dtype)[:, None].expand(ids.shape)
    return counts.scatter_add_(0, flat, ones.reshape(-1))


class RoutingStats:
    """Sums over one or more forwards: per layer, token selections that match the engine's (all tokens, and image
    tokens apart), expert loads and the mean router probability per expert (for the load-balancing loss)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_experts = num_experts
        # "routed" rows: tokens whose router's own top-k == the engine's, tokens the engine routed, tokens whose
        # experts used == the engine's; "image": the same three over a VLM's image tokens (text = all - image)
        shapes = {"routed": (3, num_layers), "image": (3, num_layers), "load": (num_layers, num_experts),
                  "prob": (num_layers, num_experts), "tokens": (num_layers,)}
        self.sums = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in shapes.items()}

    def add(self, layer: int, probs: torch.Tensor | None, own: torch.Tensor, used: torch.Tensor,
            engine: torch.Tensor | None, image: torch.Tensor | None = None, real: torch.Tensor | None = None):
        """One layer's forward: `probs` [tokens, experts] (None where the gate does not expose them: AutoModel's),
        the gate's own top-k `own`, the experts `used`, the engine's `engine` (-1 rows: not routed there); `real`
        [tokens] 0/1: loads and probabilities count those rows only (None: all; padding is not routed)."""
        # sums stay on the forward's device until `as_tensor`: a `.cpu()` / `float()` per layer would make every MoE
        # layer of a log-prob recompute wait for the GPU (as would bincount, which sizes its output from the data)
        with torch.no_grad():
            if self.sums["load"].device != own.device:
                self.sums = {name: t.to(own.device) for name, t in self.sums.items()}
            sums = self.sums
            if engine is not None:
                known = (engine >= 0).all(-1)
                expected = engine.long().sort(-1).values
                same = (own.sort(-1).values == expected).all(-1) & known
                replayed = (used.sort(-1).values == expected).all(-1) & known
                counted = torch.stack((same, known, replayed))
                sums["routed"][:, layer] += counted.sum(-1)
                if image is not None:
                    sums["image"][:, layer] += (counted & image.to(known.device).bool()).sum(-1)
            w = torch.ones(own.shape[0], dtype=torch.float64, device=own.device) if real is None else real.double()
            sums["load"][layer] += expert_counts(used, self.num_experts, torch.float64, w)
            if probs is not None:
                sums["prob"][layer] += (probs.detach().double() * w[:, None]).sum(0)
            sums["tokens"][layer] += w.sum()

    def as_tensor(self) -> torch.Tensor:
        return torch.cat([t.flatten() for t in self.sums.values()]).cpu()

    def metrics(self, summed: torch.Tensor | None = None) -> dict[str, float]:
        """`routing/*` metrics (docs/metrics.md) from `as_tensor()` summed over ranks (default: this rank's)."""
        flat = (self.as_tensor() if summed is None else summed).double()
        parts = flat.split([t.numel() for t in self.sums.values()])
        routed, image, load, prob, tokens = (part.view(t.shape) for part, t in zip(parts, self.sums.values()))
        if not (seen := tokens > 0).any():
            return {}
        (match, known, replayed), (img_match, img_known, img_replayed) = routed[:, seen], image[:, seen].sum(-1)
        out = {}
        if known.sum() > 0:
            out["routing/agreement"] = float(match.sum() / known.sum())
            # over the layers the engine routed tokens of (a layer without any is no disagreement: was a false 0)
            out["routing/agreement_worst_layer"] = float((match[known > 0] / known[known > 0]).min())
            out["routing/replayed"] = float(replayed.sum() / known.sum())
            if img_known > 0:  # a VLM batch with images: the same ratios over image tokens and over text tokens
                text_known = known.sum() - img_known
                out["routing/agreement_image"] = float(img_match / img_known)
                out["routing/replayed_image"] = float(img_replayed / img_known)
                out["routing/image_tokens"] = float(img_known / known.sum())  # their share
                if text_known > 0:
                    out["routing/agreement_text"] = float((match.sum() - img_match) / text_known)
                    out["routing/replayed_text"] = float((replayed.sum() - img_replayed) / text_known)
        frac = load[seen] / load[seen].sum(-1, keepdim=True).clamp(min=1)  # share of selections per expert
        mean_prob = prob[seen] / tokens[seen, None]
        if mean_prob.sum() > 0:  # Switch-Transformer load-balancing loss: E * sum_e f_e * P_e (1.0 when balanced)
            out["routing/aux_loss"] = float((self.num_experts * (frac * mean_prob).sum(-1)).mean())
        entropy = -(frac * frac.clamp(min=1e-12).log()).sum(-1) / math.log(self.num_experts)
        out["routing/expert_load_entropy"] = float(entropy.mean())
        return out


class LoadBalancingLoss:
    """The Switch-Transformer load-balancing loss of one forward, E * sum_e f_e * P_e over every MoE layer's rows
    (f_e: share of top-k selections, P_e: mean router probability), as transformers' `load_balancing_loss_func`, but
    f counts the experts each token used: under R3 the engine's, where HF would recompute the trainer's own top-k from
    the router logits. The gradient flows through P (the live softmax), as in HF and Megatron. Padding rows (`real`
    0) count in neither, as HF's with an attention mask."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.selections, self.prob_sum, self.rows = 0.0, 0.0, 0  # sums of the forward's selections, probs, rows

    def add(self, probs: torch.Tensor, used: torch.Tensor, real: torch.Tensor | None = None) -> None:
        w = probs.new_ones(probs.shape[0], dtype=torch.float32) if real is None else real.float()
        self.selections = self.selections + expert_counts(used, self.num_experts, torch.float32, w)
        self.prob_sum = self.prob_sum + (probs.float().sum(0) if real is None else _RowWeightedSum.apply(probs, w))
        self.rows = self.rows + w.sum()

    def value(self) -> torch.Tensor:
        return self.num_experts * (self.selections / self.rows * (self.prob_sum / self.rows)).sum()


class _RowWeightedSum(torch.autograd.Function):
    """sum_i w_i * x_i over the rows of `x` (`w`: no gradient), its backward holding `w` outside autograd's saved
    tensors. Activation checkpointing counts a block's saved tensors against its recompute in the backward, where no
    balancing loss is taken: `(x * w[:, None]).sum(0)` saved `w` in the forward only (torch's CheckpointError on the
    GPU recipes' full checkpointing); a plain sum saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w, ctx.dtype = w, x.dtype  # (not save_for_backward: an input without a gradient, no reference cycle)
        return (x.float() * w[:, None]).sum(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad[None, :] * ctx.w[:, None]).to(ctx.dtype), None


class ReplayableRouter(nn.Module):
    """Forward of a top-k softmax router with gate precision, replay and statistics (mixed into the HF router's
    class; see `install`)."""

    layer_index: int
    gate_dtype: torch.dtype
    replay: bool
    # set for one forward (`_set_on_routers`), None otherwise
    engine_experts: torch.Tensor | None = None  # [tokens, layers, top_k] the engine's selection for the forward
    image_tokens: torch.Tensor | None = None  # [tokens] 1 on a VLM's image tokens, for the statistics' split
    real_tokens: torch.Tensor | None = None  # [tokens] 0 on padding, which the statistics and the balancing skip
    stats: RoutingStats | None = None
    balance: LoadBalancingLoss | None = None
    norm_topk_prob = True  # Qwen3-MoE's router sets its own from the config; Qwen3-VL-MoE's always renormalises

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(h.to(self.gate_dtype), self.weight.to(self.gate_dtype))
        probs = torch.softmax(logits, dim=-1)
        own = torch.topk(probs, self.top_k, dim=-1).indices
        used, engine = own, self.engine_experts
        if engine is not None:
            engine = engine[:, self.layer_index].to(own.device)
            if self.replay:
                used = torch.where((engine >= 0).all(-1, keepdim=True), engine.long(), own)  # -1 rows: own top-k
        weights = probs.gather(-1, used)  # live: the gate's gradient flows through the softmax
        weights = weights / weights.sum(dim=-1, keepdim=True) if self.norm_topk_prob else weights
        real = None if self.real_tokens is None else self.real_tokens.to(own.device)
        if self.stats is not None:
            self.stats.add(self.layer_index, probs, own, used, engine, self.image_tokens, real)
        if self.balance is not None:
            self.balance.add(probs, used, real)
        return logits, weights.to(hidden_states.dtype), used


def routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ReplayableRouter)]


def install(model: nn.Module, gate_precision: str = "float32", replay: bool = False) -> list[nn.Module]:
    """Make every MoE router of `model` a `ReplayableRouter` (in place); returns them in layer order."""
    installed = transformers_compat.install_routers(model, ReplayableRouter)
    for name, module in installed:
        # "model.layers.3.mlp.gate" -> 3: the engine's routed experts are indexed by global decoder layer
        parts = name.split(".")
        module.layer_index = int(parts[parts.index("layers") + 1])
        module.gate_dtype, module.replay = getattr(torch, gate_precision), replay  # float32 | bfloat16
    return [module for _, module in installed]


def engine_routing(model: nn.Module, routed: torch.Tensor | None, stats: RoutingStats | None = None,
                   image_tokens: torch.Tensor | None = None, real_tokens: torch.Tensor | None = None):
    """A context in whose forward routers see the engine's experts `routed` ([..., tokens, layers, top_k], flattened
    to the forward's token order) and add to `stats`, image tokens (`image_tokens`, same shape as the ids) apart;
    `real_tokens` (same shape, 0 on right-padding): only those count in `stats` and the load-balancing loss."""
    flat = None if routed is None else routed.reshape(-1, *routed.shape[-2:])
    image = None if image_tokens is None else image_tokens.reshape(-1)
    real = None if real_tokens is None else real_tokens.reshape(-1)
    return _set_on_routers(model, engine_experts=flat, stats=stats, image_tokens=image, real_tokens=real)


@contextmanager
def load_balancing(model: nn.Module):
    """The forward inside yields its `LoadBalancingLoss` (the routers add to it); recomputes after it (activation
    checkpointing, in the backward) add nothing."""
    balance = LoadBalancingLoss(routers(model)[0].num_experts)
    with _set_on_routers(model, balance=balance):
        yield balance


@contextmanager
def _set_on_routers(model: nn.Module, **values):
    """Every router's attributes `values` for the block, None after it."""
    rs = routers(model)
    for r in rs:
        for name, value in values.items():
            setattr(r, name, value)
    try:
        yield
    finally:
        for r in rs:
            for name in values:
                setattr(r, name, None)


def checkpoint_expert_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A transformers-5 Qwen3-MoE parameter under the checkpoint's names: its fused experts (`mlp.experts.gate_up_proj`
    [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]) as one view per expert and projection, what
    `from_pretrained`, every vLLM and an export load. vLLM 0.24's Qwen3-MoE loader skips the fused names without a
    word (they match no parameter and no expert mapping), so a sync of them would leave the engine's experts stale."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix, half = name[: -len("gate_up_proj")], tensor.shape[1] // 2
        return [(f"{prefix}{e}.{proj}.weight", tensor[e, rows]) for e in range(tensor.shape[0])
                for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None)))]
    if name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        return [(f"{prefix}{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def freeze(model: nn.Module) -> list[str]:
    """requires_grad=False on every router weight; returns their parameter names (kept out of sync too)."""
    params = {f"{name}.{pname}": p for name, module in transformers_compat.router_modules(model)
              for pname, p in module.named_parameters(recurse=False)}
    for p in params.values():
        p.requires_grad_(False)
    return list(params)
