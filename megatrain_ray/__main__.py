"""The `megatrain` command. Each subcommand maps to one plain function.

    megatrain train configs/tiny.yaml [--set optimizer.lr=1e-3 ...] [--address ADDR] [--local] [--resume auto|DIR]
    megatrain plan configs/tiny.yaml [--set ...]        # memory needed against what this machine has
    megatrain plan configs/shapes/llama3-70b.yaml --machine h200-1tb   # ... against a described box, with expected tok/s
    megatrain config configs/tiny.yaml [--set ...]      # print the resolved config
    megatrain plot runs/tiny [--out DIR]                # loss and throughput curves to PNG
    megatrain resources                                 # NUMA resources for `ray start --resources`
    megatrain cluster start|stop|env                    # a one-box Ray head for `ray job submit` (127.0.0.1, token)
    megatrain export SOURCE OUT_DIR [--dtype bfloat16|float32] [--shard-size 5GB]  # SOURCE: model, run or checkpoint dir
    megatrain prepare --tokenizer MODEL_DIR --format alpaca --input data.json --output prepared/
    megatrain prepare --tokenizer MODEL_DIR --format preference --input pairs.jsonl --output prefs/  # DPO pairs
    megatrain prepare --tokenizer MODEL_DIR --format prompts --input prompts.jsonl --output prompts/  # GRPO prompts
    megatrain generate RUN_OR_MODEL --prompts prompts.jsonl [--out completions.jsonl]  # a completion per prompt
    megatrain chat RUN_OR_MODEL                         # a conversation on stdin/stdout (/reset, /exit)

Exit codes: 0 done; 2 bad input or a failure with its message; 130/143 stopped by SIGINT/SIGTERM
(after saving a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain_ray import __version__
from megatrain_ray.cli_arguments import EPILOGS, add_arguments
from megatrain_ray.exceptions import ConfigError, MegatrainError
from megatrain_ray.observe.log import get_logger, init_logger

# The config, planning, driver and store modules import torch (a second of start-up): each command imports what it
# needs, so `megatrain prepare` (and its worker processes' forkserver) never does.
if TYPE_CHECKING:
    from megatrain_ray.config.sections import Config
    from megatrain_ray.driver.trainer import Trainer

log = get_logger(__name__)


def _load(args: argparse.Namespace) -> Config:
    from megatrain_ray.config.load import load_config  # lazy: start-up time (torch)

    overrides = list(args.set or [])
    if getattr(args, "address", None):
        overrides.append(f"runtime.address={args.address}")
    if getattr(args, "local", False):
        overrides.append("runtime.mode=local")
    return load_config(args.config, overrides)


def _resume_command(args: argparse.Namespace) -> str:
    """This command line with `--resume auto`: every override kept, so it continues this run and no other."""
    words = ["megatrain", "train", args.config]
    for override in args.set or []:
        words += ["--set", override]
    if args.address:
        words += ["--address", args.address]
    if args.local:
        words.append("--local")
    return shlex.join([*words, "--resume", "auto"])


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model as the config says; the run directory gets config.yaml, metrics.jsonl and checkpoints."""
    from megatrain_ray.driver.trainer import Interrupted, Trainer  # lazy: start-up time (the actors and engine)

    cfg = _load(args)
    trainer = Trainer(cfg, resume=args.resume, resume_command=_resume_command(args))

    def stop(signum: int, frame: object) -> None:
        if trainer.stop_signal is not None:  # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt
        log.warning("signal %d: stopping after this step%s", signum,
                    " with a checkpoint" if cfg.checkpoint.on_signal else "")
        trainer.stop_signal = signum

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer.start()
        # ray.init installs Ray's own handler for SIGTERM, which logs and kills the process (`ray job stop`
        # would lose the checkpoint): ours again, after it.
        for sig in previous:
            signal.signal(sig, stop)
        history = trainer.train()
    except Interrupted as exc:
        where = f"checkpoint {exc.checkpoint}; resume with: {trainer.resume_command}" \
            if exc.checkpoint else "no checkpoint saved (checkpoint.on_signal is false)"
        log.warning("stopped by signal %d at step %d: %s", exc.signum, trainer.next_step, where)
        return 128 + exc.signum
    except KeyboardInterrupt:
        log.warning("interrupted; shutting the actors down without a checkpoint")
        return 130
    finally:
        trainer.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if history:
        log.info("done: %d steps, final loss %.4f, %s", trainer.next_step, history[-1]["loss"],
                 trainer.run_dir / "metrics.jsonl")
        log.info("%s", trainer_disk_summary(trainer))
    else:
        log.info("nothing to do: the checkpoint is already at train.steps=%d", cfg.train.steps)
    return 0


