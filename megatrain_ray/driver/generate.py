"""`megatrain generate` (a file of prompts, a jsonl line of completion per prompt) and `megatrain chat` (a
conversation on stdin and stdout), both through a forward-only session (session.py) and its rollout engine.

Everything that can be wrong with the input (the source, the tokenizer, the prompts file, a prompt too long for the
model, the output file) is found before the model loads."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from megatrain_ray.data.generation_prompts import GenerationPrompt, read_generation_prompts
from megatrain_ray.data.prepare.tokenize import load_tokenizer
from megatrain_ray.driver.grpo import stop_token_ids
from megatrain_ray.driver.session import GenerationSession, SessionSource, resolve_source
from megatrain_ray.engine.rollout.interface import RolloutResult, SamplingSettings
from megatrain_ray.exceptions import ConfigError, DataError
from megatrain_ray.observe.log import get_logger

log = get_logger(__name__)
EXIT, RESET = "/exit", "/reset"


@dataclass(slots=True)
class GenerationOptions:
    """The command line of `megatrain generate` / `megatrain chat` (their defaults: megatrain_ray/__main__.py)."""

    source: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    device: str = "auto"
    sets: list[str] | None = None
    """--set KEY=VALUE overrides of the session's config."""
    tokenizer: str | None = None
    prompts: str = ""
    out: str | None = None
    batch_size: int = 8
    system: str | None = None


