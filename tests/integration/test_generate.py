"""`megatrain generate` and `megatrain chat` (driver/generate.py) against transformers, called in-process through
the CLI's main.

The model is a tiny random Hugging Face Llama saved with save_pretrained, its tokenizer a tiny byte-level BPE with a
ChatML template (examples/finetune_qwen2/make_tiny_qwen2.py), and its generation_config.json names as end-of-turn
token one the greedy decoding reaches, so rows end by stopping and by the length limit. Everything computes in
float64 (--set), where greedy choices are exact: generate's tokens equal transformers' generate(do_sample=False) of
each prompt alone, token for token, for text prompts and for chat messages through the template, in batches of
uneven prompts (left-padded). From a run directory generate decodes with the newest checkpoint's weights
(transformers on those tensors), which greedy-decode differently from the older checkpoint's; from a LoRA run, with
its base and trained adapters (transformers on W + (alpha / r) B A, merged here). Chat renders the whole
conversation (the replies so far included) through the template each turn, and /reset and /exit work. Bad input is
one error naming the file, line or field, before the model loads."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import megatrain_ray.driver.generate as generate_module  # noqa: E402
from megatrain_ray.__main__ import main  # noqa: E402
from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.session import GenerationSession, resolve_source  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.engine.rollout.interface import SamplingSettings  # noqa: E402
from megatrain_ray.store.checkpoint import CheckpointDir, CheckpointWeights  # noqa: E402
from tests.conftest import REPO, learnable_tokens, one_thread, tiny_raw  # noqa: E402

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
from make_tiny_qwen2 import alpaca_texts, build_tokenizer  # noqa: E402

NEW = 10
FLOAT64 = ["--set", "precision.master_dtype=float64", "--set", "precision.compute_dtype=float64"]
PROMPTS = [{"prompt": "Spell the word backwards.\ncat", "id": "text"},
           {"messages": [{"role": "user", "content": "What is the capital of France?"}], "id": "messages"},
           {"prompt": [{"role": "system", "content": "Answer briefly."},
                       {"role": "user", "content": "Add the two numbers.\n2 + 3"}], "id": "chat prompt"}]


def prompt_ids(tok, record: dict) -> list[int]:
    """The prompt as transformers encodes it: text as is, messages through the template with the generation prompt."""
    prompt = record.get("prompt", record.get("messages"))
    if isinstance(prompt, str):
        return tok(prompt).input_ids
    return tok.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]


def greedy(model, ids: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy continuation of one prompt, stopping at its generation_config's eos (kept)."""
    with torch.no_grad(), one_thread():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A random LlamaForCausalLM and tokenizer in a directory; its eos the 4th greedy token of the first prompt."""
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = build_tokenizer(alpaca_texts())
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stop = greedy(model.double(), prompt_ids(tok, PROMPTS[0]))[3]
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    return out


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_generate_equals_transformers_generate_token_for_token(tmp_path, tiny_llama, tok, capsys):
    prompts, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS), tmp_path / "out.jsonl"
    assert main(["generate", str(tiny_llama), "--prompts", str(prompts), "--out", str(out), "--batch-size", "2",
                 "--max-new-tokens", str(NEW), "--device", "cpu", *FLOAT64]) == 0
    assert "batch 1/2" in capsys.readouterr().err  # a progress line per batch
    lines = read_jsonl(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    assert [line["id"] for line in lines] == [p["id"] for p in PROMPTS]  # the file's order, its fields kept
    for line, record in zip(lines, PROMPTS):
        theirs = greedy(model, prompt_ids(tok, record))
        assert line["completion_ids"] == theirs, line["id"]
        assert line["completion"] == tok.decode(theirs, skip_special_tokens=True)
        assert line["completion_tokens"] == len(theirs)
        stopped = theirs[-1] == model.generation_config.eos_token_id
        assert line["finish_reason"] == ("stop" if stopped else "length")
    assert lines[0]["finish_reason"] == "stop"  # the fixture's eos: its 4th greedy token
    assert any(line["finish_reason"] == "length" for line in lines)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path, tiny_llama, tok):
    """--temperature > 0 samples: the same --seed gives the same tokens, another seed others (a random model's
    distribution is near uniform: ten equal draws by chance are out of reach), and --top-k 1 leaves only the
    greedy choice, whatever the temperature."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[1:])

    def ids(name: str, *flags: str) -> list[list[int]]:
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", str(tiny_llama), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
                     str(NEW), "--device", "cpu", *FLOAT64, *flags]) == 0
        return [line["completion_ids"] for line in read_jsonl(out)]

    hot = ("--temperature", "1.5")
    first, again, other = ids("a", *hot, "--seed", "3"), ids("b", *hot, "--seed", "3"), ids("c", *hot, "--seed", "4")
    assert first == again and first != other
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    greedy_rows = [greedy(model, prompt_ids(tok, record)) for record in PROMPTS[1:]]
    assert first != greedy_rows and ids("k1", *hot, "--top-k", "1") == greedy_rows