def trainer_disk_summary(trainer: Trainer) -> str:
    """What the run's directories take on disk now (store/disk_use.run_disk_summary)."""
    from megatrain_ray.store.disk_use import export_dtype, run_disk_summary  # lazy: start-up time (torch)

    cfg = trainer.cfg
    return run_disk_summary(trainer.run_dir, trainer.checkpoints.root, cfg.checkpoint.keep, cfg.train.export_dir,
                            export_dtype(cfg.train.export_dtype, cfg.model.path or None))


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the host RAM, shared memory, pinned memory and GPU memory the config needs, and the expected
    tok/s, against this machine (or one described by --machine and/or --host-memory/--gpu-memory/--shm);
    exit 2 when it does not fit."""
    from megatrain_ray.planning.machine import Machine  # lazy: start-up time (torch)
    from megatrain_ray.planning.memory import plan_run  # lazy: start-up time (torch)
    from megatrain_ray.planning.plan_text import format_plan  # lazy: start-up time (torch)

    try:
        cfg = _load(args)
    except MegatrainError as exc:
        if getattr(exc, "hub_name", None) is None:
            raise
        raise ConfigError(f"{exc}. To plan without the hub: {_offline_shapes(exc.hub_name)}") from None  # type: ignore
    machine = Machine.from_preset(args.machine) if args.machine else Machine.detect(cfg.host.shm_dir)
    machine = machine.override(host_memory=args.host_memory, gpu_memory=args.gpu_memory, shm=args.shm)
    for flag, value, unit, adjust in (("--optimizer-gparams", args.optimizer_gparams, "G params/s", "with_optimizer_rate"),
                                      ("--disk-gbps", args.disk_gbps, "GB/s", "with_disk_rate")):
        if value is None:
            continue
        if value <= 0:
            raise ConfigError(f"{flag} {value:g}: must be > 0 ({unit})")
        if machine.profile is None:
            raise ConfigError(f"{flag} needs measured GPU rates: name a machine with --machine")
        machine = replace(machine, profile=getattr(machine.profile, adjust)(value))
    plan = plan_run(cfg, machine)
    sys.stdout.write(format_plan(plan))
    return 0 if plan.fits else 2


def _offline_shapes(hub_name: str) -> str:
    """Where `megatrain plan` finds a model's shape without the hub: configs/shapes/, the file matching `hub_name`
    named when there is one."""
    shapes = Path(__file__).resolve().parent.parent / "configs" / "shapes"
    model = hub_name.split("/")[-1].lower()
    stems = [p.stem for p in shapes.glob("*.yaml")]
    matches = sorted((s for s in stems if model.startswith(s)), key=len)
    if not matches:  # Llama-3.1-70B-Instruct -> llama3-70b.yaml: the same family letters and size in billions
        def family_size(name: str) -> tuple[str, set[str]]:
            return re.match(r"[a-z]*", name).group(), set(re.findall(r"(?<![\d.])\d+(?:\.\d+)?b(?![a-z])", name))
        family, sizes = family_size(model)
        matches = sorted((s for s in stems if family and sizes and family_size(s) == (family, sizes)),
                         key=len, reverse=True)
    which = f"configs/shapes/{matches[-1]}.yaml" if matches else "configs/shapes/<model>.yaml"
    return (f"the YAML files in configs/shapes/ describe common models' shapes and plan offline, with no download: "
            f"megatrain plan {which} (with --set for this config's data, precision and host keys)")


def cmd_config(args: argparse.Namespace) -> int:
    """Print the config after defaults and overrides, as the run would use it."""
    from megatrain_ray.config.load import config_to_yaml  # lazy: start-up time (torch)

    sys.stdout.write(config_to_yaml(_load(args)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a run's loss and throughput (tok/s, model TFLOPS) curves from its metrics.jsonl to PNG."""
    from megatrain_ray.observe.plot import plot_run  # lazy: start-up time

    for path in plot_run(Path(args.run_dir), Path(args.out) if args.out else None):
        log.info("wrote %s", path)
    return 0


