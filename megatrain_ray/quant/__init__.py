"""Number formats for frozen weights: NF4 with double quantization (QLoRA's 4-bit base, packed per stage
for the weight stream). MXFP4, a checkpoint format dequantized as a directory is read, is model/mxfp4.py.

See docs/quantization.md for the formats, their byte counts and the references they are checked against.
"""

from megatrain_ray.quant.nf4 import NF4Tensor, dequantize_nf4, nf4_code, nf4_nbytes, quantize_nf4
from megatrain_ray.quant.nf4_stage import NF4StageFormat, dequantize_stage, nf4_stage_bytes, pack_stage

__all__ = [
    "NF4StageFormat", "NF4Tensor", "dequantize_nf4", "dequantize_stage", "nf4_code", "nf4_nbytes",
    "nf4_stage_bytes", "pack_stage", "quantize_nf4",
]
