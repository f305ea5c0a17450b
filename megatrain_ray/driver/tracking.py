"""Experiment tracking (train.report_to): TensorBoard, MLflow and Weights & Biases get the metrics.jsonl records.

MetricsWriter hands every per-step record to `Tracking.record_step`, the same record metrics.jsonl gets, so
the trackers show exactly its numbers: every numeric field (loss, lr, grad_norm, tok_per_s, eval_loss where an
evaluation ran, ...) at the record's step. The config goes once, as hyperparameters / params / W&B config.

Each backend is a small adapter that imports its package only when it is used (the `track` extra:
`pip install 'megatrain-ray[track]'`); `check_available` refuses a missing one before a run starts. Where
the data goes is the tools' own business, set by their environment variables: MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME (default megatrain), WANDB_PROJECT (default megatrain), WANDB_ENTITY, WANDB_MODE,
WANDB_DIR (default the run directory). TensorBoard writes <run dir>/tensorboard/.

Resume: `state()` (the TensorBoard directory, the MLflow run id, the W&B run id) goes into each checkpoint
manifest, and a run resumed from that checkpoint continues the same tracked runs. Steps after the checkpoint
that an earlier attempt had already logged are run again: TensorBoard replaces them (purge_step: its reader
drops the earlier events from that step on); MLflow and W&B keep the values they already hold for those steps
(neither can delete logged values; W&B itself refuses steps below its current one) and get the steps after them.
With this trainer's bit-identical resume only the timings of those steps differ from metrics.jsonl.

A tracker that fails while the run goes on (a server gone) is logged once and dropped: it never stops training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from megatrain_ray.config.loop_sections import TRACKERS
from megatrain_ray.config.sections import Config
from megatrain_ray.exceptions import ConfigError, MegatrainError
from megatrain_ray.extras import install_hint
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)

# The packages each tracker imports (all in the `track` extra).
PACKAGES = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow",), "wandb": ("wandb",)}
EXTRA = install_hint("track")
DEFAULT_PROJECT = "megatrain"


def check_available(report_to: list[str]) -> None:
    """Refuse a tracker name this version does not know, or one whose package is not installed."""
    for name in report_to:
        if name not in TRACKERS:
            raise ConfigError(f"config key 'train.report_to' = {name!r}: unknown tracker; expected a list of "
                              f"{', '.join(TRACKERS)}")
        missing = [p for p in PACKAGES[name] if importlib.util.find_spec(p) is None]
        if missing:
            raise ConfigError(f"config key 'train.report_to' names {name!r}, but the {missing[0]} package is not "
                              f"installed: {EXTRA} (or drop {name!r} from train.report_to)")


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The fields a tracker plots: every number of the record but the step (booleans and lists left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(cfg: Config) -> dict[str, Any]:
    """`section.key` -> value, nested sections joined with dots."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value
    walk("", cfg.to_dict())
    return out


def _scalar(value: Any) -> int | float | str | bool:
    return value if isinstance(value, (int, float, str, bool)) else json.dumps(value)


