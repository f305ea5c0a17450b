"""Number formats for frozen weights: NF4 with double quantization (QLoRA's 4-bit base, packed per stage
for the weight stream) and MXFP4 (gpt-oss's released expert weights, dequantized on load).

See docs/quantization.md for the formats, their byte counts and the references they are checked against.
"""

from megatrain_ray.quant.mxfp4 import dequantize_gpt_oss_experts, dequantize_mxfp4, find_mxfp4_tensors
from megatrain_ray.quant.nf4 import NF4Tensor, dequantize_nf4, nf4_code, nf4_nbytes, quantize_nf4
from megatrain_ray.quant.nf4_stage import NF4StageFormat, dequantize_stage, nf4_stage_bytes, pack_stage

__all__ = [
    "NF4StageFormat", "NF4Tensor", "dequantize_gpt_oss_experts", "dequantize_mxfp4", "dequantize_nf4",
    "dequantize_stage", "find_mxfp4_tensors", "nf4_code", "nf4_nbytes", "nf4_stage_bytes", "pack_stage",
    "quantize_nf4",
]
