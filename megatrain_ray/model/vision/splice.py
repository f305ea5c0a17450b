"""Where a batch's image features go: the image-token positions of its rows, and (Gemma 3) the attention mask that
lets each image's tokens see one another.

As transformers' vision-language models: the token embeddings are looked up (an image token id outside the text
vocabulary looked up as 0), and the rows at the image-token positions are replaced by the image features in order
(masked_scatter); those positions then take no embedding gradient. Gemma 3's mask (transformers'
create_masks_for_vision_model with token_type_ids = the image tokens): a run of consecutive image tokens is one block;
a global layer allows causal OR same block, a sliding layer that AND the window (key > query - window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain_ray.model.attention import ExplicitMask


class ImageTokenMismatch(ValueError):
    """A batch's image tokens and its images' features do not match in number."""


def lookup_ids(ids: torch.Tensor, image_token_id: int, vocab_size: int) -> torch.Tensor:
    """The ids the embedding looks up: an image token outside the vocabulary as 0 (transformers' llm_input_ids)."""
    if image_token_id < vocab_size:
        return ids
    return ids.masked_fill(ids == image_token_id, 0)


def image_positions(ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[B, T] True at the image tokens."""
    return ids == image_token_id


def check_count(tokens: int, features: torch.Tensor, images: int) -> None:
    """`tokens` image tokens in the rows against the features of their `images` images."""
    if tokens != features.shape[0]:
        raise ImageTokenMismatch(f"the batch has {tokens} image tokens but its {images} image(s) give "
                                 f"{features.shape[0]} features: each image needs exactly the processor's number "
                                 "of image tokens in its row")


def image_block_mask(positions: torch.Tensor, sliding_window: int, any_sliding: bool) -> ExplicitMask:
    """Gemma 3's attention masks for rows whose image tokens are `positions` [B, T]."""
    previous = F.pad(positions, (1, 0), value=False)[:, :-1]
    groups = torch.cumsum((positions & ~previous).to(torch.int64), dim=1) - 1
    blocks = torch.where(positions, groups, -1)
    seq_len = positions.shape[1]
    i = torch.arange(seq_len, device=positions.device)[:, None]
    j = torch.arange(seq_len, device=positions.device)[None, :]
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    full = ((j <= i)[None] | same)[:, None]
    sliding = full & (j > i - sliding_window)[None, None] if any_sliding else None
    return ExplicitMask(full, sliding)
