"""Dtype names as configs spell them, their sizes and precision order, and their torch dtypes."""

import torch

# Bytes per element of each dtype name, used by the planner and the host store.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1}
# Precision order: a streaming copy is never more precise than the master weights.
DTYPE_RANK = {"bfloat16": 1, "float16": 1, "float32": 2, "float64": 3}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
                "uint8": torch.uint8}


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as configs spell it (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")