def cmd_resources(args: argparse.Namespace) -> int:
    """Print this machine's NUMA nodes as Ray custom resources, for `ray start --head --resources=...`."""
    from megatrain_ray.driver.placement import numa_resources  # lazy: start-up time (torch)
    from megatrain_ray.system.topology import detect_topology  # lazy: start-up time

    sys.stdout.write(json.dumps(numa_resources(detect_topology())) + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a Hugging Face model directory (safetensors shards, index, config.json, tokenizer files) from a
    run directory (its newest complete checkpoint), a checkpoint, or a directory of safetensors weights
    (train.export_dir, a Hugging Face model)."""
    from megatrain_ray.config.load import parse_size  # lazy: start-up time (torch)
    from megatrain_ray.store.export import export_weights_dir  # lazy: start-up time (torch)

    export_weights_dir(args.source, args.out_dir, dtype=args.dtype, shard_bytes=parse_size(args.shard_size, "--shard-size"))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize text or chat/instruction data into pyarrow shards with a per-token loss mask (data.path)."""
    from megatrain_ray.data.prepare import PrepareOptions, prepare  # lazy: start-up time (pyarrow)

    prepare(PrepareOptions(
        tokenizer_dir=args.tokenizer, format=args.format, inputs=list(args.input or []), output_dir=args.output,
        seq_len=args.seq_len, seed=args.seed, eval_fraction=args.eval_fraction, registry=args.registry,
        dataset=args.dataset, revision=args.revision, hf_dataset=args.hf_dataset, hf_split=args.hf_split,
        hf_subset=args.hf_subset, hf_revision=args.hf_dataset_revision, workers=args.workers,
        on_bad_record=args.on_bad_record, train_on_inputs=args.train_on_inputs, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """Start, stop or print the environment of a one-box Ray head for `ray job submit`: 127.0.0.1 only, token auth,
    free ports, NUMA resources; `start` writes the exports to ~/.megatrain/cluster.env."""
    from megatrain_ray.driver import head  # lazy: start-up time

    if args.action == "start":
        exports = head.start(num_gpus=args.num_gpus, allow_unauthenticated=args.allow_unauthenticated,
                             private_parent=Path(args.temp_dir).absolute() if args.temp_dir else None)
        log.info("Ray head up: dashboard %s (token in ~/.ray/auth_token); in every terminal that submits jobs: "
                 "source %s", exports["RAY_API_SERVER_ADDRESS"], head.env_file())
        sys.stdout.write(head.exports_text())
    elif args.action == "stop":
        log.info("stopped the megatrain cluster (%d processes)", head.stop())
    else:
        sys.stdout.write(head.exports_text())
    return 0


def _generation_options(args: argparse.Namespace) -> object:
    from megatrain_ray.driver.generate import GenerationOptions  # lazy: start-up time (torch)

    given = vars(args)
    return GenerationOptions(**{name: given[name] for name in GenerationOptions.__dataclass_fields__ if name in given})


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete every prompt of a jsonl file with a run's newest checkpoint, an export or any model.path, through
    the rollout engine; one jsonl line per prompt with the completion, its token count and finish reason."""
    from megatrain_ray.driver.generate import generate_file  # lazy: start-up time (torch)

    return generate_file(_generation_options(args))


def cmd_chat(args: argparse.Namespace) -> int:
    """Talk to a run's newest checkpoint, an export or any model.path: each stdin line a user turn, the
    conversation kept and rendered by the model's chat template; /reset starts again, /exit or EOF leaves."""
    from megatrain_ray.driver.generate import chat  # lazy: start-up time (torch)

    return chat(_generation_options(args))


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "config": cmd_config, "plot": cmd_plot,
            "resources": cmd_resources, "export": cmd_export, "prepare": cmd_prepare,
            "cluster": cmd_cluster, "generate": cmd_generate, "chat": cmd_chat}
def _summary(doc: str) -> str:
    """A command's docstring up to its first full stop, on one line: its line in `megatrain --help`."""
    text = " ".join(doc.split())
    end = text.find(". ")
    return text[:end + 1] if end >= 0 else text


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; `only`: the command being run, the one whose arguments are added (all, when None)."""
    parser = argparse.ArgumentParser(
        prog="megatrain", description="Train and fine-tune LLMs on one GPU from host memory, with Ray actors.",
        epilog="Docs: README.md and docs/ (quick start, fine-tuning guide, operations on Ray, configuration).")
    parser.add_argument("--version", action="version", version=f"megatrain-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn in COMMANDS.items():
        command = sub.add_parser(name, help=_summary(fn.__doc__), description=" ".join(fn.__doc__.split()),
                                 epilog=EPILOGS.get(name))
        if only is None or name == only:
            add_arguments(name, command)
    return parser


def main(argv: list[str] | None = None) -> int:
    init_logger("driver", force=True)
    words = sys.argv[1:] if argv is None else argv
    # The command's arguments only: another command's may need imports (plan's --machine names, torch).
    args = build_parser(words[0] if words and words[0] in COMMANDS else None).parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MegatrainError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
