"""The `megatrain prepare` pipeline: records in, shards out, in bounded memory.

    main process: read items (jsonl lines as bytes) -> chunks of CHUNK_RECORDS
      -> workers (forkserver processes, --workers): parse, render, tokenize, mask   [tokenizing.py, tokenize.py,
                                                                                   chat_render.py]
      -> results in input order -> split by record -> shard writers              [shards.py]

Why this shuffle and split: nothing ever holds all the documents. The eval split is an exact, seeded
sample of round(records * eval_fraction) record numbers (at least one), drawn in one pass by selection
sampling (Knuth's algorithm S) after a cheap count of the records (jsonl lines, parquet metadata); a record
in the sample that is skipped or dropped leaves the eval split one short. The log says how many records
each split got, with a warning when the eval split is too small to mean much (warn_eval_split). Each split
is written as shards while they fill, each shard's rows in a permutation seeded by (seed, split, shard number);
training then shuffles all rows of a split by (data.seed, epoch) anyway (data/batches.py), so a
global shuffle here would buy nothing but memory. Results come back in input order whatever the
number of workers, so the output does not depend on --workers.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.data.hub_datasets import hub_dataset_files
from megatrain_ray.data.prepare import spec_check_cache
from megatrain_ray.data.prepare.chat_render import spec_from_files
from megatrain_ray.data.prepare.records import FORMATS, Columns, count_records, read_records
from megatrain_ray.data.prepare.shards import SplitWriter
from megatrain_ray.data.prepare.tokenize import NO_TEMPLATE, Job, resolve_tokenizer, tokenizer_hash
from megatrain_ray.data.prepare.tokenizing import SpecMismatch, Tokenizing
from megatrain_ray.data.prepare.vision_docs import VisionJob
from megatrain_ray.exceptions import DataError
from megatrain_ray.observe.log import get_logger
from megatrain_ray.system.files import atomic_directory, contained, read_json_object, refuse_existing

log = get_logger(__name__)

MANIFEST = "manifest.json"
TRANSFORMERS_FORMATS = ("text", "preference", "prompts")
"""Formats tokenized by transformers' own tokenizer in each worker (no TokenizerSpec); a chat template per record."""
CHUNK_RECORDS = 256
PROGRESS_SECONDS = 5.0


@dataclass(slots=True)
class PrepareOptions:
    tokenizer_dir: str
    format: str | None
    """One of FORMATS; None takes the registry entry's `formatting`, else text."""
    inputs: list[str]
    output_dir: str
    seq_len: int = 0
    """Documents longer than this many tokens are truncated (and counted); 0 never truncates."""
    seed: int = 0
    eval_fraction: float = 0.0
    registry: str | None = None
    dataset: str | None = None
    hf_dataset: str | None = None
    """A dataset by hub name or local dataset directory (the datasets library), read like --input files."""
    hf_split: str = "train"
    hf_subset: str | None = None
    hf_revision: str | None = None
    revision: str | None = None
    """The hub revision of --tokenizer when it is a hub name."""
    workers: int = 0
    """Tokenizing processes; 0: one per available core. One works in this process."""
    on_bad_record: str = "skip"
    """skip: a record the format cannot read is counted and left out; fail: it stops the run."""
    train_on_inputs: bool = False
    """Chat formats: every token in the loss, not only the assistant turns."""
    min_pixels: int = 0
    max_pixels: int = 0
    """A vision-language model's images: the processor's pixel caps (0: its own), where it has them."""


