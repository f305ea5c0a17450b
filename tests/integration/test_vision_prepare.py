"""`megatrain prepare` with images (data/prepare/vision_docs.py, image_records.py) and training on its shards
(data/image_store.py), against transformers' own processor and model.

A tiny random LLaVA (Llama + CLIP, 16x16 images in 4x4 patches: 16 image tokens each) saved with save_pretrained,
its processor (LlavaProcessor with the PIL CLIP image processor, no torchvision) saved beside it, a byte-level BPE
tokenizer with a chat template that reads both text and content-part turns and marks the assistant's part with
{% generation %}. Records: OpenAI-style messages with image parts (a file beside the jsonl, a data: URL), two
images in one turn, and a text-only conversation, in small PNGs of different sizes made here.

- Each prepared document is transformers' `processor.apply_chat_template(..., return_assistant_tokens_mask=True)`:
  the same tokens, the loss mask its assistant mask (image tokens never in it) and the pixel values bit for bit.
- The same for a tiny Gemma 3 and its processor (blank lines around each image's tokens).
- Two worker processes (each loading the processor) write the same shards byte for byte.
- The ShareGPT / LLaMA-Factory layout (`<image>` placeholders, an `images` column) and a parquet file whose images
  are bytes give the same documents.
- Bad images stop the run with one error naming the record: a corrupt file, an empty one, more image tokens than
  --seq-len, a URL; --max-pixels on a processor without that cap is refused.
- `megatrain train` on the prepared directory (float64, the tower frozen; LLaVA and Gemma 3): its first step's loss
  equals the transformers model's float64 loss on the same records (all in one batch) within 1e-10, and it falls.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.numpy import load as load_tensors  # noqa: E402

from megatrain_ray.__main__ import main  # noqa: E402
from megatrain_ray.data.prepare import PrepareOptions, prepare  # noqa: E402
from megatrain_ray.exceptions import DataError  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.numerics import assert_exact  # noqa: E402
from tests.reference_vision import exact  # noqa: E402

sys.path.insert(0, str(Path(REPO) / "examples" / "finetune_qwen2"))
from make_tiny_qwen2 import alpaca_texts, build_tokenizer  # noqa: E402

TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['content'] is string -%}{%- set parts = [{'type': 'text', 'text': m['content']}] -%}"
    "{%- else -%}{%- set parts = m['content'] -%}{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}{% generation %}{%- for p in parts -%}{{- p['text'] -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{%- for p in parts -%}{%- if p['type'] == 'image' -%}{{- '<image>' -}}{%- else -%}{{- p['text'] -}}"
    "{%- endif -%}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
SIZES = {"red.png": (20, 28), "small.png": (12, 12), "wide.png": (16, 40)}
QA = [("what is in the picture", "a red square"), ("compare these two", "the left one is smaller"),
      ("describe it briefly", "a wide picture"), ("add two and three", "five")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llava") / "hf"
    tok = build_tokenizer(alpaca_texts())
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TEMPLATE
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=TEMPLATE)
    text = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 multimodal model and its processor (SigLIP's PIL image processor, 4 image tokens an image,
    which the processor writes as a blank line, <start_of_image>, the image's tokens, <end_of_image>, a blank line)."""
    out = tmp_path_factory.mktemp("gemma3") / "hf"
    template = TEMPLATE.replace("'<image>'", "'<start_of_image>'")
    backend = build_tokenizer(alpaca_texts())
    backend.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                              "<image_soft_token>"]})
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=template, extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                      "image_token": "<image_soft_token>"})
    images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4,
                                             chat_template=template)
    text = transformers.Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, sliding_window=6, max_position_embeddings=256,
                                         layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=16, patch_size=4,
                                             vision_use_head=False)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in
           (("boi", "<start_of_image>"), ("eoi", "<end_of_image>"), ("image", "<image_soft_token>"))}
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=ids["image"],
        boi_token_index=ids["boi"], eoi_token_index=ids["eoi"]))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for name, (h, w) in SIZES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out / name)
    return out


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def conversations(data_dir: Path, for_prepare: bool) -> list[list[dict]]:
    """The records' messages: as the jsonl holds them (relative paths, a data: URL), or as transformers' processor
    reads them (absolute paths)."""
    def image(name: str, url: bool = False) -> dict:
        if not for_prepare:
            return {"type": "image", "path": str(data_dir / name)}
        return {"type": "image_url", "image_url": {"url": data_url(data_dir / name)}} if url else \
            {"type": "image", "image": name}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}
    user = [[image("red.png"), text(QA[0][0])], [image("small.png"), image("wide.png", url=True), text(QA[1][0])],
            [text(QA[2][0] + " "), image("wide.png")], QA[3][0]]
    return [[{"role": "user", "content": u}, {"role": "assistant", "content": a}] for u, (_, a) in zip(user, QA)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_prepare(model_dir: Path, inputs: list[Path], out: Path, fmt: str = "messages", **options) -> dict:
    options = {"workers": 1, **options}
    return prepare(PrepareOptions(tokenizer_dir=str(model_dir), format=fmt, inputs=[str(p) for p in inputs],
                                  output_dir=str(out), **options))


def prepared_documents(directory: Path) -> list[tuple]:
    """(ids, mask, pixel values bytes) of every document, sorted."""
    table = pa.concat_tables([pq.read_table(directory / f) for f in
                              json.loads((directory / "manifest.json").read_text())["splits"]["train"]["files"]])
    docs = []
    for ids, mask, blob in zip(*(table.column(c).to_pylist() for c in ("input_ids", "loss_mask", "images"))):
        pixels = load_tensors(blob)["pixel_values"].tobytes() if blob is not None else b""
        docs.append((tuple(ids), tuple(mask), pixels))
    return sorted(docs)


def reference_documents(model_dir: Path, data_dir: Path) -> list[tuple]:
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    docs = []
    for messages in conversations(data_dir, for_prepare=False):
        out = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, return_tensors="np")
        pixels = out["pixel_values"].astype(np.float32).tobytes() if "pixel_values" in out else b""
        docs.append((tuple(out["input_ids"][0].tolist()), tuple(out["assistant_masks"][0].tolist()), pixels))
    return sorted(docs)


