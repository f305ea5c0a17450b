"""Quantized Hugging Face checkpoints megatrain reads: gpt-oss's MXFP4 experts, dequantized on the host.

config.json's `quantization_config` is accepted only where its tensors can be read exactly (quant_method
mxfp4 on gpt_oss: config/hf_quantization.py). A directory's `X_blocks` / `X_scales` pairs (model/mxfp4.py) are
seen as the one tensor `X` in transformers' layout, dequantized when it is read, one tensor at a time, to
bfloat16: lossless, as every MXFP4 value (two significant bits times a power of two within bfloat16's range) is
a bfloat16, so the master dtype gets the very values transformers' own dequantization gives, with half
float32's temporary memory. The host keeps full precision: the plan's bytes are those of an unquantized
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain_ray.exceptions import CheckpointError
from megatrain_ray.model.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_gpt_oss_experts, find_mxfp4_tensors

Entry = tuple[str, tuple[int, ...], str]
"""(file, shape, safetensors dtype code) of a tensor in a directory."""

class MXFP4Pairs:
    """A directory's MXFP4 pairs, by the name of the tensor each dequantizes to."""

    def __init__(self, entries: dict[str, Entry], where: str):
        packed = {n: e for n, e in entries.items() if n.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))}
        for key, (file, _, _) in packed.items():
            stem, suffix = (key.removesuffix(BLOCKS_SUFFIX), BLOCKS_SUFFIX) if key.endswith(BLOCKS_SUFFIX) \
                else (key.removesuffix(SCALES_SUFFIX), SCALES_SUFFIX)
            partner = stem + (SCALES_SUFFIX if suffix == BLOCKS_SUFFIX else BLOCKS_SUFFIX)
            if partner not in packed:
                raise CheckpointError(f"{where}/{file}: {key} has no {partner} in the directory; an MXFP4 tensor "
                                      "needs both (is the checkpoint complete? copy it again)")
        try:
            found = find_mxfp4_tensors({n: e[1] for n, e in packed.items()})
        except CheckpointError as exc:  # its message names "the given tensors": name the directory instead
            raise CheckpointError(str(exc).replace("the given tensors", where)) from None
        self.pairs = {t.name: t for t in found}
        for t in self.pairs.values():
            for key in (t.blocks_key, t.scales_key):
                if entries[key][2] != "U8":
                    raise CheckpointError(f"{where}/{entries[key][0]}: {key} is stored as {entries[key][2]}, "
                                          "not U8: it is not an MXFP4 tensor; the checkpoint is damaged")

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def dequantized_entries(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """`entries` with each pair replaced by the bfloat16 tensor it dequantizes to."""
        sources = {k for t in self.pairs.values() for k in (t.blocks_key, t.scales_key)}
        out = {n: e for n, e in entries.items() if n not in sources}
        for name, t in self.pairs.items():
            out[name] = (entries[t.blocks_key][0], t.shape, "BF16")
        return out

    def read(self, name: str, read_source: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """The dequantized tensor `name` (None: not an MXFP4 one)."""
        t = self.pairs.get(name)
        if t is None:
            return None
        return dequantize_gpt_oss_experts(read_source(t.blocks_key), read_source(t.scales_key), torch.bfloat16)
