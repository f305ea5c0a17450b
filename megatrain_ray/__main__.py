"""The `megatrain` command. Each subcommand maps to one plain function.

    megatrain train configs/tiny.yaml [--set optimizer.lr=1e-3 ...] [--address ADDR] [--local]
    megatrain config configs/tiny.yaml [--set ...]      # print the resolved config
    megatrain export SOURCE OUT_DIR [--dtype bfloat16|float32] [--shard-size 5GB]
    megatrain prepare --tokenizer MODEL_DIR --format alpaca --input data.json --output prepared/
"""

from __future__ import annotations

import argparse
import signal
import sys

from megatrain_ray.config import Config, config_to_yaml, load_config
from megatrain_ray.exceptions import MegatrainError
from megatrain_ray.log import get_logger, init_logger

log = get_logger(__name__)


def _load(args: argparse.Namespace) -> Config:
    overrides = list(args.set or [])
    if getattr(args, "address", None):
        overrides.append(f"runtime.address={args.address}")
    if getattr(args, "local", False):
        overrides.append("runtime.mode=local")
    return load_config(args.config, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model as the config says; the run directory gets config.yaml and metrics.jsonl."""
    from megatrain_ray.trainer import Trainer

    cfg = _load(args)
    trainer = Trainer(cfg)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        trainer.start()
        history = trainer.train()
    except KeyboardInterrupt:
        log.warning("interrupted; shutting the actors down")
        return 130
    finally:
        trainer.close()
    last = history[-1]
    log.info("done: %d steps, final loss %.4f, %s", len(history), last["loss"], trainer.run_dir / "metrics.jsonl")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the config after defaults and overrides, as the run would use it."""
    sys.stdout.write(config_to_yaml(_load(args)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a Hugging Face model directory (safetensors shards, index, config.json, tokenizer files) from a
    directory of safetensors weights (train.export_dir of a run, or a Hugging Face model) or a run directory."""
    from megatrain_ray.model.hf_io import export_weights_dir, parse_size

    export_weights_dir(args.source, args.out_dir, dtype=args.dtype, shard_bytes=parse_size(args.shard_size))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize text or chat/instruction data into pyarrow shards with a per-token loss mask (data.path)."""
    from megatrain_ray.prepare import PrepareOptions, prepare

    prepare(PrepareOptions(
        tokenizer_dir=args.tokenizer, format=args.format, inputs=list(args.input or []), output_dir=args.output,
        seq_len=args.seq_len, seed=args.seed, eval_fraction=args.eval_fraction, registry=args.registry,
        dataset=args.dataset))
    return 0


COMMANDS = {"train": cmd_train, "config": cmd_config, "export": cmd_export, "prepare": cmd_prepare}


def _add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    if name in ("train", "config"):
        p.add_argument("config", help="YAML config file (see configs/)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config key, e.g. --set optimizer.lr=1e-4 (repeatable)")
    if name == "train":
        p.add_argument("--address", help="Ray cluster address to attach to (default: a running local "
                                         "cluster, else a private one on 127.0.0.1)")
        p.add_argument("--local", action="store_true", help="run the actors in this process, without Ray")
    if name == "export":
        p.add_argument("source", help="a directory with model.safetensors* and config.json (train.export_dir, "
                                      "a Hugging Face model) or a run directory whose config set train.export_dir")
        p.add_argument("out_dir", help="the directory to create (must not exist or be empty)")
        p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                       help="format of the written weights (default: the source's config.json dtype, else float32)")
        p.add_argument("--shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    if name == "prepare":
        p.add_argument("--tokenizer", required=True, help="model directory with the tokenizer (and chat template)")
        p.add_argument("--format", choices=["text", "alpaca", "sharegpt", "messages"],
                       help="record format (default: the registry entry's formatting, else text)")
        p.add_argument("--input", nargs="+", help="jsonl, json, parquet or txt files")
        p.add_argument("--output", required=True, help="directory to create for the shards and manifest.json")
        p.add_argument("--seq-len", type=int, default=0, help="truncate documents to this many tokens (0: never)")
        p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle")
        p.add_argument("--eval-fraction", type=float, default=0.0, help="share of documents in the eval split")
        p.add_argument("--registry", help="a dataset_info.json (LLaMA-Factory style) naming datasets")
        p.add_argument("--dataset", help="the dataset of --registry to prepare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain", description="Train LLMs on one GPU from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in COMMANDS.items():
        _add_arguments(name, sub.add_parser(name, help=fn.__doc__.splitlines()[0], description=fn.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    init_logger("driver", force=True)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MegatrainError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