@pytest.fixture(scope="module")
def prepared(model_dir, data_dir, tmp_path_factory) -> Path:
    records = [{"messages": m} for m in conversations(data_dir, for_prepare=True)]
    out = tmp_path_factory.mktemp("prepared") / "out"
    manifest = run_prepare(model_dir, [write_jsonl(data_dir / "chat.jsonl", records)], out)
    assert manifest["images"]["image_token_id"] == 384 and manifest["splits"]["train"]["documents_with_images"] == 3
    return out


def test_documents_are_the_processors_own(prepared, model_dir, data_dir):
    ours, theirs = prepared_documents(prepared), reference_documents(model_dir, data_dir)
    assert ours == theirs
    image_rows = [d for d in ours if d[2]]
    assert len(image_rows) == 3 and sum(d[0].count(384) for d in ours) == 4 * 16
    for ids, mask, _ in ours:  # image tokens never in the loss
        assert not any(m for t, m in zip(ids, mask) if t == 384) and any(mask)


def test_gemma3_documents_are_its_processors_own(gemma3_dir, data_dir, tmp_path):
    """Gemma 3's processor writes blank lines around an image's tokens: the text's tokens still match in order."""
    records = [{"messages": m} for m in conversations(data_dir, for_prepare=True)]
    run_prepare(gemma3_dir, [write_jsonl(data_dir / "chat.jsonl", records)], tmp_path / "out")
    ours, theirs = prepared_documents(tmp_path / "out"), reference_documents(gemma3_dir, data_dir)
    assert ours == theirs
    image = json.loads((gemma3_dir / "config.json").read_text())["image_token_index"]
    assert sum(d[0].count(image) for d in ours) == 4 * 4
    assert all(not any(m for t, m in zip(ids, mask) if t == image) for ids, mask, _ in ours)


