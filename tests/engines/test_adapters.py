"""An adapter's directory checked before any engine sees it, and the zero adapter made from it.

A refusal here is what saves a publish from draining every engine over a typo; the zero adapter is what keeps
base-model calls exact on an engine that serves adapters (it must be all zero, and loadable where the adapter it
was made from is).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools import fake_lora
from devtools.lora_adapter import build_adapter
from rollout_proxy.engines import adapters
from rollout_proxy.errors import AdapterRefused


@pytest.fixture(scope="module")
def adapter(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tokenizer_dir, tmp_path_factory.mktemp("a") / "v1", targets=("q_proj", "v_proj"), seed=1)


def copy_with(adapter: Path, target: Path, **config: object) -> Path:
    target.mkdir()
    (target / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    merged = {**json.loads((adapter / "adapter_config.json").read_text()), **config}
    (target / "adapter_config.json").write_text(json.dumps(merged))
    return target


def test_a_peft_adapter_is_read_with_its_rank_and_modules(adapter: Path, tmp_path: Path):
    files = adapters.read_adapter(str(adapter))
    assert (files.rank, files.target_modules, files.weights) == (8, ("q_proj", "v_proj"), "adapter_model.safetensors")
    patterned = copy_with(adapter, tmp_path / "p", rank_pattern={"q_proj": 32})
    assert adapters.read_adapter(str(patterned)).rank == 32  # vLLM checks the largest against --max-lora-rank


@pytest.mark.parametrize(
    "config, words",
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"lora_bias": True}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": 0}, "positive integer"),
        ({"layer_replication": [[0, 4]]}, "layer_replication"),
    ],
)
def test_what_vllm_would_refuse_is_refused_in_words_first(adapter: Path, tmp_path: Path, config, words):
    refused = copy_with(adapter, tmp_path / "x", **config)
    with pytest.raises(AdapterRefused, match=words) as caught:
        adapters.read_adapter(str(refused))
    assert caught.value.status == 400 and caught.value.param == "path"


def test_a_path_that_holds_no_adapter_is_refused(adapter: Path, tmp_path: Path):
    cases = {
        "relative/dir": "absolute",
        str(tmp_path / "missing"): "no such directory",
    }
    (tmp_path / "empty").mkdir()
    cases[str(tmp_path / "empty")] = "no adapter_config.json"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    cases[str(broken)] = "not JSON"
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    cases[str(weightless)] = "no weights"
    for path, words in cases.items():
        with pytest.raises(AdapterRefused, match=words):
            adapters.read_adapter(path)


def test_the_zero_adapter_is_all_zero_one_pair_of_the_adapters_shapes_written_once(adapter: Path, tmp_path: Path):
    files = adapters.read_adapter(str(adapter))
    made = Path(adapters.write_zero_adapter(files, tmp_path))
    assert made.parent == tmp_path and made.name.startswith(adapters.ZERO_PREFIX)
    header, start = fake_lora.safetensors_header(made / "adapter_model.safetensors")
    source, _ = fake_lora.safetensors_header(adapter / "adapter_model.safetensors")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    assert len(tensors) == 2 and all(source[name]["shape"] == entry["shape"] for name, entry in tensors.items())
    data = (made / "adapter_model.safetensors").read_bytes()[start:]
    assert len(data) == sum(e["data_offsets"][1] - e["data_offsets"][0] for e in tensors.values()) and not any(data)
    config = adapters.read_adapter(str(made))  # it passes the same checks: vLLM loads it
    assert config.target_modules == (next(iter(tensors)).split(".lora_")[0].rsplit(".", 1)[-1],)
    assert fake_lora.adapter_key(str(made)) is None  # samples as the base does
    again = adapters.write_zero_adapter(files, tmp_path)
    assert again == str(made) and sorted(p.name for p in tmp_path.iterdir()) == [made.name]  # no staging left
    beside = adapters.write_zero_adapter(files)  # by default beside the adapter (the engines see that place)
    assert Path(beside).parent == adapter.parent


def test_no_zero_adapter_is_made_from_a_bin_adapter(adapter: Path, tmp_path: Path):
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (binary / "adapter_model.bin").write_bytes(b"pickle")
    files = adapters.read_adapter(str(binary))
    with pytest.raises(AdapterRefused, match="safetensors"):
        adapters.write_zero_adapter(files, tmp_path)
