"""Hub checkpoints of MoE models on disk keep one tensor per expert; megatrain (as transformers 5 in memory)
keeps each layer's experts fused. This module maps the on-disk names to the fused ones when a directory is
read, as transformers' conversion mapping does when it loads (qwen2_moe / mixtral patterns):

- Qwen3-MoE: `mlp.experts.{e}.gate_proj.weight`, `.up_proj.weight` [f, h] -> `mlp.experts.gate_up_proj`
  [E, 2f, h] (each expert's gate rows, then its up rows); `mlp.experts.{e}.down_proj.weight` -> `mlp.experts.down_proj`.
- Mixtral: `block_sparse_moe.experts.{e}.w1.weight` (gate), `.w3.weight` (up), `.w2.weight` (down) alike, and
  `block_sparse_moe.gate.weight` -> `mlp.gate.weight` (Phimoe, on the generic path: -> `mlp.router.weight`).
- GraniteMoE (generic path): `block_sparse_moe.input_linear.weight`, `.output_linear.weight` and
  `.router.layer.weight` -> `block_sparse_moe.experts.gate_up_proj`, `.experts.down_proj` and `.router.weight`.
- Ernie 4.5-MoE (generic path): Qwen2-MoE's experts, and `mlp.moe_statics.e_score_correction_bias` ->
  `mlp.gate.moe_statics.e_score_correction_bias`.

Directories with fused names (what transformers 5's save_pretrained writes for gpt-oss, and what megatrain's
export writes for every family: transformers 5 loads them as they are) need nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megatrain_ray.exceptions import CheckpointError

Entry = tuple[str, tuple[int, ...], str]
"""(file, shape, safetensors dtype code) of a tensor in a directory."""

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                         r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.*\.)block_sparse_moe\.gate\.weight$")
# GraniteMoE's checkpoints: its fused experts and router under other names (transformers renames them on load).
_RENAMED = [(re.compile(r"^(?P<layer>.*\.)block_sparse_moe\.input_linear\.weight$"), "block_sparse_moe.experts.gate_up_proj"),
            (re.compile(r"^(?P<layer>.*\.)block_sparse_moe\.output_linear\.weight$"), "block_sparse_moe.experts.down_proj"),
            (re.compile(r"^(?P<layer>.*\.)block_sparse_moe\.router\.layer\.weight$"), "block_sparse_moe.router.weight"),
            # Ernie 4.5-MoE's routing bias, under its router in the module
            (re.compile(r"^(?P<layer>.*\.)mlp\.moe_statics\.e_score_correction_bias$"),
             "mlp.gate.moe_statics.e_score_correction_bias")]
ROUTER_NAMES = {"phimoe": "mlp.router.weight"}
"""model_type -> the name of a router that Mixtral's checkpoints call `block_sparse_moe.gate.weight` (Phimoe's
router module), else `mlp.gate.weight`."""


class ExpertStacks:
    """The fused tensors a directory's per-expert tensors make: by fused name, the source names of each expert's
    parts in expert order (gate_up: gate then up of each expert; down: its down) and the renamed routers."""

    def __init__(self, entries: dict[str, Entry], where: str, model_type: str | None = None):
        self.parts: dict[str, list[list[str]]] = {}
        self.renamed: dict[str, str] = {}
        found: dict[tuple[str, str], dict[int, str]] = {}
        for name in entries:
            m = _PER_EXPERT.match(name)
            if m:
                found.setdefault((m["layer"], _ROLE[m["part"]]), {})[int(m["e"])] = name
            elif (r := _MIXTRAL_ROUTER.match(name)):
                self.renamed[f"{r['layer']}{ROUTER_NAMES.get(model_type, 'mlp.gate.weight')}"] = name
            else:
                for pattern, new in _RENAMED:
                    if (r := pattern.match(name)):
                        self.renamed[f"{r['layer']}{new}"] = name
        layers = {layer for layer, _ in found}
        for layer in sorted(layers):
            by_role = {role: found.get((layer, role), {}) for role in ("gate", "up", "down")}
            count = len(by_role["down"])
            for role, experts in by_role.items():
                if sorted(experts) != list(range(count)):
                    raise CheckpointError(f"{where}: the {role} tensors of the experts of {layer[:-1]!r} are "
                                          f"numbered {sorted(experts)[:8]}..., not 0..{count - 1} like its down "
                                          "projections; the checkpoint is incomplete")
            self.parts[f"{layer}mlp.experts.gate_up_proj"] = [[by_role["gate"][e], by_role["up"][e]]
                                                              for e in range(count)]
            self.parts[f"{layer}mlp.experts.down_proj"] = [[by_role["down"][e]] for e in range(count)]

    def __bool__(self) -> bool:
        return bool(self.parts or self.renamed)

    def fused_entries(self, entries: dict[str, Entry], where: str) -> dict[str, Entry]:
        """`entries` with the per-expert tensors replaced by the fused ones (shapes as transformers 5's)."""
        sources = {n for parts in self.parts.values() for p in parts for n in p} | set(self.renamed.values())
        out = {n: e for n, e in entries.items() if n not in sources}
        for fused, parts in self.parts.items():
            shapes = [[entries[n][1] for n in p] for p in parts]
            codes = {entries[n][2] for p in parts for n in p}
            first = shapes[0]
            if any(s != first for s in shapes) or len(codes) != 1 or any(len(s) != 2 for s in first):
                raise CheckpointError(f"{where}: the experts' tensors making {fused!r} differ in shape or dtype; "
                                      "the checkpoint is inconsistent")
            rows = sum(s[0] for s in first)
            out[fused] = (entries[parts[0][0]][0], (len(parts), rows, first[0][1]), codes.pop())
        for new, old in self.renamed.items():
            out[new] = entries[old]
        return out

    def read(self, name: str, read_source: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """The fused or renamed tensor `name` read from its sources (None: not one of them)."""
        if name in self.renamed:
            return read_source(self.renamed[name])
        parts = self.parts.get(name)
        if parts is None:
            return None
        return torch.stack([torch.cat([read_source(n) for n in p], dim=0) for p in parts])
