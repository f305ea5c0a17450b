"""Shared fixtures: one private Ray for the modules that need it, tiny configs, CPU-only defaults."""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatrain_ray.config.load import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Inductor's CPU kernels built without SIMD (read when torch._inductor.config is first imported, after this): the
# C++ builds of the compiled-layer tests then take about a quarter less CPU (compile tests on 2 cores, cold caches:
# 194 vs 255 CPU-s). What those tests check is the traced graph and its numerics against float64; on a GPU Inductor
# writes Triton kernels, not these. Set TORCHINDUCTOR_VEC_ISA_OK=1 to build them as a CPU user's run would.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N`: the worker processes share the machine's cores. One intra-op thread each, inherited by the runs,
    # Ray actors and subprocesses a worker starts (system.topology.cpu_compute_threads honours OMP_NUM_THREADS):
    # torch threads of several workers spinning on the same cores wait for each other (see one_thread below).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def tiny_raw(**sections) -> dict:
    """A tiny Llama on synthetic tokens; keyword arguments update whole sections."""
    raw = {
        "model": {"family": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                  "rms_norm_eps": 1e-6},
        "data": {"path": "synthetic", "seq_len": 16, "batch_size": 4, "seed": 3},  # see tiny_config
        "optimizer": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
                      "workers": 1, "chunk_elems": 1024},
        "schedule": {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
        "precision": {"master_dtype": "float32", "compute_dtype": "float32"},
        "engine": {"device": "cpu", "poison_buffers": True, "loss_chunk_tokens": 24},
        "runtime": {"mode": "local", "dashboard": False},
        "train": {"steps": 20, "seed": 7, "log_every": 100},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def learnable_tokens(path, vocab: int, n: int = 4096, seed: int = 0) -> str:
    """A token file where each next token is the previous plus 1, 2 or 3 (mod vocab): the loss of a
    model that learns it falls from ln(vocab) towards ln(3)."""
    steps = np.random.default_rng(seed).integers(1, 4, n)
    np.save(path, (np.cumsum(steps) % vocab).astype(np.int32))
    return str(path)


@contextlib.contextmanager
def saved_storage_bytes() -> Iterator[dict[int, int]]:
    """Within the block, every tensor autograd saves for a backward: its storage's bytes by address (a
    storage saved twice counts once). For tests of what a function keeps for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, torch's intra-op pool at one thread (then as it was). The references of the parity tests
    (a tiny Hugging Face model's forward, a peft training run) are small ops that two threads only slow down, and on
    a busy 2-core machine by far: each op waits for a descheduled thread (measured: a tiny MoE model's forward
    1 to 2 s with two threads, 15 ms with one; a 16-step peft run 4 to 30 s, 0.3 to 1.8 s). The engine sets its own
    threads when a Trainer starts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_config(tmp_path, **sections):
    """tiny_raw on a learnable token file in tmp_path (unless the data section names a path)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = tiny_raw(**sections)
    if "path" not in sections.get("data", {}):
        raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", raw["model"]["vocab_size"])
    raw["train"]["output_dir"] = str(tmp_path / "run")
    return load_config(raw=raw)


@pytest.fixture(scope="session")
def _shared_ray() -> Iterator[dict]:
    """The suite's one private local Ray, started by the first module that asks for it and shut down at the end
    (about 5 s to start on 2 cores: once, not once per module). A module that needs a Ray of its own shuts this
    one down; the next module that asks starts it again."""
    state = {"started": False}
    yield state
    import ray

    from megatrain_ray.driver import warm_actors

    warm_actors.keep_actor_processes(False)
    if state["started"] and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_shared_ray):
    """A private local Ray for the module's tests (the suite's shared one). Its runs keep their CPU actor
    processes for the next run, of this module or of a later one on the same Ray (driver/warm_actors.py): some 2 s
    of CPU saved per actor start. Between such modules the kept processes wait; runs of other modules start
    their actors fresh."""
    import ray

    from megatrain_ray.config.runtime_sections import RuntimeConfig
    from megatrain_ray.driver import warm_actors
    from megatrain_ray.driver.runtime import start_ray

    if not ray.is_initialized():
        _shared_ray["started"] |= bool(start_ray(RuntimeConfig(dashboard=False, object_store_mb=128)))
    warm_actors.keep_actor_processes(True)
    yield
    warm_actors.keep_actor_processes(False, end_kept=False)


