"""Packaging: what a wheel carries and needs.

Fast: the data files are found through one function (harness.resources), never relative to
the source tree; the distribution name, the licence and the README's install facts.
Slow: the wheel, built from this tree, installed in a fresh virtual environment, runs one
DeepSpeed ZeRO-1 step and `harness report` outside the repository (what .ci/run relies on).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from harness import resources

REPO = Path(__file__).resolve().parent.parent
DIST_NAME = "llama-layout-harness"


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# ------------------------------------------------------------------ data files (fast)


def test_shipped_files_are_found_through_resources():
    from harness.frameworks.deepspeed import config as ds_config
    from harness.planner import paper
    from harness.report import published_figures

    assert resources.path("ds_configs/zero1.json").is_file()
    assert Path(ds_config.DS_CONFIG_DIR) == resources.path("ds_configs")
    assert Path(ds_config.resolve_path("", 1)) == resources.path("ds_configs/zero1.json")
    assert Path(ds_config.resolve_path("ds_configs/zero3.json", 3)) == resources.path("ds_configs/zero3.json")
    assert Path(published_figures.DEFAULT_DIR) == resources.path("baselines")
    assert published_figures.load()["study"] and published_figures.load()["frameworks"]
    assert len(paper.repo_sweeps()) == 4
    with pytest.raises(ValueError):
        resources.path("examples/tiny.yaml")  # not shipped: the wheel would not have it


def test_installed_copy_is_read_outside_a_source_tree(monkeypatch, tmp_path):
    """Away from the repository, files come from the package (harness/_data), as in a wheel."""
    monkeypatch.setattr(resources, "_SOURCE_ROOT", tmp_path)
    assert resources.source_root() is None
    assert resources.root() == Path(resources.__file__).resolve().parent / resources.PACKAGED
    assert resources.path("ds_configs/zero1.json") == resources.root() / "ds_configs" / "zero1.json"


def test_no_module_finds_files_relative_to_the_source_tree():
    """Only harness/resources.py may look next to the package; everything else asks it."""
    pattern = re.compile(
        r"parents\[\d\]|dirname\(os\.path\.dirname|\.\./"
        r"|Path\(__file__\)\.resolve\(\)\.parent\.parent"
    )
    bad = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / "harness").rglob("*.py"))
        if p.name != "resources.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert bad == []


def test_the_build_ships_what_resources_reads():
    """setup.py copies resources.SHIPPED into the wheel; MANIFEST.in puts them in the sdist;
    the folders stay at the top of the repository, one copy each in git."""
    setup = (REPO / "setup.py").read_text()
    assert 'RESOURCES["SHIPPED"]' in setup and '"resources.py"' in setup
    manifest = (REPO / "MANIFEST.in").read_text().split("\n")
    for folder in resources.SHIPPED:
        assert (REPO / folder).is_dir() and not (REPO / folder).is_symlink()
        assert f"graft {folder}" in manifest
    assert not (REPO / "harness" / resources.PACKAGED).exists()  # made by the build only


# ------------------------------------------------------------------ name, licence, README (fast)


def test_distribution_name_does_not_collide_and_the_command_stays():
    project = pyproject()["project"]
    assert project["name"] == DIST_NAME  # "harness" on PyPI is another project
    assert project["scripts"] == {"harness": "harness.cli:main"}


def test_licence_file_matches_pyproject():
    project = pyproject()["project"]
    assert "Apache-2.0" in project["license"].split(" AND ")
    assert "LICENSE" in project["license-files"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # the study's data in baselines/ keep their licence, stated in LICENSE and in the SPDX expression
    assert "baselines/" in text and "CC BY-NC-SA 4.0" in text
    assert "CC-BY-NC-SA-4.0" in project["license"].split(" AND ")


def test_readme_commands_install_the_cpu_build_as_ci_does():
    """PyPI's `torch==2.13.0` is the CUDA build: the headline asks for `+cpu`, and CI runs the very command."""
    readme = (REPO / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    pip install ")][:2]
    assert len(commands) == 2 and all(
        c.startswith("pip install 'torch==2.13.0+cpu' --extra-index-url") for c in commands
    )
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1].removesuffix(" && pytest -q") in ci.splitlines()


