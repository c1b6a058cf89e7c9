"""llama-server's weight repacking, measured once a machine (rlver_lib.servers.measure_repack)
and applied to every server started afterwards (rlver_lib.native.recorded_repack)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from rlver_lib import doctor, native, servers
from rlver_lib.config import SamplingParams
from rlver_lib.models import smollm2_gguf_path


@pytest.fixture
def build_root(tmp_path, monkeypatch):
    """The installed llama-server build, copied to a folder of its own that is made the
    installed one (``$RLVER_NATIVE_DIR``), so a record written there stays in the test."""
    root = tmp_path / "llama.cpp"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(native.llama_server_path(), root / "bin" / native.BINARY)
    shutil.copy2(native.install_dir() / "build.json", root / "build.json")
    monkeypatch.setenv("RLVER_NATIVE_DIR", str(root))
    monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    return root


def _record(root, **changes):
    record = {"repack": False, "prefill_tokens_per_s": {"repack": 70.0, "no_repack": 100.0}, "margin": 1.15,
              "model": "m.gguf", "tokens": 256, "cpu": native.cpu_model(),
              "cmake_args": native.build_info(root)["cmake_args"], "measured": "2026-12-07T00:00:00+00:00"}
    record.update(changes)
    native.repack_record_path(root).write_text(json.dumps(record), encoding="utf-8")
    return record


def test_measuring_writes_the_record_from_two_real_prefill_rates(build_root):
    start = time.perf_counter()
    record = servers.measure_repack(smollm2_gguf_path(), threads=1, tokens=128, repeats=2)
    wall = time.perf_counter() - start
    rates = record["prefill_tokens_per_s"]
    assert rates["repack"] > 0 and rates["no_repack"] > 0
    # each rate is the best of 2 prefills of 128 tokens, so the 4 prefills took at least
    # 2 x 128 tokens at each best rate: a rate cannot beat the wall clock
    assert wall >= 2 * 128 / rates["repack"] + 2 * 128 / rates["no_repack"]
    assert record["repack"] is (rates["no_repack"] < 1.15 * rates["repack"])
    assert record["cpu"] == native.cpu_model() and record["tokens"] == 128
    assert json.loads(native.repack_record_path().read_text()) == record
    assert native.recorded_repack() is record["repack"]


@pytest.mark.parametrize("rates, expected", [
    ((100.0, 114.0), True),    # 14 % faster without: within the noise, llama.cpp's default kept
    ((100.0, 116.0), False),   # 16 % faster without: off
    ((100.0, 80.0), True),
])
def test_repacking_is_turned_off_only_past_the_margin(build_root, monkeypatch, rates, expected):
    measured = dict(zip((True, False), rates))
    monkeypatch.setattr(servers, "prefill_rate", lambda model, *, repack, **kw: measured[repack])
    assert servers.measure_repack(build_root / "m.gguf")["repack"] is expected


def test_every_server_started_after_the_record_follows_it(build_root):
    _record(build_root, repack=False)
    with servers.LlamaServerBackend(smollm2_gguf_path(), n_ctx=256, parallel=1, threads=1) as server:
        assert server.repack is False and "--no-repack" in server.command
        out = server.generate([[{"role": "user", "content": "Hello"}]],
                              SamplingParams(temperature=0, max_new_tokens=2, seed=0))
        assert out[0].text
    _record(build_root, repack=True)
    with servers.LlamaServerBackend(smollm2_gguf_path(), n_ctx=256, parallel=1, threads=1) as server:
        assert server.repack is True and "--repack" in server.command and "--no-repack" not in server.command


@pytest.mark.parametrize("stale", ["other cpu", "other build", "no choice", "corrupt", "environment"])
def test_a_record_for_another_cpu_or_build_is_ignored(build_root, monkeypatch, stale):
    if stale == "other cpu":
        _record(build_root, cpu="Another CPU")
    elif stale == "other build":
        _record(build_root, cmake_args=["-DGGML_AVX2=ON"])
    elif stale == "no choice":
        record = _record(build_root)
        del record["repack"]
        native.repack_record_path().write_text(json.dumps(record))
    elif stale == "corrupt":
        native.repack_record_path().write_text("{not json")
    else:  # the user's own LLAMA_ARG_REPACK wins over the record; llama-server reads it itself
        _record(build_root)
        monkeypatch.setenv("LLAMA_ARG_REPACK", "on")
    assert native.recorded_repack() is None
    with servers.LlamaServerBackend(smollm2_gguf_path(), n_ctx=256, parallel=1, threads=1) as server:
        assert server.repack is None
        assert not {"--repack", "--no-repack"} & set(server.command)


def test_the_doctor_reports_a_record_without_measuring_again(build_root, monkeypatch):
    _record(build_root, repack=False)
    monkeypatch.setattr(servers, "measure_repack", lambda *a, **k: pytest.fail("measured again"))
    line = doctor.repack_line(build_root / "m.gguf")
    assert line.startswith("llama-server weight repacking: off on this machine")
    assert "70 tokens/s with it, 100 without" in line


def test_the_doctor_measures_when_asked_or_when_nothing_is_recorded(build_root, monkeypatch):
    calls = []

    def fake(model, **kw):
        calls.append(model)
        return _record(build_root, repack=True, prefill_tokens_per_s={"repack": 90.0, "no_repack": 95.0})

    monkeypatch.setattr(servers, "measure_repack", fake)
    assert "on on this machine (prompt processing 90 tokens/s with it, 95 without" in \
        doctor.repack_line(build_root / "m.gguf")
    assert len(calls) == 1
    doctor.repack_line(build_root / "m.gguf")
    assert len(calls) == 1  # recorded now
    doctor.repack_line(build_root / "m.gguf", remeasure=True)
    assert len(calls) == 2
    monkeypatch.setenv("LLAMA_ARG_REPACK", "off")
    assert doctor.repack_line(build_root / "m.gguf") == \
        "llama-server weight repacking: as LLAMA_ARG_REPACK=off says (not measured)"
    assert len(calls) == 2


def test_a_failed_measurement_is_reported_and_changes_nothing(build_root, monkeypatch):
    from rlver_lib.backends import BackendDied

    def died(model, **kw):
        raise BackendDied("llama-server for m.gguf exited with status 1 while starting\nlog tail")

    monkeypatch.setattr(servers, "measure_repack", died)
    assert doctor.repack_line(build_root / "m.gguf") == (
        "llama-server weight repacking: not measured (llama-server for m.gguf exited with status 1 while "
        "starting); llama.cpp's default (on) stays")
    assert native.recorded_repack() is None


def test_the_run_manifest_records_the_cpu_and_the_choice(build_root):
    from rlver_lib.pipeline.manifest import native_build

    assert native_build() == {"cpu": native.cpu_model(), "options": native.build_info()["options"], "repack": None}
    _record(build_root, repack=False)
    assert native_build()["repack"] is False