@pytest.fixture(scope="session")
def private_ray_cli_run(tmp_path_factory) -> dict:
    """`megatrain train configs/tiny.yaml` for 5 steps through the private Ray it starts, in a HOME of its own, run
    once for the suite (a private Ray's start is some 15 s on 2 cores; the run some 30 s): test_cli checks the run,
    test_ray_privacy its token, test_quiet_run its warnings. Under `pytest -n N` those modules may run in different
    workers: the first to ask runs it, under a lock in the directory the workers share, and records it; the others
    wait for the lock and read the record. Returns {"result": the CompletedProcess, "pid": the driver's, "home",
    "out", "modes": every mode ~/.ray/auth_token was seen with, watched from before the run starts}."""
    import fcntl
    import subprocess
    import tempfile

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: popen-gw<N> under one root
    record = shared / "private-ray-cli-run.json"
    with open(shared / "private-ray-cli-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.is_file():
            run = _private_ray_cli_run(Path(tempfile.mkdtemp(prefix="private-ray-", dir=shared)))
            part = record.with_suffix(".part")
            part.write_text(json.dumps(run))
            part.rename(record)
    run = json.loads(record.read_text())
    result = subprocess.CompletedProcess(run["args"], run["returncode"], run["stdout"], run["stderr"])
    return {"result": result, "pid": run["pid"], "home": Path(run["home"]), "out": Path(run["out"]),
            "modes": set(run["modes"])}


def _private_ray_cli_run(root: Path) -> dict:
    """The run of private_ray_cli_run in `root`, as JSON-ready values."""
    import stat
    import subprocess
    import sys
    import threading
    import time

    home = root / "home"
    home.mkdir()
    out, token = root / "run", home / ".ray" / "auth_token"
    modes: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        # Tight until the file first exists (its creation is where a mode set afterwards would be seen), then
        # every millisecond (a spinning thread would take one of the run's 2 cores for its whole length).
        while not done.is_set():
            try:
                modes.add(stat.S_IMODE(os.stat(token).st_mode))
                time.sleep(0.001)
            except FileNotFoundError:
                pass

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(HOME=str(home), PYTHONPATH=REPO)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with subprocess.Popen([sys.executable, "-m", "megatrain_ray", "train", "configs/tiny.yaml", "--set",
                               f"train.output_dir={out}", "--set", "train.steps=5"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
            stdout, stderr = child.communicate(timeout=300)
    finally:
        done.set()
        watcher.join()
    return {"args": child.args, "returncode": child.returncode, "stdout": stdout, "stderr": stderr,
            "pid": child.pid, "home": str(home), "out": str(out), "modes": sorted(modes)}


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


# Modules that shut the suite's shared Ray down to start one of their own: run last, so the shared one starts once
# (test_data_parallel's two-node cluster comes after its tests on the shared one).
OWN_RAY_MODULES = ("test_data_parallel.py", "test_placement.py", "test_runtime.py")


# Under `pytest -n 2 --dist loadfile` a module runs whole on one worker, so the longest must not start last (one
# worker would run it alone at the end): the modules of 15 s and more, longest first, as measured serially on 2 cores
# (benchmarks/results/test-suite-vm-20261202-054032.json; test_vision_parity has grown since). The others follow.
LONGEST_MODULES = (
    "test_smollm2_finetune.py", "test_moe_parity.py", "test_lora_parity.py", "test_moe_compile.py",
    "test_training_parity.py", "test_generic_template.py", "test_data_parallel.py", "test_smollm2_grpo.py",
    "test_dpo.py", "test_gemma_parity.py", "test_vision_parity.py", "test_lora_moe_parity.py",
    "test_generic_moe.py", "test_prepare_fast_chat.py", "test_cli.py", "test_bench_peft_compile.py",
    "test_faults.py", "test_checkpoint.py", "test_crash_hygiene.py", "test_lora_resident.py",
    "test_gpu_resident.py", "test_tracking.py", "test_placement.py", "test_nf4.py", "test_qlora.py",
    "test_ray_privacy.py", "test_example_finetune.py", "test_head_chunk.py", "test_hybrid_parity.py",
    "test_phi3_parity.py",
)


def pytest_configure(config):
    # xdist's loadfile queues the modules by their number of tests (many quick unit tests first, the long one-test
    # modules last) unless told not to; the order of the collection below is the one wanted.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _module_rank(item) -> tuple[int, int]:
    name = item.path.name
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has a shared Ray of its own: time alone decides
        return (LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES), 0)
    return (0, name in OWN_RAY_MODULES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: a module's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def prepared_data(root: Path, vocab: int = 96) -> Path:
    """A prepared directory (what `megatrain prepare` writes) of random tokens with a train and an eval split
    (for eval_loss); an existing one is reused."""
    if (root / "manifest.json").exists():
        return root
    root.mkdir(parents=True)
    rng = random.Random(0)
    for split, rows in (("train", 64), ("eval", 8)):
        ids = [[rng.randrange(vocab) for _ in range(32)] for _ in range(rows)]
        pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                                 "loss_mask": pa.array([[1] * 32] * rows, type=pa.list_(pa.int8()))}),
                       root / f"{split}-00000.parquet")
    (root / "manifest.json").write_text(json.dumps({"splits": {s: {"files": [f"{s}-00000.parquet"]}
                                                               for s in ("train", "eval")}}))
    return root