def test_readme_states_the_packaging_facts():
    readme = (REPO / "README.md").read_text()
    assert "https://download.pytorch.org/whl/cpu" in readme  # PyTorch's CPU wheel index
    assert re.search(r"pip install flash-attn[^\n`]*--no-build-isolation", readme)
    assert "build-essential" in readme and "g++" in readme  # DeepSpeed JIT-builds its CPU ops
    assert DIST_NAME in readme and "LICENSE" in readme and "CC BY-NC-SA 4.0" in readme


# ------------------------------------------------------------------ the wheel itself (slow)

_NOT_SOURCE = shutil.ignore_patterns(
    *(
        ".git build dist *.egg-info __pycache__ .pytest_cache .benchmarks .venv harness-logs harness-slurm *.sqlite*"
    ).split()
)


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    """This tree without VCS or build artefacts: builds leave nothing in the repository."""
    dst = tmp_path_factory.mktemp("src") / "repo"
    shutil.copytree(REPO, dst, ignore=_NOT_SOURCE, symlinks=True)
    return dst


def _clean_env(venv: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env["OMP_NUM_THREADS"] = "1"
    if venv is not None:  # then the running environment's scripts (DeepSpeed's op builder runs `ninja`)
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = os.pathsep.join([str(venv / "bin"), os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def running_site_dirs() -> list[str]:
    """The site directories this interpreter imports from: a venv's, a conda env's or the system's
    (with the base's under --system-site-packages), and the user site when it is on."""
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    on_path = {os.path.realpath(p) for p in sys.path if p}
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d) and os.path.realpath(d) in on_path]


def own_pth_files(site_dirs: list[str]) -> set[str]:
    """The .pth files this project's own installs put there (an editable install's finder or path
    line, as its RECORD lists them): the venv must import the wheel, not the source tree."""
    return {
        str(f.locate().resolve())
        for dist in importlib.metadata.distributions(name=DIST_NAME, path=site_dirs)
        for f in dist.files or ()
        if f.suffix == ".pth"
    }


_SEE_RUNNING_ENV = """\
import os, site, sys
for d in {dirs!r}:  # after the venv's own site-packages, so that the wheel comes first
    if d not in sys.path:
        sys.path.append(d)
    for name in sorted(os.listdir(d)):
        if name.endswith(".pth") and os.path.realpath(os.path.join(d, name)) not in {skip!r}:
            site.addpackage(d, name, None)
"""


def see_running_env(venv: Path) -> None:
    """Make a plain venv import what the running interpreter imports (torch, DeepSpeed, pip, wherever
    they are installed), except this project: --system-site-packages would give the base
    interpreter's site only, which has neither torch nor DeepSpeed when they live in a venv."""
    dirs = running_site_dirs()
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([venv / "bin" / "python", "-c", code], venv, _clean_env()).stdout.strip())
    (purelib / "_running_env.py").write_text(_SEE_RUNNING_ENV.format(dirs=dirs, skip=own_pth_files(dirs)))
    (purelib / "_running_env.pth").write_text("import _running_env\n")


def test_a_fresh_venv_is_given_the_running_environment_without_this_project():
    """What the wheel's venv is given (see_running_env) holds torch, DeepSpeed and pip wherever this
    interpreter has them (a venv, a conda env, the system), and no .pth of this project's own."""
    dirs = running_site_dirs()
    for name in ("torch", "deepspeed", "pip"):  # where each is installed (not find_spec: for pip,
        # setuptools' distutils shim would then give up its distutils for the rest of the session)
        where = Path(importlib.metadata.distribution(name).locate_file("")).resolve()
        assert where in {Path(d).resolve() for d in dirs}, (name, where, dirs)
    own = own_pth_files(dirs)
    for d in dirs:
        for pth in Path(d).glob("*.pth"):
            if DIST_NAME.replace("-", "_") in pth.name or str(REPO) in pth.read_text(errors="replace"):
                assert str(pth.resolve()) in own, pth