def resolve_inputs(opts: PrepareOptions) -> tuple[list[Path], str, Columns]:
    """Files, format and field names, from the command line or a dataset_info.json entry."""
    cols = Columns()
    if opts.hf_dataset:
        if opts.registry:
            raise DataError("give --hf-dataset or --registry, not both")
        files = [*hub_dataset_files(opts.hf_dataset, opts.hf_split, opts.hf_subset, opts.hf_revision),
                 *(Path(p) for p in opts.inputs)]
        return files, opts.format or "text", cols
    if not opts.registry:
        if not opts.inputs:
            raise DataError("give --input FILE..., --hf-dataset NAME, or --registry dataset_info.json --dataset NAME")
        fmt = opts.format or "text"
        return [Path(p) for p in opts.inputs], fmt, cols
    registry = Path(opts.registry)
    if not registry.is_file():
        raise DataError(f"--registry {opts.registry!r} is not a file; give a dataset_info.json")
    entries = read_json_object(registry, f"--registry {opts.registry!r}", DataError)
    if opts.dataset not in entries:
        raise DataError(f"--dataset {opts.dataset!r} is not in {registry}; it names: {', '.join(sorted(entries))}")
    entry = entries[opts.dataset]
    if not isinstance(entry, dict):
        raise DataError(f"--registry {opts.registry!r}: the entry of {opts.dataset!r} is not a JSON object")
    where = f"--registry {opts.registry!r} ({opts.dataset})"
    files = [contained(registry.parent, entry["file_name"], where, DataError)] if "file_name" in entry else []
    files += [Path(p) for p in opts.inputs]
    # LLaMA-Factory marks preference data `ranking`; its sharegpt or alpaca layout is found per record.
    fmt = opts.format or ("preference" if entry.get("ranking") else entry.get("formatting", "alpaca"))
    renames = entry.get("columns", {})
    tags = entry.get("tags", {})
    cols = Columns(prompt=renames.get("prompt", cols.prompt), query=renames.get("query", cols.query),
                   response=renames.get("response", cols.response), system=renames.get("system", cols.system),
                   messages=renames.get("messages", ""), role_tag=tags.get("role_tag", ""),
                   content_tag=tags.get("content_tag", ""))
    if tags:
        cols.roles = {tags.get("user_tag", "human"): "user", tags.get("assistant_tag", "gpt"): "assistant",
                      tags.get("system_tag", "system"): "system", tags.get("function_tag", "function_call"): "assistant",
                      tags.get("observation_tag", "observation"): "tool"}
    if fmt == "sharegpt" and cols.role_tag == "role":  # LLaMA-Factory spells the OpenAI format this way
        fmt = "messages"
    return files, fmt, cols



def vision_job(opts: PrepareOptions, directory: str, fmt: str) -> VisionJob | None:
    """The vision path of a vision-language model's chat records (prepare/vision_docs.py); None: text only."""
    vision = vision_config_of_dir(directory)
    for key in ("min_pixels", "max_pixels"):
        if getattr(opts, key) < 0:
            raise DataError(f"--{key.replace('_', '-')} {getattr(opts, key)} must be a number of pixels >= 1 (leave "
                            "it out for the processor's own)")
    caps = [f"--{k.replace('_', '-')}" for k in ("min_pixels", "max_pixels") if getattr(opts, k)]
    if vision is None or fmt not in ("messages", "sharegpt", "alpaca"):
        if caps:
            raise DataError(f"{caps[0]} applies to a vision-language model's chat records with images; --tokenizer "
                            f"{opts.tokenizer_dir} is {'a text model' if vision is None else f'read as --format {fmt}'}"
                            "; leave it out")
        return None
    return VisionJob(directory, vision.image_token_id, opts.min_pixels, opts.max_pixels)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class EvalSample:
    """Selection sampling: of `total` records, exactly `wanted` (seeded) are chosen, in one pass."""

    def __init__(self, total: int, wanted: int, seed: int):
        self.left, self.wanted = total, wanted
        self.rng = np.random.default_rng([seed, 0x5EED])
        self.draws = np.zeros(0)

    def next(self) -> bool:
        if not self.wanted:
            return False
        if not len(self.draws):
            self.draws = self.rng.random(4096)
        u, self.draws = self.draws[0], self.draws[1:]
        chosen = u * self.left < self.wanted
        self.left -= 1
        self.wanted -= chosen
        return bool(chosen)


class Progress:
    """A line through the logger every PROGRESS_SECONDS: records done, records/s, ETA."""

    def __init__(self, total: int):
        self.total, self.t0 = total, time.perf_counter()
        self.last = self.t0

    def update(self, done: int, documents: int) -> None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate else math.inf
        log.info("prepare: %d/%d records (%.0f%%), %d documents, %.0f records/s, ETA %.0f s", done, self.total,
                 100 * done / max(self.total, 1), documents, rate, eta)


EVAL_SPLIT_MIN_RECORDS = 20
"""Fewer eval records than this and eval_loss is the loss of a handful of examples, always the same ones: a
number that moves with which records the seeded draw took more than with the training."""


def warn_eval_split(fraction: float, total: int, train: int, held: int) -> None:
    """How many records each split got; a warning when the eval split is too small to mean much, or its share
    is far from --eval-fraction (a tiny set, or sampled records that were skipped or dropped)."""
    share = held / max(1, train + held)
    text = (f"prepare: --eval-fraction {fraction:g} of {total} records: the eval split got {held} record(s) "
            f"({share:.1%}), the train split {train}")
    if held < EVAL_SPLIT_MIN_RECORDS or abs(share - fraction) > 0.25 * fraction:
        log.warning("%s; %s", text, f"an eval_loss over fewer than {EVAL_SPLIT_MIN_RECORDS} records (always the "
                    "same ones) measures little: give more records or a larger --eval-fraction"
                    if held < EVAL_SPLIT_MIN_RECORDS else f"not the {fraction:.1%} asked: records the draw took were "
                    "skipped or dropped, or the set is too small to split finely")
    else:
        log.info("%s", text)