def test_sharegpt_placeholders_and_parquet_bytes_give_the_same_documents(prepared, model_dir, data_dir, tmp_path):
    records = []
    for messages in conversations(data_dir, for_prepare=False):
        user = messages[0]["content"]
        parts = user if isinstance(user, list) else [{"type": "text", "text": user}]
        value = "".join("<image>" if p["type"] == "image" else p["text"] for p in parts)
        files = [Path(p["path"]).name for p in parts if p["type"] == "image"]
        records.append({"conversations": [{"from": "human", "value": value},
                                          {"from": "gpt", "value": messages[1]["content"]}], "images": files})
    sharegpt = run_prepare(model_dir, [write_jsonl(data_dir / "sharegpt.jsonl", records)], tmp_path / "sharegpt",
                           fmt="sharegpt")
    assert sharegpt["splits"]["train"]["documents"] == 4
    for r in records:  # the images as bytes, as the datasets library keeps an Image column in parquet
        r["images"] = [{"bytes": (data_dir / f).read_bytes(), "path": None} for f in r["images"]]
    pq.write_table(pa.Table.from_pylist(records), data_dir / "sharegpt.parquet")
    run_prepare(model_dir, [data_dir / "sharegpt.parquet"], tmp_path / "parquet", fmt="sharegpt")
    expected = prepared_documents(prepared)
    assert prepared_documents(tmp_path / "sharegpt") == expected
    assert prepared_documents(tmp_path / "parquet") == expected


def test_worker_processes_write_the_same_shards(prepared, model_dir, data_dir, tmp_path, monkeypatch):
    """Two tokenizing processes, each loading the processor, one record a chunk: the shards byte for byte."""
    from megatrain_ray.data.prepare import pipeline

    monkeypatch.setattr(pipeline, "CHUNK_RECORDS", 1)
    records = [{"messages": m} for m in conversations(data_dir, for_prepare=True)]
    run_prepare(model_dir, [write_jsonl(data_dir / "chat.jsonl", records)], tmp_path / "workers", workers=2)
    shards = sorted(p.name for p in prepared.glob("*.parquet"))
    assert shards == sorted(p.name for p in (tmp_path / "workers").glob("*.parquet"))
    assert all((prepared / n).read_bytes() == (tmp_path / "workers" / n).read_bytes() for n in shards)


@pytest.mark.parametrize("case, message", [
    ("corrupt", r"record 1, image 0: image .*corrupt.png' is not a readable image"),
    ("empty", r"record 1, image 0: image .*empty.png' is empty \(0 bytes\)"),
    ("url", r"record 1, image 0: image 'https://example.com/a.png' is a URL"),
    ("context", r"record 0: its 1 image\(s\) take 16 tokens, ending at token 20, past --seq-len 12"),
])
def test_a_bad_image_stops_the_run_naming_the_record(model_dir, data_dir, tmp_path, case, message):
    (data_dir / "corrupt.png").write_bytes((data_dir / "red.png").read_bytes()[:40])
    (data_dir / "empty.png").write_bytes(b"")
    bad = {"corrupt": "corrupt.png", "empty": "empty.png", "url": "https://example.com/a.png"}.get(case, "red.png")
    records = [{"messages": m} for m in conversations(data_dir, for_prepare=True)[:2]]
    records[1]["messages"][0]["content"][0] = {"type": "image", "image": bad}
    path = write_jsonl(data_dir / f"bad-{case}.jsonl", records)  # its images beside it
    with pytest.raises(DataError, match=message):
        run_prepare(model_dir, [path], tmp_path / "out", on_bad_record="skip", seq_len=12 if case == "context" else 0)
    assert not (tmp_path / "out").exists()


def test_pixel_caps_are_refused_where_the_processor_has_none(model_dir, prepared, tmp_path, capsys):
    source = json.loads((prepared / "manifest.json").read_text())["inputs"][0]
    with pytest.raises(DataError, match=r"--max-pixels: the image processor .* \(CLIPImageProcessorPil\) has no "
                                        "max_pixels"):
        run_prepare(model_dir, [Path(source)], tmp_path / "out", max_pixels=256)
    # The command line's flag reaches it: one error line, nothing written.
    assert main(["prepare", "--tokenizer", str(model_dir), "--format", "messages", "--input", source, "--output",
                 str(tmp_path / "cli"), "--workers", "1", "--min-pixels", "64"]) != 0
    err = capsys.readouterr().err
    assert "--min-pixels: the image processor" in err and not (tmp_path / "cli").exists(), err


