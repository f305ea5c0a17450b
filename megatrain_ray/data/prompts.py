"""GRPO prompts: the batch source of finetune.objective=grpo, from a directory written by
`megatrain prepare --format prompts` (data/prepare/prompts.py).

data.batch_size counts completions, finetune.grpo.num_generations per prompt, so a step takes
data.batch_size / num_generations prompts. Epoch e visits the prompts in a permutation seeded by (data.seed, e), as
every other data source does, so a step's prompts are a pure function of (data.seed, step) and a resumed run gets
the same ones. The token ids are memory-mapped (data/batches.Documents); the prompts and the other columns, JSON text,
are streamed the same way into a memory-mapped byte file and decoded per step, so the process holds only offsets,
whatever the size of the split.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.config.sections import Config
from megatrain_ray.data.batches import Documents, _mapped, is_prepared, refuse_missing
from megatrain_ray.data.prepare.shards import PROMPT_COLUMNS
from megatrain_ray.exceptions import DataError
from megatrain_ray.system.files import contained

PREPARE_PROMPTS = "prepare it with `megatrain prepare --format prompts`"


@dataclass(slots=True)
class PromptRows:
    """Prompts of one step (or of an evaluation), in order: what the rollout generates from and the reward
    functions read."""

    ids: list[list[int]]
    """Each prompt's token ids; a prompt longer than finetune.grpo.max_prompt_length keeps its last tokens."""
    prompts: list
    """Each prompt as the dataset gives it, text or a list of chat messages, never truncated: the reward
    functions' `prompts` (one per prompt here; the driver repeats it per completion)."""
    columns: dict[str, list]
    """Every other column of the dataset, one value per prompt (None where a record lacks it, as `datasets` fills
    a missing field); the driver repeats each value per completion for the reward functions' keyword arguments."""
    indices: list[int]
    """Each prompt's record number in the prepared input (the input files in order, counted from 0)."""