def chunks(files: list[Path]) -> Iterator[list]:
    """The input as chunks of CHUNK_RECORDS (item, record number within its file) pairs."""
    chunk: list = []
    for path in files:
        for n, item in enumerate(read_records(path)):
            chunk.append((item, n))
            if len(chunk) >= CHUNK_RECORDS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def prepare(opts: PrepareOptions) -> dict[str, Any]:
    """Tokenize, split and write; returns the manifest."""
    t0 = time.perf_counter()
    files, fmt, cols = resolve_inputs(opts)
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    if not 0 <= opts.eval_fraction < 1:
        raise DataError(f"--eval-fraction {opts.eval_fraction} must be in [0, 1)")
    if opts.seq_len < 0:
        raise DataError(f"--seq-len {opts.seq_len} must be >= 0 (the longest document in tokens; 0: never truncate)")
    if opts.on_bad_record not in ("skip", "fail"):
        raise DataError(f"--on-bad-record {opts.on_bad_record!r}: use skip or fail")
    if fmt == "preference" and opts.train_on_inputs:
        raise DataError("--train-on-inputs does not apply to --format preference: DPO scores the completions only, "
                        "as TRL does; leave it out")
    if fmt == "prompts" and opts.train_on_inputs:
        raise DataError("--train-on-inputs does not apply to --format prompts: GRPO learns from the generated "
                        "completions, never from the prompt; leave it out")
    if fmt == "prompts" and opts.seq_len:
        raise DataError("--seq-len does not apply to --format prompts: prompts are stored whole, and "
                        "finetune.grpo.max_prompt_length keeps a longer prompt's last tokens when training; leave it "
                        "out")
    if opts.workers < 0:
        raise DataError(f"--workers {opts.workers} must be >= 1 (0: one per available core)")
    out = Path(opts.output_dir)
    refuse_existing(out, DataError, "--output")  # before the tokenizing, which takes the time
    counts = [count_records(path) for path in files]
    for path, count in zip(files, counts):
        if not count:
            raise DataError(f"input file {str(path)!r} holds no records")
    total = sum(counts)
    t_tokenizer = time.perf_counter()
    directory = resolve_tokenizer(opts.tokenizer_dir, opts.revision)  # a GGUF file: converted once, cached
    t0 += (resolved := time.perf_counter() - t_tokenizer)  # the rate counts the records' own time
    if resolved >= 1.0:
        log.info("prepare: --tokenizer %s ready in %.1f s (%s), not counted in the records' rate", opts.tokenizer_dir,
                 resolved, "a .gguf file: its one-time conversion, or the hash that finds it in the cache"
                 if str(opts.tokenizer_dir).lower().endswith(".gguf")
                 else "fetched and read")
    workers = min(opts.workers or available_cores(), math.ceil(total / CHUNK_RECORDS))
    job = Job(fmt, cols, opts.seq_len, opts.train_on_inputs, vision_job(opts, directory, fmt))
    # Chat formats in worker processes: they start with the tokenizer files' spec, checked while they run.
    spec = spec_from_files(directory) if workers > 1 and fmt not in TRANSFORMERS_FORMATS else None
    # ... unless an earlier run's check found the same files (and versions) read as this spec: spec_check_cache.py.
    check_key = spec_check_cache.directory_key(directory) if spec is not None else None
    vocab_size = spec_check_cache.stored_vocab_size(check_key, spec) if spec is not None else None
    tokenizing = Tokenizing(directory, job, workers, spec, vocab_size, check_key)
    try:
        return _prepare(opts, files, fmt, counts, directory, tokenizing, t0)
    except SpecMismatch as mismatch:
        log.info("prepare: transformers reads the tokenizer in %s otherwise than its files spell it; starting "
                 "again with transformers' reading", directory)
        tokenizing.close()
        tokenizing = Tokenizing(directory, job, workers, mismatch.spec, mismatch.vocab_size)
        return _prepare(opts, files, fmt, counts, directory, tokenizing, t0)
    finally:
        tokenizing.close()