def train_from_hf_weights(cfg, model):
    """`cfg.train.steps` steps of a Trainer that starts from transformers `model`'s weights; returns (the initial
    weights, the batches, the step records, the final weights) for a parity test to replay in transformers."""
    from megatrain_ray.driver.trainer import Trainer

    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        initial = trainer.master_weights()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        records = [trainer.step(s) for s in range(cfg.train.steps)]
        return initial, batches, records, trainer.master_weights()


def interrupted_and_resumed(cfg, stop_after: int, every: int, read):
    """Run `cfg` for `stop_after` steps with a checkpoint every `every` steps, as a run cut short; then resume
    from its last checkpoint (resume="auto") and train to the end. Returns (the step it resumed at,
    read(trainer) at the end)."""
    from megatrain_ray.driver.trainer import Trainer

    with Trainer(cfg) as trainer:
        for step in range(stop_after):
            trainer.step(step)
            trainer.next_step = step + 1
            if trainer.next_step % every == 0:
                trainer.save(wait=True)
    with Trainer(cfg, resume="auto") as trainer:
        resumed_at = trainer.next_step
        trainer.train()
        return resumed_at, read(trainer)


def streamed_logits(tmp_path, model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatrain's layer stream loaded with a Hugging Face model's weights (config from its config.json, float32)
    on a fixed batch of 2 x 33 tokens, and the model's own logits in float32 and in float64 (a float64 copy of it):
    (ours, theirs32, theirs64), for tests.numerics.assert_within_noise."""
    import copy
    import dataclasses

    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.driver.trainer import Trainer

    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg))
    ids = torch.randint(0, mcfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    with Trainer(cfg) as trainer:
        state = model.state_dict()
        trainer.load_weights({k: v for k, v in state.items() if k in trainer.master_weights()})
        ours = trainer.logits(ids)
    with torch.no_grad(), one_thread():
        return ours, model(ids).logits, copy.deepcopy(model).to(torch.float64)(ids).logits