class Backend:
    """One tracker. `replaces_steps`: logging a step again replaces the earlier value (else those steps are
    skipped: `skip_through`)."""

    name = ""
    replaces_steps = False

    def __init__(self) -> None:
        self.skip_through = -1

    def log_step(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a resume needs to continue this tracked run (stored in the checkpoint manifest)."""
        return {}

    def rewind(self, next_step: int) -> None:
        """Steps from `next_step` on are run again (after an in-process restart from a checkpoint)."""

    def close(self, status: str) -> None:
        """`status`: finished, failed or killed."""


class TensorBoardBackend(Backend):
    name = "tensorboard"
    replaces_steps = True

    def __init__(self, cfg: Config, log_dir: Path, resume: dict | None, purge_step: int | None):
        super().__init__()
        self.log_dir = Path(resume["log_dir"]) if resume and resume.get("log_dir") else log_dir
        self.writer = self._open(purge_step)
        if resume is None:
            self._hparams(cfg)

    def _open(self, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.log_dir), purge_step=purge_step, flush_secs=30)

    def _hparams(self, cfg: Config) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = flat_config(cfg)
        exp, ssi, sei = hparams({k: _scalar(v) for k, v in flat.items()}, {"loss": 0.0, "eval_loss": 0.0})
        writer = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            writer.add_summary(summary)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flat.items()), 0)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def state(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def rewind(self, next_step: int) -> None:
        self.writer.close()
        self.writer = self._open(next_step)

    def close(self, status: str) -> None:
        self.writer.close()


class MLflowBackend(Backend):
    name = "mlflow"
    _MAX_PARAMS = 100  # per log_batch call

    def __init__(self, cfg: Config, run_name: str, run_dir: Path, resume: dict | None):
        super().__init__()
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        self.run_id = ""
        if resume and resume.get("run_id"):
            try:
                self.client.update_run(resume["run_id"], status="RUNNING")
                self.run_id = resume["run_id"]
            except MlflowException as exc:
                log.warning("MLflow run %s is not in the tracking store %s (%s): starting a new run",
                            resume["run_id"], self.client.tracking_uri, str(exc).splitlines()[0])
        if not self.run_id:
            run = self.client.create_run(self._experiment_id(), run_name=run_name,
                                         tags={"megatrain.run_dir": str(run_dir)})
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), self._MAX_PARAMS):
                self.client.log_batch(self.run_id, params=params[i:i + self._MAX_PARAMS])
        log.info("MLflow run %s in %s", self.run_id, self.client.tracking_uri)

    def _experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "killed": "KILLED"}.get(status, "FAILED"))


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, cfg: Config, run_name: str, run_dir: Path, resume: dict | None):
        super().__init__()
        import wandb

        resume = resume or {}
        directory = os.environ.get("WANDB_DIR") or str(run_dir)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=resume.get("project") or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                              entity=resume.get("entity") or None, id=resume.get("run_id") or None,
                              resume="allow" if resume.get("run_id") else None, name=run_name, dir=directory)
        self.run.config.update(cfg.to_dict(), allow_val_change=True)
        log.info("W&B run %s (project %s)", self.run.id, self.run.project)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run.id, "project": self.run.project, "entity": self.run.entity or ""}

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class Tracking:
    """The trackers of a run; `record_step` gets each metrics.jsonl record (as MetricsWriter's exporter).

    `resume`: the `tracking` entry of the checkpoint manifest the run resumes from (None: new tracked runs);
    `start_step`: the step a resumed run starts at (None: a run from scratch); `logged_through`: the last step
    an earlier attempt of the run logged."""

    def __init__(self, cfg: Config, run_dir: Path, resume: dict | None = None, start_step: int | None = None,
                 logged_through: int = -1):
        self.backends: list[Backend] = []
        self.last_step = logged_through
        run_name = cfg.train.run_name or run_dir.name
        resume = resume or {}
        for name in cfg.train.report_to:
            own = resume.get(name)
            backend: Backend
            try:
                if name == "tensorboard":
                    backend = TensorBoardBackend(cfg, run_dir / "tensorboard", own, start_step)
                elif name == "mlflow":
                    backend = MLflowBackend(cfg, run_name, run_dir, own)
                else:
                    backend = WandbBackend(cfg, run_name, run_dir, own)
            except BaseException as exc:
                self.close("failed")
                if isinstance(exc, Exception):
                    raise MegatrainError(f"experiment tracking (train.report_to): {name} could not start a run: "
                                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
                raise
            if own and not backend.replaces_steps:
                backend.skip_through = logged_through
            self.backends.append(backend)
            log.info("experiment tracking: %s %s %s", name, "continues" if own else "logs to",
                     ", ".join(f"{k}={v}" for k, v in backend.state().items() if v))

    def record_step(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        values = numeric_fields(record)
        for backend in list(self.backends):
            if step <= backend.skip_through:
                continue
            try:
                backend.log_step(step, values)
            except Exception as exc:  # noqa: BLE001 (a tracker never stops training)
                log.warning("experiment tracking: %s failed at step %d and is dropped for this run: %s",
                            backend.name, step, exc)
                self.backends.remove(backend)
                self._close_one(backend, "failed")
        self.last_step = max(self.last_step, step)

    def state(self) -> dict[str, dict[str, Any]]:
        """Each tracker's ids, for the checkpoint manifest."""
        return {b.name: b.state() for b in self.backends}

    def rewind(self, next_step: int) -> None:
        """The run goes back to a checkpoint's `next_step` in this process (an automatic restart)."""
        for backend in self.backends:
            if backend.replaces_steps:
                backend.rewind(next_step)
            else:
                backend.skip_through = max(backend.skip_through, self.last_step)

    def close(self, status: str) -> None:
        backends, self.backends = self.backends, []
        for backend in backends:
            self._close_one(backend, status)

    @staticmethod
    def _close_one(backend: Backend, status: str) -> None:
        try:
            backend.close(status)
        except Exception as exc:  # noqa: BLE001
            log.warning("experiment tracking: closing %s failed: %s", backend.name, exc)


def last_logged_step(metrics_path: Path) -> int:
    """The highest step metrics.jsonl holds (-1: none): what an earlier attempt of the run logged."""
    last = -1
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            if line.strip():
                try:
                    step = json.loads(line).get("step", -1)
                except ValueError:
                    continue
                if isinstance(step, int):
                    last = max(last, step)
    return last