def _run(cmd, cwd, env, timeout=300):
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sdist_carries_the_shipped_folders(source_copy, tmp_path):
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(tmp_path)!r}))"
    name = _run([sys.executable, "-c", code], source_copy, _clean_env()).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    for f in (
        "setup.py MANIFEST.in LICENSE ds_configs/zero1.json baselines/hagemann2023_best.csv "
        "baselines/paper_sweeps/README.md harness/resources.py"
    ).split():
        assert f in members, f


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_deepspeed_zero1_and_report(source_copy, tmp_path):
    """Build the wheel, install it in a fresh venv (torch and DeepSpeed from the running
    environment, harness from the wheel only), and run a DeepSpeed ZeRO-1 step at dp 2 and
    `harness report` from a folder outside the repository."""
    env = _clean_env()
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, "."],
        source_copy,
        env,
    )
    (wheel,) = dist.glob("*.whl")
    assert wheel.name.startswith(DIST_NAME.replace("-", "_") + "-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "harness/_data/ds_configs/zero1.json" in names
    assert "harness/_data/baselines/paper_sweeps/llama_13B_bfloat16_64_GPUs_all_runs.csv" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert all(n.startswith(("harness/", DIST_NAME.replace("-", "_"))) for n in names), "files outside the package"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    see_running_env(venv)
    py = venv / "bin" / "python"
    # pip from the running environment, installing into the venv; --ignore-installed: this
    # project installed there (editable or not) must not satisfy the requirement
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel], tmp_path, env)

    work = tmp_path / "work"  # outside the repository, PYTHONPATH unset
    work.mkdir()
    venv_env = _clean_env(venv)
    # DeepSpeed's CPU op (deepspeed_shm_comm) is built from the running environment's torch, DeepSpeed and
    # compiler, so its build in a fresh venv is the running environment's, byte for byte (the same
    # build.ninja): built where the running environment keeps it, by an earlier run or now, rather than
    # again for every new venv (a minute and more of compiling on 2 cores; what harness.launch.build_lock
    # keys per environment is the interpreter's path, not these inputs)
    from harness.launch.build_lock import environment_dir

    venv_env["TORCH_EXTENSIONS_DIR"] = environment_dir()
    where = _run(
        [
            py,
            "-c",
            "import harness, importlib.metadata as m; print(harness.__file__); "
            f"print(m.distribution({DIST_NAME!r}).locate_file(''))",
        ],
        work,
        venv_env,
    ).stdout.split()
    for p in where:  # the package and its metadata: the wheel's
        assert Path(p).resolve().is_relative_to(venv.resolve()), f"{p} is not the wheel's, in {venv}"

    (work / "spec.yaml").write_text(
        "name: wheel-deepspeed-zero1\nstore: results.sqlite\n"
        "workload: {model: tiny, seq_len: 32, global_batch_size: 4, steps: 1, warmup_steps: 0, precision: fp32,"
        " device: cpu}\n"
        "layout: {engine: deepspeed, dp: 2, micro_batch_size: 2, zero_stage: 1}\n"
    )
    # a hang guard: ~30 s with DeepSpeed's CPU op built; ~150 s when it is rebuilt on a busy machine
    _run(
        [
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--master_port",
            _free_port(),
            "--module",
            "harness.cli",
            "train",
            "spec.yaml",
            "--no-progress",
        ],
        work,
        venv_env,
        timeout=420,
    )

    exported = _run([venv / "bin" / "harness", "results", "export", "--format", "jsonl"], work, venv_env).stdout
    (record,) = [json.loads(line) for line in exported.splitlines() if line.strip()]
    assert record["status"] == "ok"
    ds_file = Path(record["metrics"]["engine"]["ds_config_file"])
    assert ds_file.name == "zero1.json"
    if ds_file.is_absolute():  # the packaged copy, not a repository's
        assert ds_file.resolve().is_relative_to(venv.resolve()), ds_file

    _run([venv / "bin" / "harness", "report", "--out", "report"], work, venv_env)
    report = (work / "report" / "report.md").read_text()
    assert "QUOTED" in report and "No baselines directory was found" not in report  # baselines shipped
