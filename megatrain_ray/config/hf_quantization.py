"""config.json's `quantization_config`: which quantized checkpoints megatrain reads (model/hf_quant.py
dequantizes them on the host when they load) and one clear refusal for the others."""

from __future__ import annotations

from typing import Any

from megatrain_ray.exceptions import CheckpointError, excerpt

READABLE = {"mxfp4": ("gpt_oss",)}
"""quant_method -> the families whose checkpoints of that method megatrain dequantizes on load."""


def check_quantization_config(hf: dict[str, Any], family: str, where: str) -> None:
    """Refuse a config.json `quantization_config` megatrain cannot read (bitsandbytes, GPTQ, AWQ, FP8, ...)."""
    quant = hf.get("quantization_config")
    if quant is None:
        return
    if not isinstance(quant, dict) or not isinstance(quant.get("quant_method"), str):
        what = f"quantization_config = {excerpt(quant)} is a {type(quant).__name__}, not a mapping" \
            if not isinstance(quant, dict) else \
            f"quantization_config has quant_method = {excerpt(quant.get('quant_method'))}, not a method's name"
        raise CheckpointError(f"{where}: {what}; transformers writes a mapping naming its method, such as "
                              '{"quant_method": "mxfp4"}: correct the file, or point model.path at the unquantized '
                              "(bf16/fp32) release of this model")
    method = quant["quant_method"]
    if family not in READABLE.get(method, ()):
        raise CheckpointError(
            f"{where}: quantization_config with quant_method {method!r} on a {family} model cannot be read; "
            "megatrain loads unquantized checkpoints and gpt-oss's MXFP4 ones: point model.path at the "
            "unquantized (bf16/fp32) release of this model or dequantize it first")