def test_a_model_is_held_once_in_its_streaming_dtype_without_optimizer_state(tiny_llama, tok):
    """A model directory's session (driver/session.forward_only): float32 weights on the CPU and nothing else (no AdamW
    moments, gradients or optimizer workers); the rollout decodes from its own resident copy of them."""
    with GenerationSession(resolve_source(str(tiny_llama), "cpu")) as session:
        node = session.cluster.nodes[0]
        assert {spec.kind for spec in node.specs} == {"master", "gate"} and node.optimizers == []
        params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).parameters())
        assert sum(spec.nbytes for spec in node.specs if spec.kind == "master") == 4 * params
        result = session.generate([prompt_ids(tok, PROMPTS[0])], SamplingSettings(max_new_tokens=2, temperature=0))
        assert result.stats["weights_resident"] == 1


def run_config(tmp_path: Path, model_dir: Path):
    """Two float64 steps from the tiny Llama at a high learning rate, a checkpoint after each."""
    raw = tiny_raw(precision={"master_dtype": "float64", "compute_dtype": "float64"}, optimizer={"lr": 2e-2},
                   train={"steps": 2, "seed": 7, "log_every": 100, "output_dir": str(tmp_path / "run")},
                   schedule={"warmup_steps": 1}, checkpoint={"every": 1, "keep": 2})
    raw["model"] = {"path": str(model_dir)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 384)
    return load_config(raw=raw)


