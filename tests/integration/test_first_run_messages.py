"""What a new user hit on the way in (issue 47): messages that pointed at the wrong line, the wrong key or the
wrong cause. Each case gives the input of the report and checks that the one message names the file, line or
key the user has to change, and the real cause. All of them fail before Ray starts, most while the config loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megatrain_ray.__main__ import main
from megatrain_ray.config.hf import model_config_from_hf
from megatrain_ray.config.load import load_config
from megatrain_ray.data.batches import make_batches
from megatrain_ray.exceptions import CheckpointError, ConfigError, DataError
from megatrain_ray.model.layout import build_layout
from megatrain_ray.store.segments import shard_stages
from megatrain_ray.system.files import check_output_dir
from tests.conftest import REPO, tiny_raw


def run_main(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([line for line in err.splitlines() if " ERROR " in line]) == 1, err
    return code, err


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    """A key without its colon: PyYAML gives up a line below, at `packing: true`; the message gives both places,
    the context first (line 6, where the colon is missing), as PyYAML's marks say."""
    text = "model:\n  family: llama\ndata:\n  path: synthetic\n  seq_len: 16\n  batch_size\n  packing: true\n"
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "bad.yaml")
    message = str(caught.value)
    assert "bad.yaml" in message and "not valid YAML" in message, message
    assert "while scanning a simple key at line 6, column 3 ('batch_size')" in message, message
    assert "could not find expected ':' at line 7, column 3 ('packing: true')" in message, message


def test_a_missing_data_path_is_called_missing(tmp_path):
    """Not 'a token stream' with advice to set data.packing=false (which only leads to a second error)."""
    raw = tiny_raw(data={"path": str(tmp_path / "prepraed"), "packing": True})
    cfg = load_config(raw=raw)
    with pytest.raises(DataError, match=r"data.path='.*prepraed': no such file or directory") as caught:
        make_batches(cfg.data, cfg.model)
    assert "token stream" not in str(caught.value) and "packing" not in str(caught.value)


def moe_config_json(**changes) -> dict:
    hf = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    hf.update(changes)
    return {k: v for k, v in hf.items() if v is not None}


def test_a_config_json_value_is_named_by_its_file_and_key():
    """ModelConfig's own checks of a value read from config.json name config.json's key, not a YAML key."""
    assert model_config_from_hf(moe_config_json(), "m/config.json").num_experts == 4
    with pytest.raises(CheckpointError) as caught:
        model_config_from_hf(moe_config_json(num_experts_per_tok=9), "m/config.json")
    assert str(caught.value).startswith("m/config.json: num_experts_per_tok = 9: must be between 1 and"), caught.value
    assert "config key" not in str(caught.value)
    with pytest.raises(CheckpointError, match=r"^m/config.json: rope_theta = -5.0: must be > 0 \(a value of this file"):
        model_config_from_hf(moe_config_json(rope_theta=-5.0), "m/config.json")


def test_a_missing_expert_count_is_called_missing():
    with pytest.raises(CheckpointError, match=r"m/config.json has no 'num_local_experts' \(nor num_experts\)") as e:
        model_config_from_hf(moe_config_json(num_local_experts=None), "m/config.json")
    assert "n = 0" not in str(e.value)


def test_a_quantization_config_string_is_named_as_such():
    hf = moe_config_json(architectures=["GptOssForCausalLM"], model_type="gpt_oss", quantization_config="mxfp4")
    with pytest.raises(CheckpointError, match=r"quantization_config = 'mxfp4' is a str, not a mapping") as caught:
        model_config_from_hf(hf, "m/config.json")
    assert "quant_method None" not in str(caught.value)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a Linux /proc")
def test_an_output_dir_under_proc_is_refused_as_a_virtual_filesystem():
    """Not '0.00 GB free' (root may even pass the write-permission check there)."""
    with pytest.raises(ConfigError, match=r"train.output_dir='/proc/megatrain-run' lies on /proc \(proc\), a "
                                          "virtual filesystem") as caught:
        check_output_dir(Path("/proc/megatrain-run"), "train.output_dir", ConfigError, need_bytes=10**9)
    assert "GB free" not in str(caught.value)


def test_more_host_shards_than_stages_names_host_num_shards(tmp_path, capsys):
    cfg = load_config(raw=tiny_raw(host={"num_shards": 100}))
    with pytest.raises(ConfigError, match=r"'host.num_shards' = 100: the model has 5 stages"):
        shard_stages(build_layout(cfg.model), 100)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_raw()))
    code, err = run_main(["plan", str(tmp_path / "tiny.yaml"), "--set", "host.num_shards=100"], capsys)
    assert code == 2 and "host.num_shards" in err, err


def test_prepare_from_a_directory_says_it_is_a_directory(tmp_path, capsys):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text('{"text": "hello"}\n')
    code, err = run_main(["prepare", "--tokenizer", str(tmp_path), "--input", str(tmp_path / "chats"),
                          "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and "is a directory; --input takes files" in err and "does not exist" not in err, err
    assert f"--input {tmp_path / 'chats' / 'a.jsonl'}" in err, err  # the files it holds, which --input takes
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    code, err = run_main(["prepare", "--tokenizer", str(tmp_path), "--input", str(tmp_path / "empty"),
                          "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and "is a directory" in err and "it holds none below it" in err, err


def test_gpt2_is_refused_for_its_learned_position_embeddings(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatrain_ray.config.generic_shape import model_config_for_template

    transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as caught:
        model_config_for_template(tmp_path, "auto")
    message = str(caught.value)
    assert "GPT2LMHeadModel" in message and "learned position embeddings (wpe)" in message, message
    assert "final norm" not in message, message


@pytest.mark.parametrize("recipe, shape", [("qwen2.5-7b-instruct-sft", "qwen2.5-7b"),
                                           ("llama-3.1-70b-instruct-sft", "llama3-70b")])
def test_plan_of_a_hub_recipe_offline_names_configs_shapes(tmp_path, monkeypatch, capsys, recipe, shape):
    """The shape file of the recipe's model is named: by its name's start (qwen2.5-7b), else by the same family
    letters and size (Llama-3.1-70B-Instruct -> llama3-70b), as docs/quick-start.md step 3 shows."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants  # read at import: point the running process at an empty cache

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, err = run_main(["plan", os.path.join(REPO, "configs", "recipes", f"{recipe}.yaml")], capsys)
    assert code == 2 and "not in the hub cache" in err, err
    assert f"megatrain plan configs/shapes/{shape}.yaml (" in err and "offline" in err, err
    assert (Path(REPO) / "configs" / "shapes" / f"{shape}.yaml").is_file()
