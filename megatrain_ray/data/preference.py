"""DPO batches: whole preference pairs from a directory written by `megatrain prepare --format preference`.

Documents 2k and 2k + 1 of a split are pair k's chosen and rejected sequences (the shards' `pair_role`
column says which, and is checked). data.batch_size counts rows, two per pair, so a step takes
batch_size / 2 pairs: the chosen rows first, then the rejected rows in the same pair order (TRL's layout,
what model/preference.py expects). One sequence per row, padded (no packing). With several ranks each takes
whole pairs (split_pairs). Epoch e visits the pairs in
a permutation seeded by (data.seed, e), so a step's batch is a pure function of (data.seed, step), as for
every other data source. Each row carries its reference log-probability (driver/reference.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain_ray.config.sections import Config
from megatrain_ray.data.batches import (
    DocumentBatches,
    TokenBatches,
    is_prepared,
    make_batches,
    make_eval_batches,
    refuse_missing,
)
from megatrain_ray.data.prepare.shards import PAIR_ROLE
from megatrain_ray.data.prompts import PromptBatches
from megatrain_ray.exceptions import ConfigError, DataError
from megatrain_ray.messages import Batch, PreferenceRows
from megatrain_ray.system.files import contained


class PreferenceBatches(DocumentBatches):
    """The pairs of one split of a prepared directory: training batches (`batch`), or, with `evaluation`, the
    first `eval_batches` batches of its pairs in order, the same every time (iterating over it)."""

    def __init__(self, cfg: Config, directory: str, split: str = "train", key: str = "data.path",
                 eval_batches: int = 0):
        data = cfg.data
        refuse_missing(directory, key, "a directory written by `megatrain prepare --format preference`")
        if not is_prepared(directory):
            raise DataError(f"{key}={directory!r}: finetune.objective=dpo needs preference pairs, a directory "
                            "written by `megatrain prepare --format preference`")
        super().__init__(data, cfg.model, directory, split, key, evaluation=bool(eval_batches))
        self.directory, self.split, self.eval_batches = directory, split, eval_batches
        if not self.docs.manifest.get("preference_pairs"):
            raise DataError(f"{key}={directory!r} holds documents, not preference pairs: prepare it with "
                            "`megatrain prepare --format preference`, or set finetune.objective=sft")
        self._check_pairs(split)
        self.dpo = cfg.finetune.dpo
        self.pairs = len(self.docs) // 2
        self.pairs_per_step = data.batch_size // 2
        if self.pairs < self.pairs_per_step and not eval_batches:
            raise DataError(f"{self.docs.where} holds {self.pairs} preference pairs, fewer than data.batch_size / 2 = "
                            f"{self.pairs_per_step} (data.batch_size counts rows, two per pair); lower "
                            "data.batch_size or add data")
        self._pair_cache: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))
        self.reference: torch.Tensor | None = None
        """[documents] float64 reference log-probabilities, by document index (attach_reference)."""

    def _check_pairs(self, split: str) -> None:
        import pyarrow.parquet as pq  # lazy: start-up time

        roles = []
        for name in self.docs.manifest["splits"][split]["files"]:
            path = contained(Path(self.directory), name, self.docs.where, DataError)
            table = pq.read_table(path, columns=[PAIR_ROLE]) if PAIR_ROLE in pq.read_schema(path).names else None
            if table is None:
                raise DataError(f"{self.docs.where}: shard {name} has no {PAIR_ROLE!r} column; prepare the data "
                                "again with `megatrain prepare --format preference`")
            roles.append(table.column(0).to_numpy())
        role = np.concatenate(roles)
        if len(role) % 2 or not (np.all(role[0::2] == 0) and np.all(role[1::2] == 1)):
            raise DataError(f"{self.docs.where}: the rows are not (chosen, rejected) pairs in order; prepare the data "
                            "again with `megatrain prepare --format preference`")

    def attach_reference(self, logps: torch.Tensor) -> None:
        if logps.shape != (len(self.docs),):
            raise DataError(f"{self.docs.where}: {logps.shape[0]} reference log-probabilities for {len(self.docs)} "
                            "sequences")
        self.reference = logps.to(torch.float64)

    def _pair_order(self, epoch: int) -> np.ndarray:
        if self._pair_cache[0] != epoch:
            order = np.random.default_rng([self.cfg.seed, epoch]).permutation(self.pairs) if self.shuffle \
                else np.arange(self.pairs)
            self._pair_cache = (epoch, order)
        return self._pair_cache[1]

    def step_documents(self, step: int) -> list[int]:
        """The documents of step `step`'s rows: its pairs' chosen sequences, then their rejected ones."""
        pairs = []
        for k in range(step * self.pairs_per_step, (step + 1) * self.pairs_per_step):
            pairs.append(int(self._pair_order(k // self.pairs)[k % self.pairs]))
        return [2 * p for p in pairs] + [2 * p + 1 for p in pairs]

    def batch(self, step: int) -> Batch:
        return self.pairs_batch(self.step_documents(step))

    def __iter__(self) -> Iterator[Batch]:
        """Evaluation: the first eval_batches batches of pairs, in order (the last one may be short)."""
        for start in range(0, min(self.pairs, self.eval_batches * self.pairs_per_step), self.pairs_per_step):
            pairs = range(start, min(start + self.pairs_per_step, self.pairs))
            yield self.pairs_batch([2 * p for p in pairs] + [2 * p + 1 for p in pairs])

    def pairs_batch(self, documents: list[int]) -> Batch:
        """The rows of these documents (chosen ones first) with their reference log-probabilities."""
        if self.reference is None:
            raise RuntimeError("the reference log-probabilities are not attached (driver/reference.py)")
        rows = self.rows_batch([[d] for d in documents])
        return Batch(rows.input_ids, rows.labels, preference=PreferenceRows(
            self.reference[documents], self.dpo.beta, self.dpo.label_smoothing, self.dpo.loss_type))

    def reference_batches(self) -> Iterator[tuple[list[int], Batch]]:
        """Every document once, in order, data.batch_size rows at a time (the reference pass)."""
        b = self.cfg.batch_size
        for start in range(0, len(self.docs), b):
            documents = list(range(start, min(start + b, len(self.docs))))
            yield documents, self.rows_batch([[d] for d in documents])

    def epoch_of(self, step: int) -> float:
        return step * self.pairs_per_step / self.pairs


def split_pairs(batch: Batch, ranks: int) -> list[Batch]:
    """Each rank's share of a DPO batch: whole pairs (pair p's chosen row p and rejected row P + p stay together),
    each part laid out as a batch of its own, every rank dividing by the pairs of the whole batch."""
    pref = batch.preference
    assert pref is not None
    pairs = batch.input_ids.shape[0] // 2
    per_rank = pairs // ranks
    parts = []
    for r in range(ranks):
        rows = [*range(r * per_rank, (r + 1) * per_rank), *range(pairs + r * per_rank, pairs + (r + 1) * per_rank)]
        parts.append(Batch(batch.input_ids[rows].contiguous(), batch.labels[rows].contiguous(),
                           preference=PreferenceRows(pref.reference_logps[rows], pref.beta, pref.label_smoothing,
                                                     pref.loss_type, total_pairs=pairs)))
    return parts


def make_training_batches(cfg: Config) -> TokenBatches | DocumentBatches | PromptBatches:
    """The training batches of finetune.objective: preference pairs (dpo), prompts (grpo: data/prompts.py), or
    data.path's batches (sft), which must be neither (cross-entropy would learn the rejected answers too, or from
    prompts alone nothing)."""
    if cfg.finetune.objective == "dpo":
        return PreferenceBatches(cfg, cfg.data.path)
    if cfg.finetune.objective == "grpo":
        return PromptBatches(cfg, cfg.data.path)
    batches = make_batches(cfg.data, cfg.model)
    if isinstance(batches, DocumentBatches) and batches.docs.manifest.get("preference_pairs"):
        raise DataError(f"data.path={cfg.data.path!r} holds preference pairs (chosen and rejected answers): set "
                        "finetune.objective=dpo, or prepare SFT data without --format preference")
    if isinstance(batches, DocumentBatches) and batches.docs.manifest.get("prompts"):
        raise DataError(f"data.path={cfg.data.path!r} holds GRPO prompts (no answers to learn): set "
                        "finetune.objective=grpo, or prepare SFT data without --format prompts")
    return batches


def make_evaluation_batches(cfg: Config) -> list[Batch] | PreferenceBatches | PromptBatches:
    """train.eval_every's fixed batches: DPO pairs (data.eval_path's, else the eval split of data.path; iterable
    once their reference log-probabilities are attached), GRPO prompts (the same places; eval_prompts gives the first
    ones, whose mean reward is the measure), or make_eval_batches' documents."""
    if cfg.finetune.objective == "grpo":
        return make_evaluation_prompts(cfg)
    if cfg.finetune.objective != "dpo":
        return make_eval_batches(cfg.data, cfg.model, cfg.train.eval_batches)
    return held_out(cfg, "pairs", lambda path, split, key: PreferenceBatches(cfg, path, split, key,
                                                                             eval_batches=cfg.train.eval_batches))


def make_evaluation_prompts(cfg: Config) -> PromptBatches:
    """GRPO's held-out prompts: data.eval_path's (its train split), else the eval split of data.path."""
    return held_out(cfg, "prompts", lambda path, split, key: PromptBatches(cfg, path, split, key, evaluation=True))


def held_out(cfg: Config, what: str, make: Callable[[str, str, str], Any]) -> Any:
    """`make(directory, split, config key)` of the held-out data: data.eval_path's train split, else data.path's
    eval split (prepared with --eval-fraction); `what` names the data in the error when there is neither."""
    if cfg.data.eval_path:
        return make(cfg.data.eval_path, "train", "data.eval_path")
    if not is_prepared(cfg.data.path):
        raise ConfigError(f"train.eval_every needs evaluation {what}: set data.eval_path, or prepare data.path with "
                          "--eval-fraction")
    return make(cfg.data.path, "eval", "data.path")