def test_generate_from_a_run_decodes_with_its_newest_checkpoint(tmp_path, tiny_llama, tok):
    with Trainer(run_config(tmp_path, tiny_llama)) as trainer:
        trainer.train()
    checkpoints = CheckpointDir(tmp_path / "run" / "checkpoints").complete()
    assert [c.step for c in checkpoints] == [1, 2]
    prompts, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2]), tmp_path / "out.jsonl"
    assert main(["generate", str(tmp_path / "run"), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", str(NEW), "--device", "cpu"]) == 0
    ours = [line["completion_ids"] for line in read_jsonl(out)]

    def greedy_rows(checkpoint) -> list[list[int]]:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
        model.load_state_dict(dict(CheckpointWeights(checkpoint)))
        return [greedy(model, prompt_ids(tok, record)) for record in PROMPTS[:2]]

    assert ours == greedy_rows(checkpoints[-1])
    assert ours != greedy_rows(checkpoints[0])  # the step-1 weights decode otherwise: the test tells them apart


def test_generate_from_a_lora_run_decodes_with_the_base_and_its_adapters(tmp_path, tiny_llama, tok):
    """Against transformers on the merged weights, W + (lora_alpha / r) B A, merged here from the trained adapters."""
    cfg = run_config(tmp_path, tiny_llama)
    cfg.finetune.method, cfg.finetune.lora.r, cfg.finetune.lora.lora_alpha = "lora", 4, 8.0
    with Trainer(cfg) as trainer:
        trainer.train()
        adapters = trainer.adapters()
    prompts, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2]), tmp_path / "out.jsonl"
    assert main(["generate", str(tmp_path / "run"), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", str(NEW), "--device", "cpu"]) == 0
    ours = [line["completion_ids"] for line in read_jsonl(out)]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    base = [greedy(model, prompt_ids(tok, record)) for record in PROMPTS[:2]]
    weights = model.state_dict()
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            target = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            b = adapters[name.replace(".lora_A.", ".lora_B.")]
            weights[target] += 8.0 / 4 * (b.double() @ a.double())
    model.load_state_dict(weights)
    assert ours == [greedy(model, prompt_ids(tok, record)) for record in PROMPTS[:2]]
    assert ours != base  # the adapters change the output: the test sees whether they are applied


def test_chat_renders_the_whole_conversation_each_turn(tiny_llama, tok, monkeypatch, capsys):
    sent, replies = [], []
    generate = GenerationSession.generate

    def recorded(self, prompts, sampling):
        result = generate(self, prompts, sampling)
        sent.append(prompts[0])
        replies.append(tok.decode(result.completions()[0], skip_special_tokens=True))
        return result

    monkeypatch.setattr(GenerationSession, "generate", recorded)
    read_end, write_end = os.pipe()  # stdin a pipe, as `printf ... | megatrain chat` gives it
    os.write(write_end, b"Hello there\n\nAnd again?\n/reset\nFresh start\n/exit\nunsent\n")
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        assert main(["chat", str(tiny_llama), "--max-new-tokens", "6", "--device", "cpu", *FLOAT64]) == 0
    assert capsys.readouterr().out == "".join(reply + "\n" for reply in replies)

    def template(*messages: str) -> list[int]:
        roles = ["user", "assistant"] * len(messages)
        return prompt_ids(tok, {"messages": [{"role": r, "content": m} for r, m in zip(roles, messages)]})

    assert sent == [template("Hello there"), template("Hello there", replies[0], "And again?"),
                    template("Fresh start")]  # the blank line skipped, the conversation forgotten at /reset
    assert tok.decode(sent[1]).endswith("<|im_start|>assistant\n") and replies[0] in tok.decode(sent[1])


@pytest.mark.parametrize("end, code", [(EOFError, 0), (KeyboardInterrupt, 130)], ids=["ctrl-d", "ctrl-c"])
def test_chat_at_a_terminal_reads_turns_by_input_and_leaves_on_ctrl_d_or_ctrl_c(tiny_llama, tok, monkeypatch,
                                                                                capsys, end, code):
    """At a terminal (stdin a tty) each turn comes through input() (its line editing, the '> ' prompt) after a
    banner naming the model; Ctrl-D leaves with 0, Ctrl-C with 130. The reply printed is transformers' greedy one
    of the templated turn (--temperature 0: chat samples by default)."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    turns, asked = iter(["Hello there"]), []

    def typed(prompt: str) -> str:
        asked.append(prompt)
        for turn in turns:
            return turn
        raise end

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", typed)
    capsys.readouterr()
    assert main(["chat", str(tiny_llama), "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu",
                 *FLOAT64]) == code
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    ids = prompt_ids(tok, {"messages": [{"role": "user", "content": "Hello there"}]})
    reply = tok.decode(greedy(model, ids, new=6), skip_special_tokens=True)
    assert asked == ["> ", "> "]
    assert capsys.readouterr().out == (f"chatting with model {tiny_llama}; /reset starts again, /exit or Ctrl-D "
                                       f"leaves\n{reply}\n\n")


BAD_LINES = [json.dumps(PROMPTS[0]), "", '{"prompt": "fine"}', '{"prompt": "unclosed', json.dumps(PROMPTS[1])]
"""Line 4 is not JSON (line 2 is blank: skipped, but counted)."""


CASES = {
    "missing run": (lambda tmp, model: [str(tmp / "no-such-run"), "--prompts", str(tmp / "p.jsonl")],
                    "RUN_OR_MODEL='{tmp}/no-such-run' does not exist"),
    "run without a checkpoint": (lambda tmp, model: [str(_empty_run(tmp)), "--prompts", str(tmp / "p.jsonl")],
                                 "has no complete checkpoint"),
    "prompts file missing": (lambda tmp, model: [model, "--prompts", str(tmp / "absent.jsonl")],
                             "--prompts '{tmp}/absent.jsonl' does not exist"),
    "bad JSON line": (lambda tmp, model: [model, "--prompts", str(write_jsonl(tmp / "b.jsonl", BAD_LINES))],
                      "{tmp}/b.jsonl:4 is not valid JSON"),
    "no prompt field": (lambda tmp, model: [model, "--prompts", str(write_jsonl(tmp / "b.jsonl", [
        PROMPTS[0], {"question": "where?"}]))], "{tmp}/b.jsonl:2: needs exactly one of 'prompt'"),
    "bad message": (lambda tmp, model: [model, "--prompts", str(write_jsonl(tmp / "b.jsonl", [
        {"messages": [{"content": "no role"}]}]))], "{tmp}/b.jsonl:1: 'messages' message 0 needs 'role'"),
    "prompt too long": (lambda tmp, model: [model, "--prompts", str(tmp / "p.jsonl"), "--max-new-tokens", "256"],
                        "{tmp}/p.jsonl:1: the prompt's"),
    "output exists": (lambda tmp, model: [model, "--prompts", str(tmp / "p.jsonl"), "--out", str(tmp / "p.jsonl"),
                                                 "--max-new-tokens", "8"],
                      "--out '{tmp}/p.jsonl' already exists"),
    "negative temperature": (lambda tmp, model: [model, "--prompts", str(tmp / "p.jsonl"), "--temperature", "-1"],
                             "--temperature must be >= 0"),
}


def _empty_run(tmp: Path) -> Path:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").write_text("train:\n  steps: 2\n")
    return tmp / "run"


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_naming_it_before_the_model_loads(case, tmp_path, tiny_llama, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(generate_module, "GenerationSession", never)
    write_jsonl(tmp_path / "p.jsonl", PROMPTS[:1])
    args, message = CASES[case]
    capsys.readouterr()
    assert main(["generate", *args(tmp_path, str(tiny_llama))]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
