"""The package imports, reports how it was built, and checks the torch it runs against; it
installs with pip against the environment's torch; the rank pool the multi-rank tests share."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastddp

from .distributed import RankFailure, run_distributed


def test_version_and_build_info() -> None:
    info = fastddp.build_info()
    assert fastddp.__version__ == info["version"]
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        # CI and pip builds cover 80;90; benchmarks/gpu.sh builds for the GPU at hand only.
        wanted = os.environ.get("FASTDDP_CUDA_ARCHS", "80;90").split(";")
        assert set(wanted) <= set(info["cuda_archs"])
    assert info["gloo_available"] == dist.is_gloo_available()


def test_torch_version_mismatch_is_a_clear_error(tmp_path) -> None:
    # Simulate a build against another torch: the loader must refuse before touching _C.
    code = (
        "import sys, types, importlib\n"
        "fake = types.ModuleType('fastddp._build_info')\n"
        "fake.TORCH_VERSION = '1.0.0'\n"
        "sys.modules['fastddp._build_info'] = fake\n"
        "try:\n"
        "    import fastddp\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "built against torch 1.0.0" in out.stdout
    assert torch.__version__ in out.stdout
    assert "pip install --no-build-isolation" in out.stdout


def _sum_ranks(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _rank_one_sleeps_in_here(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(120)


def _set_env_and_pid(rank: int, world_size: int) -> tuple[int, str | None]:
    seen = os.environ.get("FASTDDP_TEST_POOL")
    os.environ["FASTDDP_TEST_POOL"] = "set by an earlier case"
    return os.getpid(), seen


def _die_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_rank_pool_keeps_its_ranks_and_isolates_cases(ranks) -> None:
    first = ranks.run(_set_env_and_pid, world_size=2)
    second = ranks.run(_set_env_and_pid, world_size=2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes
    assert [seen for _, seen in second] == [None, None]  # the environment was restored
    assert ranks.run(_sum_ranks, world_size=2, args=(2.0,)) == [2.0, 2.0]


@pytest.mark.slow  # the harness's own check (15 s); run with --run-slow
def test_rank_pool_names_the_failing_case_and_restarts(ranks) -> None:
    before = ranks.run(_set_env_and_pid, world_size=2)
    try:
        ranks.run(_fail_on_rank_one, world_size=2, timeout=60)
    except RankFailure as exc:
        assert "test_rank_pool_names_the_failing_case_and_restarts" in str(exc)
        assert "rank 1 of 2 failed" in str(exc) and "boom on rank one" in str(exc)
    else:
        raise AssertionError("a failing rank must fail the case")
    try:
        ranks.run(_die_on_rank_zero, world_size=2, timeout=60)
    except RankFailure as exc:
        assert "rank 0 of 2 failed" in str(exc) and "exit code 7" in str(exc), str(exc)
    else:
        raise AssertionError("a dead rank must fail the case")
    # the next case runs in fresh ranks, undisturbed by the ones left in a barrier
    after = ranks.run(_set_env_and_pid, world_size=2)
    assert not {pid for pid, _ in before} & {pid for pid, _ in after}
    assert ranks.run(_sum_ranks, world_size=2, args=(1.0,)) == [1.0, 1.0]


def test_rank_pool_shows_where_a_stuck_rank_is(ranks, monkeypatch) -> None:
    """A case that does not finish fails with the stuck rank's Python stack (and its native
    threads' where gdb is installed: left out here, gdb takes half a minute to attach), so a
    hang in CI says where it was."""
    from . import distributed

    monkeypatch.setattr(distributed.shutil, "which", lambda name: None)
    ranks.run(_set_env_and_pid, world_size=2)  # the ranks are up: the timeout is the case's own
    with pytest.raises(RankFailure) as info:
        ranks.run(_rank_one_sleeps_in_here, world_size=2, timeout=5)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message and "did not finish within 5 s" in message, message
    assert "_rank_one_sleeps_in_here" in message.split("rank 1 of 2 failed")[1], message
    assert "rank 0 of 2" not in message


def test_distributed_helper_returns_results() -> None:
    assert run_distributed(_sum_ranks, world_size=3, args=(2.0,)) == [6.0, 6.0, 6.0]


def test_distributed_helper_reports_failing_rank() -> None:
    try:
        run_distributed(_fail_on_rank_one, world_size=2, timeout=60)
    except RankFailure as exc:
        assert "rank 1" in str(exc) and "boom on rank one" in str(exc)
    else:
        raise AssertionError("a failing rank must fail the test")


ROOT = Path(__file__).resolve().parent.parent


def _clean_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "src"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    return clone


def _venv(path: Path, system_site_packages: bool) -> Path:
    """A throwaway venv; with ``system_site_packages`` it sees this interpreter's torch (the
    same torch, nothing downloaded)."""
    flags = ["--system-site-packages"] if system_site_packages else []
    subprocess.run([sys.executable, "-m", "venv", *flags, str(path)], check=True, timeout=300)
    return path / "bin" / "python"


def _build_env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_BUILD_ISOLATION")}
    env["FASTDDP_WITH_CUDA"] = "0"  # what is tested here is how torch is found, not nvcc
    if shutil.which("ccache"):
        env.update(CMAKE_CXX_COMPILER_LAUNCHER="ccache", CCACHE_BASEDIR=str(clone))
    return env


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("isolation", ["isolated", "no-build-isolation"])
def test_pip_install_builds_against_the_environments_torch(tmp_path: Path, isolation: str) -> None:
    """`pip install .` as typed (pip's isolated build environment has no torch: the build finds
    the target environment's) and `pip install --no-build-isolation .`, each from a clean
    clone into a throwaway venv with this torch; the installed package imports and reports
    the torch it was built against."""
    clone = _clean_clone(tmp_path)
    python = _venv(tmp_path / "venv", system_site_packages=True)
    flags = ["--no-build-isolation"] if isolation == "no-build-isolation" else []
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *flags, "."], cwd=clone,
                          env=_build_env(clone), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    check = ("import json, fastddp, torch; "
             "print(json.dumps([fastddp.__file__, fastddp.build_info()['torch_version'], torch.__version__]))")
    out = subprocess.run([str(python), "-c", check], cwd=tmp_path, env=_build_env(clone),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where, built_against, running = json.loads(out.stdout.strip().splitlines()[-1])
    assert where.startswith(str(tmp_path / "venv")), where  # the installed copy, not the clone
    assert built_against == running == torch.__version__


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_without_torch_says_to_install_torch_first(tmp_path: Path) -> None:
    clone = _clean_clone(tmp_path)
    python = _venv(tmp_path / "venv", system_site_packages=False)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "."], cwd=clone,
                          env=_build_env(clone), capture_output=True, text=True, timeout=800)
    assert proc.returncode != 0
    text = " ".join((proc.stdout + proc.stderr).split())  # CMake wraps its messages
    assert "fastddp: torch is not installed for" in text, text[-5000:]
    assert "No module named 'torch'" in text and "install torch into this environment first" in text, text[-5000:]