@dataclass(slots=True)
class GenerationSetup:
    """The model, its tokenizer and how it samples: what both commands set up before generating."""

    source: SessionSource
    tokenizer: Any
    sampling: SamplingSettings

    @classmethod
    def open(cls, options: GenerationOptions) -> "GenerationSetup":
        if options.batch_size < 1:
            raise ConfigError(f"--batch-size {options.batch_size}: must be >= 1")
        source = resolve_source(options.source, options.device, options.sets, options.tokenizer)
        tokenizer = load_tokenizer(source.tokenizer_dir)
        stops = stop_token_ids(tokenizer, source.cfg.model.path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
        try:
            sampling = SamplingSettings(max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                                        top_p=options.top_p, top_k=options.top_k, stop_token_ids=tuple(stops),
                                        pad_token_id=int(pad), seed=options.seed)
        except ValueError as exc:  # its messages name the setting: --max-new-tokens and the like
            raise ConfigError(f"--{str(exc).replace('_', '-')}") from None
        return cls(source, tokenizer, sampling)

    def room_for(self, prompt_tokens: int) -> str | None:
        """Why a prompt of this length cannot be continued by --max-new-tokens tokens (None: it can)."""
        limit, new = self.source.cfg.model.max_position_embeddings, self.sampling.max_new_tokens
        if prompt_tokens + new <= limit:
            return None
        return (f"the prompt's {prompt_tokens} tokens plus --max-new-tokens {new} exceed the model's "
                f"max_position_embeddings={limit}")

    def completion(self, result: RolloutResult, row: int) -> dict[str, Any]:
        ids = result.tokens[row, :int(result.lengths[row])].tolist()
        return {"completion": self.tokenizer.decode(ids, skip_special_tokens=True), "completion_ids": ids,
                "completion_tokens": len(ids), "finish_reason": "stop" if bool(result.stopped[row]) else "length"}


def generate_file(options: GenerationOptions) -> int:
    """`megatrain generate`: every prompt of --prompts, --batch-size at a time, a line each to --out (or stdout) in
    the file's order: the line's fields, then completion, completion_ids, completion_tokens, finish_reason."""
    setup = GenerationSetup.open(options)
    prompts = read_generation_prompts(options.prompts, setup.tokenizer)
    for prompt in prompts:
        if (problem := setup.room_for(len(prompt.ids))) is not None:
            raise DataError(f"{options.prompts}:{prompt.line}: {problem}")
    out_path = Path(options.out) if options.out else None
    if out_path is not None:
        if out_path.exists():
            raise ConfigError(f"--out {str(out_path)!r} already exists; remove it or choose another file")
        if not out_path.parent.is_dir():
            raise ConfigError(f"--out {str(out_path)!r}: the directory {str(out_path.parent)!r} does not exist")
    batches = [prompts[i:i + options.batch_size] for i in range(0, len(prompts), options.batch_size)]
    with GenerationSession(setup.source) as session:
        out = out_path.open("x", encoding="utf-8") if out_path is not None else sys.stdout
        try:
            done = _generate_batches(session, setup, batches, out)
        finally:
            if out_path is not None:
                out.close()
    where = f" in {out_path}" if out_path else ""
    if done < len(prompts):
        log.warning("interrupted: %d of %d completions%s", done, len(prompts), where)
        return 130
    log.info("%d completions%s", len(prompts), where)
    return 0


def _generate_batches(session: GenerationSession, setup: GenerationSetup, batches: list[list[GenerationPrompt]],
                      out: TextIO) -> int:
    """Each batch's lines written as soon as it is done (an interrupted file keeps what finished); a line per
    batch to the log. Returns the completions written (fewer than the prompts after Ctrl-C)."""
    t0, done = time.perf_counter(), 0
    for k, batch in enumerate(batches):
        try:
            # each batch its own seed: a batch's samples do not depend on which batches came before it
            result = session.generate([p.ids for p in batch], replace(setup.sampling, seed=setup.sampling.seed + k))
        except KeyboardInterrupt:
            return done
        done += len(batch)
        for row, prompt in enumerate(batch):
            out.write(json.dumps({**prompt.record, **setup.completion(result, row)}, ensure_ascii=False) + "\n")
        out.flush()
        log.info("batch %d/%d: %d prompts, %d new tokens, %.1f tok/s (%.0f s in all)", k + 1, len(batches),
                 len(batch), int(result.lengths.sum()), result.stats["tokens_per_s"], time.perf_counter() - t0)
    return done


def chat(options: GenerationOptions, lines: TextIO | None = None, out: TextIO | None = None) -> int:
    """`megatrain chat`: each line of `lines` (stdin) a user turn; the whole conversation goes through the chat
    template each turn and the reply is printed to `out` (stdout). /reset forgets the conversation (the --system
    prompt stays); /exit or the end of the input leaves; Ctrl-C too (exit code 130)."""
    lines, out = lines or sys.stdin, out or sys.stdout
    setup = GenerationSetup.open(options)
    if setup.tokenizer.chat_template is None:
        raise ConfigError(f"the tokenizer in {setup.source.tokenizer_dir} has no chat template; `megatrain "
                          "generate` with text prompts needs none")
    opening = [{"role": "system", "content": options.system}] if options.system else []
    with GenerationSession(setup.source) as session:
        try:
            _converse(session, setup, opening, lines, out)
        except KeyboardInterrupt:
            out.write("\n")
            return 130
    return 0


def _read_turn(lines: TextIO, out: TextIO, interactive: bool) -> str | None:
    """The next line (None at the end of the input); at a terminal through input(), which edits the line."""
    if interactive and lines is sys.stdin and out is sys.stdout:
        try:
            return input("> ") + "\n"
        except EOFError:
            out.write("\n")
            return None
    return lines.readline() or None


def _converse(session: GenerationSession, setup: GenerationSetup, opening: list[dict[str, str]], lines: TextIO,
              out: TextIO) -> None:
    interactive = lines.isatty()
    if interactive:
        out.write(f"chatting with {setup.source.what}; {RESET} starts again, {EXIT} or Ctrl-D leaves\n")
    conversation, turn = list(opening), 0
    while (line := _read_turn(lines, out, interactive)) is not None and line.strip() != EXIT:
        if line.strip() == RESET:
            conversation = list(opening)
            log.info("conversation reset")
            continue
        if not line.strip():
            continue
        asked = [*conversation, {"role": "user", "content": line.rstrip("\n")}]
        try:
            ids = list(setup.tokenizer.apply_chat_template(asked, tokenize=True, return_dict=True,
                                                           add_generation_prompt=True)["input_ids"])
        except Exception as exc:  # the template's own raise_exception (e.g. no system role), or a field it lacks
            raise ConfigError(f"the chat template cannot render the conversation: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None
        if (problem := setup.room_for(len(ids))) is not None:
            log.error("%s: %s to start again (or a lower --max-new-tokens)", problem, RESET)
            continue
        # each turn its own seed: the same conversation replays the same replies
        result = session.generate([ids], replace(setup.sampling, seed=setup.sampling.seed + turn))
        reply = setup.completion(result, 0)
        out.write(reply["completion"] + "\n")
        out.flush()
        if reply["finish_reason"] == "length":
            log.warning("the reply stopped at --max-new-tokens %d", setup.sampling.max_new_tokens)
        conversation = [*asked, {"role": "assistant", "content": reply["completion"]}]
        turn += 1
