"""``ckpt-tool verify OUT --engine``: each vLLM release under test judges converted OUTs with its own classes.

Per release: the meta-device build, filtered with vLLM's own ``_filter_subtensors`` over placed storages, gives
exactly the table vLLM's ``_filter_subtensors`` gives on the CPU-built model, for every fixture case (and on
synthetic alias patterns); a good OUT passes (also through vLLM's real ``ShardedStateLoader.load_weights``) and
the report names the release; an OUT converted for another profile fails naming keys on every rank; a rank file
with one tensor renamed fails naming it; a fork's patched model file is the judge (an extra parameter fails a
good OUT), and one that cannot be built is one line, exit 2.

The releases are the engine matrix's columns (``vllm_release`` / ``engine_site`` in tests/engine/conftest.py). The
engine runs in ``--engine-python``: here a wrapper script that puts the release's site folder on ``PYTHONPATH``
(and not the repo: the probe must run without ckpt_tool), as a serving venv's python would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cases import CASES

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "ckpt_tool" / "verify" / "engine" / "probe.py"
STUBS = REPO / "ckpt_tool" / "verify" / "engine" / "vllm_stubs.py"
PATCHED = Path(__file__).resolve().with_name("patched_vllm.py")


def release_of(site: Path) -> str:
    """The vLLM version installed in ``site`` (from its dist-info folder's name)."""
    found = sorted(site.glob("vllm-*.dist-info"))
    assert len(found) == 1, found
    return found[0].name.removeprefix("vllm-").removesuffix(".dist-info")


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def serving_python(engine_site, tmp_path_factory) -> Path:
    """A stand-in for the serving venv's interpreter: this python with only the release's site added."""
    folder = tmp_path_factory.mktemp("serving")
    return _script(folder / "python", f'PYTHONPATH="{engine_site}" exec "{sys.executable}" "$@"')


def verify(*args, site: Path | None = None, summary: Path | None = None) -> subprocess.CompletedProcess:
    """``ckpt-tool verify ARGS`` in a subprocess; ``site`` on PYTHONPATH makes this interpreter's vLLM that release;
    ``summary``: the GitHub step summary file."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site)] * (site is not None) + [str(REPO)])}
    env.pop("GITHUB_STEP_SUMMARY", None)
    if summary is not None:
        env["GITHUB_STEP_SUMMARY"] = str(summary)
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "verify", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )


def probe(request: dict, site: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(PROBE)],
        input=json.dumps({"protocol": 1, "site": str(site), **request}),
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    answer = json.loads(proc.stdout)
    assert answer["fatal"] is None, answer["fatal"]
    return answer


def test_meta_build_filters_like_vllm_on_cpu_for_every_fixture_case(engine_site, converted) -> None:
    """The meta table (vLLM's _filter_subtensors over placed storages) == vLLM's _filter_subtensors on the
    CPU-built model, key for key, dtype and shape, on the last rank of every case (the one a padded split leaves
    zeros on; every rank's load is the matrix's); and vLLM's real loader loads each good OUT with only the
    documented attn_sink slice warnings. The plain fp4 fixture only at its largest tp, with and without ep (its
    smaller splits build the same classes with smaller shapes; the matrix loads them all; CI time)."""
    largest = {(v, ep): max(t for v2, t, e in CASES if (v2, e) == (v, ep)) for v, _, ep in CASES}
    jobs = []
    for variant, tp, ep in CASES:
        if variant == "fp4" and tp < largest[variant, ep]:
            continue
        out = converted(variant, tp, ep)
        setting = {"config_dir": str(out / "model"), "draft_dir": str(out / "mtp"), "tp": tp, "ep": ep}
        jobs += [
            {**setting, "component": c, "rank": tp - 1, "folder": str(out / c), "real_load": True}
            for c in ("model", "mtp")
        ]
    answer = probe({"jobs": jobs}, engine_site)
    assert answer["versions"]["vllm_version"] == release_of(engine_site)
    assert len(answer["results"]) == len(jobs)
    for job, res in zip(jobs, answer["results"]):
        where = f"{job['config_dir']} {res['component']}/rank-{res['rank']}"
        load = res["load"]
        assert load["cpu_table"] == res["table"], where
        assert load["exception"] is None, (where, load["exception"])
        slices = [r["message"] for r in load["log"]]
        assert slices and all(
            m.startswith("loading tensor of shape") and ".attn_sink' of shape" in m for m in slices
        ), (where, slices)
        assert any(k.endswith(".ffn.gate.weight") for k in res["aliases"]), where  # the MoE module's second name


ALIAS_SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("stubs", sys.argv[1]); stubs = importlib.util.module_from_spec(spec)
sys.modules["stubs"] = stubs; spec.loader.exec_module(stubs)
stubs.bootstrap(sys.argv[2])
import torch
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

def patterns(device):
    base, other = torch.empty(8, 16, device=device), torch.empty(12, device=device)
    p = torch.nn.Parameter(torch.empty(4, 4, device=device))
    return {
        "b.whole": base, "a.same": base, "c.rows": base[2:4], "c.flat": base.view(-1), "z.first_row": base[0],
        "e.param": p, "d.param": p, "f.empty": torch.empty(0, device=device), "f.empty_view": base[:0],
        "h.alone": torch.empty(3, device=device), "i.overlap1": other[0:6], "i.overlap2": other[4:10],
        "j.inner": other[6:9], "k.bf16": torch.empty(5, dtype=torch.bfloat16, device=device),
    }

cpu = list(ShardedStateLoader._filter_subtensors(patterns("cpu")))
meta, aliases = stubs.filter_tensors(patterns("meta"))
raises = []
for device in ("cpu", "meta"):  # a non-contiguous tensor vLLM cannot view(-1): it raises, and so must the meta path
    t = torch.empty(8, 16, device=device)
    try:
        (ShardedStateLoader._filter_subtensors if device == "cpu" else stubs.filter_tensors)(
            {"t": t, "cols": t[:, 4:8]}
        )
        raises.append(None)
    except RuntimeError as e:
        raises.append(type(e).__name__)
print(json.dumps({"cpu": cpu, "meta": list(meta), "aliases": aliases, "raises": raises}))
"""


def test_meta_filter_equals_vllms_own_on_alias_patterns(engine_site, tmp_path) -> None:
    """Shared parameters, views, sub-ranges, overlaps, empty tensors: the kept keys (and their order) on the meta
    device are the ones vLLM's _filter_subtensors keeps on the CPU."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "OMP_NUM_THREADS": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", ALIAS_SCRIPT, str(STUBS), str(engine_site)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["meta"] == got["cpu"]
    assert set(got["cpu"]) == {"a.same", "d.param", "h.alone", "i.overlap1", "i.overlap2", "k.bf16"}, got["cpu"]
    assert got["aliases"]["b.whole"] == got["aliases"]["c.flat"] == got["aliases"]["c.rows"] == "a.same"
    assert got["aliases"]["e.param"] == "d.param" and got["aliases"]["j.inner"] == "i.overlap2"
    assert got["aliases"]["f.empty"] is None and got["aliases"]["f.empty_view"] is None  # empty: never kept
    assert got["raises"] == ["RuntimeError", "RuntimeError"]


def test_good_out_passes_beside_a_level_and_names_the_release(
    engine_site, serving_python, converted, fixture_dir, tmp_path
) -> None:
    out = converted("fp4", 2)
    summary = tmp_path / "summary.md"
    proc = verify(
        out,
        "--source",
        fixture_dir("fp4"),
        "--level",
        "structure",
        "--engine",
        "--engine-python",
        serving_python,
        "--json",
        "--junit",
        tmp_path / "v.xml",
        "--github",
        summary=summary,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    release = release_of(engine_site)
    assert doc["ok"] and doc["level"] == "structure" and doc["engine"]["vllm_version"] == release
    assert doc["engine"]["ranks"] == doc["engine"]["real_loads"] == 4
    engine_checks = [f"engine-vllm:{c}/rank-{r}" for c in ("model", "mtp") for r in range(2)]
    assert (
        set(engine_checks) <= set(doc["passed"]) and "structure:model/model-rank-0-part-0.safetensors" in doc["passed"]
    )
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "v.xml").getroot().iter("testcase")}
    for name in engine_checks:  # one testcase per component and rank, saying which vLLM passed it
        assert cases[name].get("classname") == "ckpt-tool.verify.engine"
        assert f"judged by vLLM {release}" in cases[name].find("system-out").text
    text = summary.read_text()
    assert f"engine: vLLM {release}" in text and "| mtp/rank-1 | 41 | yes | ✅ |" in text


def _tensor_data_bytes(files: list[Path]) -> int:
    """The bytes of every tensor the files hold (from their headers): what a load of them reads."""
    from ckpt_tool.checkpoint.headers import read_shard_header

    return sum(t.end - t.start for p in files for t in read_shard_header(p, p.name).tensors.values())


def test_each_rank_vllm_loaded_reports_its_load_seconds_and_bytes(newest_engine_site, newest_converted, tmp_path):
    """Every rank vLLM's ShardedStateLoader loaded for real reports, in the JSON, the text and the JUnit output,
    its load seconds and the tensor bytes the loader read, which are exactly the tensor data of the rank's files
    (counted as vLLM's own iterate_over_files handed them over), and the bytes of it the disk gave. What ckpt-tool
    measures around the engine: the newest release only."""
    out = newest_converted("fp4", 2)
    proc = verify(out, "--engine", "--json", "--junit", tmp_path / "v.xml", site=newest_engine_site)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    loads = {(x["component"], x["rank"]): x for x in doc["engine"]["loads"]}
    assert sorted(loads) == [(c, r) for c in ("model", "mtp") for r in range(2)] and doc["engine"]["real_loads"] == 4
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "v.xml").getroot().iter("testcase")}
    text = verify(out, "--engine", site=newest_engine_site).stdout
    for (comp, rank), load in loads.items():
        files = sorted((out / comp).glob(f"model-rank-{rank}-part-*.safetensors"))
        want = _tensor_data_bytes(files)
        assert want > 0 and load["bytes"] == want, (comp, rank, load, want)
        assert load["seconds"] > 0 and load["cpu_seconds"] is not None and load["peak_rss_bytes"] > 0, load
        assert load["disk_read_bytes"] is not None and 0 <= load["disk_read_bytes"], load
        name = f"engine-vllm:{comp}/rank-{rank}"
        (check,) = [c for c in doc["results"] if c["name"] == name]
        assert f"loaded them ({want / 1024**2:.2f} MiB in " in check["message"], check["message"]
        assert float(cases[name].get("time")) > 0
        props = {p.get("name"): p.get("value") for p in cases[name].iter("property")}
        assert props["load_bytes"] == str(want), props
        assert f"engine load {comp}/rank-{rank}: {want / 1024**2:.2f} MiB of tensors in " in text, text


# the tower split at tp 2 (its replicated layout at tp 4 is the matrix's: the judge builds the same class either way)
@pytest.mark.parametrize("variant,tp", [("vl-fp4", 2)])
def test_a_vision_out_is_judged_by_vllms_vision_class(serving_python, converted, variant, tp) -> None:
    """The probe builds what vLLM's registry resolves: for a config with vision_n_layers > 0 that is
    DeepseekV4ForConditionalGeneration."""
    proc = verify(converted(variant, tp), "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["engine"]["ranks"] == 2 * tp
    messages = {c["name"]: c["message"] for c in doc["results"] if c["name"].startswith("engine-vllm:")}
    for r in range(tp):
        assert "(DeepseekV4ForConditionalGeneration): 136 parameters match" in messages[f"engine-vllm:model/rank-{r}"]
        assert "(DeepSeekV4MTP): 42 parameters match" in messages[f"engine-vllm:mtp/rank-{r}"]


def test_a_dspark_out_is_judged_by_vllms_dspark_class(serving_python, converted) -> None:
    """OUT/dspark is built as vLLM builds the draft for ``"method": "dspark"`` (DSparkDeepseekV4ForCausalLM) and loaded
    by its sharded loader on every rank (a draft that does not load fails its rank: the V4.1 test below)."""
    proc = verify(converted("dspark-fp4", 2), "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["engine"]["ranks"] == 4
    messages = {c["name"]: c["message"] for c in doc["results"] if c["name"].startswith("engine-vllm:")}
    for r in range(2):
        assert "(DSparkDeepseekV4ForCausalLM): 101 parameters match" in messages[f"engine-vllm:dspark/rank-{r}"]


def test_out_for_another_profile_fails_naming_keys_on_every_rank(engine_site, serving_python, converted) -> None:
    out = converted("fp4", 2, target="vllm-seed")
    proc = verify(out, "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    failed = {f["name"]: f for f in doc["failures"]}
    assert sorted(failed) == sorted(f"engine-vllm:{c}/rank-{r}" for c in ("model", "mtp") for r in range(2))
    release = release_of(engine_site)
    for _name, f in failed.items():
        assert f"judged by vLLM {release}" in f["message"]
        # the seed's routed-expert names (vllm-seed, docs/profiles.md#the-seed): the first keys the loader would meet,
        # named in the message
        assert ".ffn.experts.w13_weight' in model-rank-" in f["message"] and "not a parameter key" in f["message"], f[
            "message"
        ]
        assert f["tensor"].endswith(".ffn.experts.w13_weight")
        assert any(
            "ffn.experts.routed_experts.w13_weight" in p and "Missing keys" in p for p in f["details"]["problems"]
        )


def test_one_renamed_tensor_fails_naming_it(newest_engine_site, newest_converted, tmp_path) -> None:
    """Judged by this interpreter's vLLM (no --engine-python: the default)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    shutil.copytree(newest_converted("fp4", 2), out)
    path = out / "mtp" / "model-rank-1-part-0.safetensors"
    tensors = load_file(path)
    old = "model.layers.3.mtp_block.attn.wq_b.weight"
    new = "model.layers.3.mtp_block.attn.wq_b_renamed.weight"
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(path))
    proc = verify(out, "--engine", "--json", site=newest_engine_site)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [f["name"] for f in doc["failures"]] == ["engine-vllm:mtp/rank-1"]
    (f,) = doc["failures"]
    assert f["tensor"] == new and f"'{new}' in model-rank-1-part-0.safetensors is not a parameter key" in f["message"]
    assert f"parameter '{old}'" in f["message"] and "Missing keys" in f["message"]
    assert f"raised KeyError: '{new}'" in " ".join(f["details"]["problems"])  # vLLM's own loader, for real
    assert doc["engine"]["vllm_version"] == release_of(newest_engine_site)


def _patched_python(site: Path, folder: Path, mode: str) -> Path:
    command = f'PATCH={mode} PYTHONPATH="{site}" exec "{sys.executable}" "{PATCHED}" "$@"'
    return _script(folder / f"python-{mode}", command)


def test_a_forks_patched_model_file_is_the_judge(newest_engine_site, newest_converted, tmp_path) -> None:
    """The same good OUT, judged by a vLLM whose MTP class holds one more parameter: the MTP ranks fail naming it."""
    proc = verify(
        newest_converted("fp4", 2),
        "--engine",
        "--engine-python",
        _patched_python(newest_engine_site, tmp_path, "extra-param"),
        "--json",
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [f["name"] for f in doc["failures"]] == ["engine-vllm:mtp/rank-0", "engine-vllm:mtp/rank-1"]
    for f in doc["failures"]:
        assert (
            f["tensor"] == "patched_scale" and "parameter 'patched_scale' (bfloat16[8]) is in no file" in f["message"]
        )


def test_a_vllm_whose_class_cannot_be_built_is_one_line_exit_2(newest_engine_site, newest_converted, tmp_path) -> None:
    judge = _patched_python(newest_engine_site, tmp_path, "raise")
    proc = verify(newest_converted("fp4", 1), "--engine", "--engine-python", judge)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    release = release_of(newest_engine_site)
    assert f"vLLM {release}" in proc.stderr and "build vLLM's mtp class on the meta device (mtp/rank-0)" in proc.stderr
    assert "patched DeepSeekV4MTP: needs a GPU to build" in proc.stderr


def test_a_v41_out_is_judged_for_the_vllm_series_it_was_written_for(engine_site, serving_python, fixture_dir, tmp_path):
    """DeepSeek V4.1's DSpark draft differs between 0.33 and 0.34 (context_wkv_proj): OUT converted with --vllm for
    the judging release passes, target and draft; its draft converted for the other series fails on that vLLM,
    naming the keys and the --vllm that fixes it."""
    release = release_of(engine_site)
    other = "0.33" if release.startswith("0.34.") else "0.34"
    outs = {}
    for series in (release, other):
        outs[series] = tmp_path / f"out-{series}"
        only = [] if series == release else ["--only", "mtp"]
        cmd = [
            sys.executable,
            "-m",
            "ckpt_tool",
            "convert",
            str(fixture_dir("v41")),
            str(outs[series]),
            "--vllm",
            series,
        ]
        proc = subprocess.run(cmd + only, capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
    proc = verify(outs[release], "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    messages = {c["name"]: c["message"] for c in json.loads(proc.stdout)["results"] if c["name"].startswith("engine-")}
    assert "(DeepseekV41ForCausalLM)" in messages["engine-vllm:model/rank-0"], messages
    assert "(DSparkDeepseekV4ForCausalLM)" in messages["engine-vllm:dspark/rank-0"], messages

    proc = verify(outs[other], "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (failure,) = json.loads(proc.stdout)["failures"]
    assert failure["name"] == "engine-vllm:dspark/rank-0"
    assert "context_wkv_proj" in failure["message"] and f"convert again with --vllm {release}" in failure["message"]


def test_a_serving_env_without_one_of_vllms_requirements_names_it_and_what_to_install(
    newest_engine_site, newest_converted, tmp_path
) -> None:
    """A trimmed serving environment: the release's site without llguidance (every other entry linked in). vLLM's
    model registry logs the ImportError and fails later inside pydantic; the one line names the missing module,
    not pydantic's ValidationError, and the requirement to install."""
    site = tmp_path / "site"
    site.mkdir()
    for entry in newest_engine_site.iterdir():
        if not entry.name.lower().startswith("llguidance"):
            (site / entry.name).symlink_to(entry)
    python = _script(tmp_path / "python", f'PYTHONPATH="{site}" exec "{sys.executable}" "$@"')
    proc = verify(newest_converted("fp4", 1), "--engine", "--engine-python", python)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "ModuleNotFoundError: No module named 'llguidance'" in proc.stderr, proc.stderr
    assert "validation error for" not in proc.stderr, proc.stderr
    assert f"vLLM {release_of(newest_engine_site)} requires llguidance" in proc.stderr, proc.stderr
    assert "-m pip install 'llguidance" in proc.stderr, proc.stderr


def test_an_nvfp4_out_is_judged_by_the_serving_vllm(serving_python, converted) -> None:
    """An NVIDIA NVFP4 export's OUT under ep (every expert's input scales on each rank, FlashInfer's layout): the
    judge builds the classes on the GPU the export is served on (a B200) and its ShardedStateLoader loads every rank."""
    proc = verify(converted("nvfp4", 2, True), "--engine", "--engine-python", serving_python, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["engine"]["ranks"] == 4
    messages = {c["name"]: c["message"] for c in doc["results"] if c["name"].startswith("engine-vllm:")}
    assert all("parameters match" in m for m in messages.values()), messages
