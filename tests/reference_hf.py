"""A Hugging Face model trained as megatrain is configured: the reference of the families' parity tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.reference_llama import reference_lr


def train_hf(model, cfg, state: dict[str, torch.Tensor], batches: list[torch.Tensor],
             dtype: torch.dtype, aux: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The Hugging Face model itself, trained with torch.optim.AdamW and clip_grad_norm_ as megatrain is
    configured (lr schedule, betas, eps, weight decay on matrices only, clipping); with `aux` (a mixture of
    experts), the loss adds router_aux_loss_coef * the aux_loss transformers computes."""
    model = copy.deepcopy(model).to(dtype).train()
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # the embedding itself (Gemma)
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    o, s = cfg.optimizer, cfg.schedule
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    losses = []
    for step, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = reference_lr(step, o.lr, len(batches), s.warmup_steps, s.kind, s.min_lr_ratio)
        opt.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], output_router_logits=True) if aux else model(tokens[:, :-1])
        logits = out.logits
        work = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), tokens[:, 1:].reshape(-1))
        if aux:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
