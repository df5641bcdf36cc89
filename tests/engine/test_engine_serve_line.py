"""The serve lines ckpt-tool prints, fed to each verified vLLM release's own ``SpeculativeConfig``.

``inspect`` prints ``--speculative-config '{...}'`` and ``convert`` prints the whole ``vllm serve`` line; both name the
method and ``num_speculative_tokens``. Here that JSON (with ``OUT`` the converted folder) goes through the release's
``EngineArgs.create_engine_config`` (tests/engine/speculative_probe.py), which must accept it with the method and
the number of tokens intended. The same config without ``num_speculative_tokens`` records what each release does
when the number is left out: 0.33.0 (config/speculative.py ``SpeculativeConfig.__post_init__``) and 0.34.0
(v1/worker/gpu/spec_decode/dspark/config.py) both take config.json's ``dspark_block_size``.

Run: ``pytest -m engine tests/engine/test_engine_serve_line.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli

pytestmark = pytest.mark.engine

PROBE = Path(__file__).resolve().parent / "speculative_probe.py"
# (variant, the draft's OUT folder, the architecture vLLM's speculative config resolves for the draft)
CASES = [("dspark-fp4", "dspark", "DSparkDraftModel"), ("v41", "dspark", "DSparkV41DraftModel"),
         ("fp4", "mtp", "DeepSeekV4MTPModel")]  # fmt: skip
SPEC = re.compile(r"--speculative-config '(\{[^']*\})'")


def _printed(capsys, *args) -> dict:
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    found = SPEC.findall(out)
    assert len(found) == 1, out
    return json.loads(found[0])


def _block_size(src: Path) -> int:
    doc = json.loads((src / "config.json").read_text())
    return (doc.get("text_config") or doc)["dspark_block_size"]


def test_printed_speculative_config_is_accepted_by_each_release(
    fixture_dir, engine_site, vllm_release, capsys, tmp_path
) -> None:
    jobs, intended = [], []
    for variant, folder, architecture in CASES:
        out = tmp_path / variant
        inspected = _printed(capsys, "inspect", fixture_dir(variant))
        served = _printed(capsys, "convert", fixture_dir(variant), out, "--tp", "1", "--target", vllm_release.profile)
        assert inspected == {**served, "model": f"OUT/{folder}"}, (inspected, served)
        for spec in (inspected, served):
            assert spec["model"].endswith(f"/{folder}") and "num_speculative_tokens" in spec, spec
            jobs.append({"model": str(out / "model"), "speculative": {**spec, "model": str(out / folder)}})
            intended.append((variant, spec["method"], spec["num_speculative_tokens"], architecture))
        if folder == "dspark":  # the same without the number: what the release takes when it is left out
            bare = {k: v for k, v in inspected.items() if k != "num_speculative_tokens"}
            jobs.append({"model": str(out / "model"), "speculative": {**bare, "model": str(out / folder)}})
            intended.append((variant, "dspark", _block_size(fixture_dir(variant)), architecture))
    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": jobs}))
    proc = subprocess.run(
        [sys.executable, str(PROBE), "--site", str(engine_site), str(tmp_path / "jobs.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    answer = json.loads(proc.stdout)
    assert answer["vllm_version"] == vllm_release.version
    for job, result, (variant, method, tokens, architecture) in zip(jobs, answer["results"], intended):
        where = (vllm_release.id, variant, job["speculative"])
        assert "error" not in result, (where, result)
        assert result["method"] == method and result["num_speculative_tokens"] == tokens, (where, result)
        assert result["draft_architectures"] == [architecture], (where, result)