def _prepare(opts: PrepareOptions, files: list[Path], fmt: str, counts: list[int], directory: str,
             tokenizing: Tokenizing, t0: float) -> dict[str, Any]:
    if fmt not in TRANSFORMERS_FORMATS and not tokenizing.has_template():  # preference, prompts: per record
        raise DataError(NO_TEMPLATE)
    total, out = sum(counts), Path(opts.output_dir)
    # At least one record once a fraction is asked (a tiny set would otherwise round to no eval split at all).
    n_eval = min(total - 1, max(1, round(total * opts.eval_fraction))) if opts.eval_fraction else 0
    sample = EvalSample(total, n_eval, opts.seed)
    dropped: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    first_skipped = ""
    truncated = records = 0
    split_records: Counter[str] = Counter()  # records that became documents (or pairs, or prompts), per split
    prompt_columns: dict[str, None] = {}  # prompts: every other column's name, in first-seen order
    progress = Progress(total)
    log.info("prepare: %d records in %d files, %d tokenizing %s", total, len(files), tokenizing.workers,
             "process" if tokenizing.workers <= 1 else "processes")
    with atomic_directory(out, DataError, "--output") as tmp:
        pairs, images = fmt == "preference", tokenizing.job.vision is not None
        writers = {"train": SplitWriter(tmp, "train", opts.seed, pairs, images),
                   "eval": SplitWriter(tmp, "eval", opts.seed, pairs, images)}
        for results in tokenizing.results(chunks(files)):
            for result in results:
                records += 1
                split = "eval" if sample.next() else "train"
                split_records[split] += result[0] in ("doc", "pair", "prompt")
                if result[0] == "doc":
                    writers[split].add(result[1], result[2], *result[4:])
                    truncated += result[3]
                elif result[0] == "refused":  # a bad image: the dataset is broken, whatever --on-bad-record says
                    raise DataError(result[1])
                elif result[0] == "pair":
                    writers[split].add_pair(*result[1:5])
                    truncated += result[5]
                elif result[0] == "prompt":
                    writers[split].add_prompt(*result[1:4], record=records - 1)
                    prompt_columns.update(dict.fromkeys(result[4]))
                elif result[0] == "dropped":
                    dropped[result[1]] += 1
                    truncated += result[2]
                else:
                    if opts.on_bad_record == "fail":
                        tokenizing.check(wait=True)  # the workers' spec is transformers' reading: else start again
                        raise DataError(f"{result[2]} (--on-bad-record skip leaves such records out)")
                    skipped[result[1]] += 1
                    first_skipped = first_skipped or result[2]
            progress.update(records, writers["train"].documents + writers["eval"].documents)
            tokenizing.check()
        vocab_size, _ = tokenizing.info()
        documents = writers["train"].documents + writers["eval"].documents
        if not writers["train"].documents:
            left_out = f"dropped: {dict(dropped)}" + (f"; skipped: {dict(skipped)}, the first: {first_skipped}"
                                                      if skipped else "")
            where = "the train split of " if documents else ""
            raise DataError(f"no usable documents in {where}{', '.join(map(str, files))} ({left_out})")
        manifest: dict[str, Any] = {
            "format_version": 1, "format": fmt, "inputs": [str(p) for p in files],
            "tokenizer": str(opts.tokenizer_dir), "tokenizer_hash": tokenizer_hash(directory), "vocab_size": vocab_size,
            "seed": opts.seed, "seq_len": opts.seq_len, "train_on_inputs": opts.train_on_inputs,
            "records": records, "documents": documents, "truncated": truncated, "dropped": dict(dropped),
            "skipped": dict(skipped), "splits": {},
        }
        if images:  # the processor's image tensors of each document: shards.IMAGES_COLUMN
            manifest["images"] = {"processor": str(opts.tokenizer_dir), "min_pixels": opts.min_pixels,
                                  "max_pixels": opts.max_pixels,
                                  "image_token_id": tokenizing.job.vision.image_token_id}
        if pairs:  # documents 2k and 2k + 1 of a split are pair k's chosen and rejected sequences
            manifest["preference_pairs"] = True
        if fmt == "prompts":  # one prompt a document; a record without a column has null in it (as datasets does)
            manifest["prompts"] = True
            manifest["prompt_columns"] = list(prompt_columns)
        for split, writer in writers.items():
            if writer.documents:
                manifest["splits"][split] = writer.summary()
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if fmt == "prompts":
        summary = ", ".join(f"{k}: {v['documents']} prompts, {v['tokens']} tokens (longest {v['max_document_tokens']})"
                            for k, v in manifest["splits"].items())
        summary += f"; columns for the reward functions: {', '.join(manifest['prompt_columns']) or 'none'}"
    else:
        summary = ", ".join(f"{k}: {v['documents']} documents, {v['tokens']} tokens ({v['loss_tokens']} in the loss)"
                            for k, v in manifest["splits"].items())
    seconds = time.perf_counter() - t0
    if opts.eval_fraction:
        warn_eval_split(opts.eval_fraction, total, split_records["train"], split_records["eval"])
    log.info("prepare: %d records -> %s; %d truncated, dropped %s, skipped %s; wrote %s (%.1f s, %.0f records/s)",
             records, summary, truncated, dict(dropped) or "none", dict(skipped) or "none", out, seconds,
             records / seconds)
    return manifest