def test_images_for_a_text_model_or_packed_are_refused(prepared, model_dir):
    from megatrain_ray.config.load import load_config
    from megatrain_ray.data.batches import make_batches
    from tests.conftest import tiny_raw

    text = load_config(raw=tiny_raw(model={"vocab_size": 400, "max_position_embeddings": 256},
                                    data={"path": str(prepared), "seq_len": 128, "batch_size": 2}))
    with pytest.raises(DataError, match=r"holds images \(3 documents with them\) but model.path='' is not a "
                                        "vision-language model"):
        make_batches(text.data, text.model)
    raw = tiny_raw(data={"path": str(prepared), "seq_len": 128, "batch_size": 2, "packing": True})
    raw["model"] = {"path": str(model_dir)}
    packed = load_config(raw=raw)
    with pytest.raises(DataError, match="holds images: set data.packing=false"):
        make_batches(packed.data, packed.model)


def reference_first_loss(model_dir: Path, data_dir: Path) -> float:
    """transformers' float64 loss over all the records as one batch (right-padded; image tokens and the prompt
    out of the loss by the processor's assistant mask), the mean over every target token as megatrain's."""
    import torch.nn.functional as F

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = exact(transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval())
    rows = [processor.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                          return_tensors="pt") for m in conversations(data_dir, for_prepare=False)]
    width = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    types = torch.zeros(len(rows), width, dtype=torch.long)  # Gemma 3: its image tokens' bidirectional blocks
    for k, r in enumerate(rows):
        n = r["input_ids"].shape[1]
        ids[k, :n] = r["input_ids"][0]
        labels[k, :n - 1] = torch.where(r["assistant_masks"][0, 1:] == 1, r["input_ids"][0, 1:], -100)
        if "token_type_ids" in r:
            types[k, :n] = r["token_type_ids"][0]
    pixels = torch.cat([r["pixel_values"] for r in rows if "pixel_values" in r]).double()
    extra = {"token_type_ids": types} if "token_type_ids" in rows[0] else {}
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, **extra).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.float64), labels.reshape(-1)).item()


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_megatrain_train_on_prepared_images_matches_transformers(name, request, data_dir, tmp_path):
    if name == "llava":
        prepared, model_dir = request.getfixturevalue("prepared"), request.getfixturevalue("model_dir")
    else:
        model_dir = request.getfixturevalue("gemma3_dir")
        records = [{"messages": m} for m in conversations(data_dir, for_prepare=True)]
        prepared = tmp_path / "prepared"
        run_prepare(model_dir, [write_jsonl(data_dir / "chat.jsonl", records)], prepared)
    longest = json.loads((prepared / "manifest.json").read_text())["splits"]["train"]["max_document_tokens"]
    config = {
        "model": {"path": str(model_dir)},
        "data": {"path": str(prepared), "seq_len": longest - 1, "batch_size": 4, "seed": 1},
        "optimizer": {"lr": 3e-3, "workers": 1, "grad_clip": 1.0, "weight_decay": 0.0},
        "schedule": {"kind": "constant", "warmup_steps": 0},
        "precision": {"master_dtype": "float64", "compute_dtype": "float64"},
        "engine": {"device": "cpu"}, "runtime": {"mode": "local", "dashboard": False},
        "train": {"steps": 6, "log_every": 1, "output_dir": str(tmp_path / "run")},
    }
    (tmp_path / "train.json").write_text(json.dumps(config))
    assert main(["train", str(tmp_path / "train.json"), "--local"]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 6
    reference = reference_first_loss(model_dir, data_dir)
    err = assert_exact("the first step's loss", losses[0], reference)
    print(f"{name}: first loss {losses[0]!r} against transformers' {reference!r} ({err:.1e}); losses {losses}")
    assert losses[-1] < losses[0] - 0.1, losses
