"""Renders docs/config.md from the config dataclasses: every key, its type, default and doc.

    python -m megatrain_ray.config.docs > docs/config.md

The attribute docstrings of the section classes (megatrain_ray/config/*_section*.py) are the one source; a test keeps the file current.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing

from megatrain_ray.config import (
    engine_sections,
    finetune_section,
    grpo_section,
    latent_attention_section,
    linear_attention_section,
    loop_sections,
    model_section,
    rl_section,
    runtime_sections,
)

SECTIONS = {
    "model": model_section.ModelConfig, "model.rope_scaling": model_section.RopeScalingConfig,
    "model.linear_attention": linear_attention_section.LinearAttentionConfig,
    "model.latent_attention": latent_attention_section.LatentAttentionConfig,
    "model.sigmoid_router": latent_attention_section.SigmoidRouterConfig,
    "data": loop_sections.DataConfig, "optimizer": engine_sections.OptimizerConfig,
    "schedule": loop_sections.ScheduleConfig, "precision": engine_sections.PrecisionConfig,
    "engine": engine_sections.EngineConfig, "host": runtime_sections.HostConfig,
    "runtime": runtime_sections.RuntimeConfig, "parallel": runtime_sections.ParallelConfig,
    "train": loop_sections.TrainConfig, "checkpoint": loop_sections.CheckpointConfig,
    "fault": loop_sections.FaultConfig,
    "finetune": finetune_section.FinetuneConfig, "finetune.lora": finetune_section.LoraConfig,
    "finetune.dpo": finetune_section.DPOConfig, "finetune.grpo": grpo_section.GRPOConfig,
    "rl": rl_section.RLConfig,
}


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each annotated field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_text(tp: object) -> str:
    text = re.sub(r"megatrain_ray\.config\.\w+\.", "", str(tp).replace("typing.", ""))
    text = getattr(tp, "__name__", text) if not typing.get_args(tp) else text
    return text.replace(" | ", " or ")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else repr(f.default).replace("'", "")
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory()).replace("'", "")
    return "(required)"


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the section classes in `megatrain_ray/config/` (model_section.py, linear_attention_section.py, "
             "latent_attention_section.py, "
             "loop_sections.py, "
             "engine_sections.py, runtime_sections.py, finetune_section.py, grpo_section.py) by `python -m megatrain_ray.config.docs`. "
             "Every key can be set in the YAML file or overridden with `--set section.key=value`.", ""]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        lines += [f"## `{section}`", "", " ".join((cls.__doc__ or "").split()), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            lines.append(f"| `{section}.{f.name}` | `{_type_text(hints[f.name])}` | `{_default(f)}` | "
                         f"{docs.get(f.name, '').replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
