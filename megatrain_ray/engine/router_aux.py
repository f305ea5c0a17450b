"""The MoE load-balancing loss in the layer stream (model.output_router_logits).

transformers' load_balancing_loss_func pools every MoE layer's routing before the product: f_e (the top-k
assignments to expert e over all layers and rows, no gradient) and P_e (the mean router probability), the
loss E * sum_e f_e P_e. A layer's share of the gradient flows through its P only but needs the global f,
known once the forward is done. So each MoE layer's forward records its counts and summed probabilities
(a few [E] tensors), the totals give the loss and one [E] gradient vector, and each layer's recompute in
the backward adds coef * that vector as the gradient of its summed probabilities (templates.decoder_layer_backward).

The generic path's MoE models (model/generic_moe.py) record the same statistics from their routers' logits.

Router z-loss: none of the three families has one in transformers 5.23 (Qwen3-MoE, Mixtral and gpt-oss add only
the load-balancing loss), so none is computed.
"""

from __future__ import annotations

import torch

from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.engine.collective import Collectives
from megatrain_ray.model.generic_moe import GenericRouting
from megatrain_ray.model.moe import RouterRecord, load_balancing_loss


class RouterAux:
    """One step's router records and the load-balancing loss they give."""

    def __init__(self, cfg: ModelConfig, generic: GenericRouting | None = None):
        """`generic`: the routing of a generic MoE model (model/generic_moe.py), which its config.json describes
        and ModelConfig does not."""
        if cfg.template == "generic":
            self.on = generic is not None and generic.on
            self.coef = generic.coef if self.on else 0.0
            self.num_experts = generic.num_experts if self.on else 0
            self.moe_layers = generic.moe_layers if self.on else []
        else:
            self.on = cfg.is_moe and cfg.output_router_logits
            self.coef = cfg.router_aux_loss_coef
            self.num_experts = cfg.num_experts
            self.moe_layers = [i for i in range(cfg.num_layers) if cfg.layer_is_moe(i)]
        self.records: dict[int, RouterRecord] = {}
        self.grad: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None

    def begin(self, training: bool) -> None:
        self.records = {i: RouterRecord() for i in self.moe_layers} if self.on and training else {}
        self.grad = self.loss = None

    def record(self, layer: int) -> RouterRecord | None:
        """Where layer `layer`'s forward records its routing (None: not a MoE layer, or the loss is off)."""
        return self.records.get(layer)

    def finish_forward(self, comm: Collectives | None = None, first_rank: bool = True) -> torch.Tensor | None:
        """The weighted loss coef * aux to add to this rank's share of the step's loss, or None when off; sets the
        layers' gradient. With several ranks (`comm`) the counts and probability sums are summed over them first,
        so that the loss and its gradient are those of the whole batch (as one rank would compute them); the
        loss is added on the first rank only, since the ranks' losses are summed."""
        if not self.records:
            return None
        records = list(self.records.values())
        if comm is not None:
            records = _summed_over_ranks(comm, records)
        self.loss, self.grad = load_balancing_loss(records, self.num_experts, self.coef)
        return self.coef * self.loss if first_rank else torch.zeros_like(self.loss)

    def layer_grad(self, layer: int) -> torch.Tensor | None:
        """coef * d(aux)/d(prob_sum) (float32, as prob_sum) for layer `layer`'s recompute (None: no term)."""
        return self.grad if self.grad is not None and layer in self.records else None


def _summed_over_ranks(comm: Collectives, records: list[RouterRecord]) -> list[RouterRecord]:
    """The layers' records summed over every rank, in one all-reduce of [layers, 2 E + 1] float64 values."""
    packed = torch.stack([torch.cat([r.counts.double(), r.prob_sum.detach().double(),
                                     torch.tensor([float(r.rows)], dtype=torch.float64, device=r.counts.device)])
                          for r in records])
    comm.all_reduce(packed)
    experts = records[0].counts.numel()
    summed = []
    for row in packed:
        total = RouterRecord()
        total.add(row[:experts].float(), row[experts:2 * experts].float(), int(row[-1]))
        summed.append(total)
    return summed