class _JsonText:
    """The PROMPT_COLUMNS of one split's shards: the prompt's and the columns' JSON text of each row, written to an
    unlinked temporary file (under TMPDIR) row group by row group and memory-mapped; the record numbers in memory."""

    def __init__(self, root: Path, files: list[str], where: str):
        import pyarrow.parquet as pq  # lazy: start-up time

        lengths: list[int] = []
        records: list[np.ndarray] = []
        with tempfile.TemporaryFile() as text_file:
            for name in files:
                shard = pq.ParquetFile(contained(root, name, where, DataError))
                missing = [c for c in PROMPT_COLUMNS if c not in shard.schema_arrow.names]
                if missing:
                    raise DataError(f"{where}: shard {name} has no {missing[0]!r} column; {PREPARE_PROMPTS} again")
                for batch in shard.iter_batches(batch_size=4096, columns=list(PROMPT_COLUMNS)):
                    if any(column.null_count for column in batch.columns):
                        raise DataError(f"{where}: shard {name} holds missing (null) prompts, columns or record "
                                        f"numbers; {PREPARE_PROMPTS} again")
                    for prompt, columns in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                        for text in (prompt.encode(), columns.encode()):
                            text_file.write(text)
                            lengths.append(len(text))
                    records.append(batch.column(2).to_numpy(zero_copy_only=False).astype(np.int64))
            self.starts = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(np.array(lengths, dtype=np.int64), out=self.starts[1:])
            self.text = _mapped(text_file, np.uint8, int(self.starts[-1]))
        self.records = np.concatenate(records) if records else np.zeros(0, dtype=np.int64)
        self.where = where

    def row(self, k: int) -> tuple[Any, dict[str, Any]]:
        """(prompt, the other columns) of row k, decoded."""
        values = []
        for part in (2 * k, 2 * k + 1):
            try:
                values.append(json.loads(bytes(self.text[self.starts[part]:self.starts[part + 1]]).decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"{self.where}: row {k} holds text that is not JSON ({exc}); {PREPARE_PROMPTS} "
                                "again") from None
        if not isinstance(values[1], dict):
            raise DataError(f"{self.where}: row {k}'s columns are not a JSON object; {PREPARE_PROMPTS} again")
        return values[0], values[1]


class PromptBatches:
    """The prompts of one split of a prepared directory: a step's (`step_prompts`), or, with `evaluation`, the
    first ones in the split's order, the same every time (`eval_prompts`, to measure the mean reward)."""

    def __init__(self, cfg: Config, directory: str, split: str = "train", key: str = "data.path",
                 evaluation: bool = False):
        data, grpo = cfg.data, cfg.finetune.grpo
        refuse_missing(directory, key, f"prompts ({PREPARE_PROMPTS})")
        if not is_prepared(directory):
            raise DataError(f"{key}={directory!r}: finetune.objective=grpo needs prompts, a directory written by "
                            "`megatrain prepare --format prompts`")
        self.docs = Documents(directory, split, key)
        manifest = self.docs.manifest
        if not manifest.get("prompts"):
            held = "preference pairs" if manifest.get("preference_pairs") else "documents"
            raise DataError(f"{key}={directory!r} holds {held}, not prompts: {PREPARE_PROMPTS}, or set "
                            f"finetune.objective={'dpo' if held == 'preference pairs' else 'sft'}")
        names = manifest.get("prompt_columns")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise DataError(f"{key}={directory!r}: manifest.json has no 'prompt_columns' list; {PREPARE_PROMPTS} again")
        self.column_names: list[str] = names
        self.docs.check_vocabulary(cfg.model)
        self.seed, self.shuffle = data.seed, data.shuffle and not evaluation
        self.max_prompt_length = grpo.max_prompt_length
        self.count = len(self.docs)
        if data.batch_size % grpo.num_generations:
            raise DataError(f"data.batch_size={data.batch_size} is not a multiple of finetune.grpo.num_generations="
                            f"{grpo.num_generations}: it counts completions, num_generations per prompt")
        self.prompts_per_step = data.batch_size // grpo.num_generations
        if self.count < self.prompts_per_step and not evaluation:
            raise DataError(f"{self.docs.where} holds {self.count} prompts, fewer than data.batch_size / "
                            f"finetune.grpo.num_generations = {self.prompts_per_step} (data.batch_size counts "
                            "completions); lower data.batch_size or add prompts")
        self._check_length(data.seq_len, grpo.max_completion_length)
        self._text = _JsonText(Path(directory), manifest["splits"][split]["files"], self.docs.where)
        if len(self._text.records) != self.count:
            raise DataError(f"{self.docs.where}: {len(self._text.records)} prompts for {self.count} token rows; "
                            f"{PREPARE_PROMPTS} again")
        self._order_cache: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))

    def _check_length(self, seq_len: int, completion: int) -> None:
        """A row holds a prompt and its completion: the longest prompt (as kept) plus max_completion_length must fit
        data.seq_len. Known only from the data when finetune.grpo.max_prompt_length is null (the config checks
        max_prompt_length + max_completion_length when it is set)."""
        longest = int(self.docs.lengths.max())
        kept = longest if self.max_prompt_length is None else min(longest, self.max_prompt_length)
        if kept + completion > seq_len:
            raise DataError(f"data.seq_len={seq_len} cannot hold the longest prompt of {self.docs.where} ({kept} "
                            f"tokens, row {int(self.docs.lengths.argmax())}) plus finetune.grpo.max_completion_length="
                            f"{completion}: raise data.seq_len to {kept + completion}, set "
                            "finetune.grpo.max_prompt_length (a longer prompt keeps its last tokens), or lower "
                            "max_completion_length")

    def __len__(self) -> int:
        return self.count

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.count) if self.shuffle \
                else np.arange(self.count)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def step_rows(self, step: int) -> list[int]:
        """The split's rows that step `step` takes: prompt k of the run is row perm_e[k mod n] of epoch e = k // n."""
        first = step * self.prompts_per_step
        return [int(self._order(k // self.count)[k % self.count]) for k in range(first, first + self.prompts_per_step)]

    def step_prompts(self, step: int) -> PromptRows:
        return self.rows(self.step_rows(step))

    def eval_prompts(self, count: int) -> PromptRows:
        """The first `count` prompts of the split in its stored order (fewer when it holds fewer): the same every
        time, so their mean reward compares across evaluations."""
        return self.rows(list(range(min(count, self.count))))

    def rows(self, rows: list[int]) -> PromptRows:
        ids, prompts, columns = [], [], {name: [] for name in self.column_names}
        for k in rows:
            start, end = int(self.docs.starts[k]), int(self.docs.starts[k + 1])
            if self.max_prompt_length is not None:
                start = max(start, end - self.max_prompt_length)  # the last tokens, next to the completion
            ids.append(self.docs.tokens[start:end].astype(np.int64).tolist())
            prompt, extra = self._text.row(k)
            prompts.append(prompt)
            for name in self.column_names:
                columns[name].append(extra.get(name))
        return PromptRows(ids, prompts, columns, [int(self._text.records[k]) for k in rows])

    def epoch_of(self, step: int) -> float:
        return step * self.prompts_per_step / self.count
