"""A regular install, as a user makes one without the checkout.

From a copy of the working tree: an sdist, a wheel built from that sdist with pip, the wheel
installed into a fresh virtual environment, and the `overlap` command and every kernel backend
run there from a directory outside the checkout. The README's Install section is checked
against what this test does.

The tests that build and install are the slow tier (marked `slow`, minutes of building):
`make test` and CI leave them out, `make test-all` runs them.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The CPU wheel, found on local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
SETUPTOOLS = "setuptools>=77"
EXTRA = "triton"
# Hidden entries (.git, .venv, caches) and build outputs stay out of the copy.
NOT_SOURCES = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "*.py[cod]", "*.so",
                                     "runs", "bench_out")
# Any Python warning a build prints (UserWarning, SetuptoolsDeprecationWarning, BuildBackendWarning...).
PYTHON_WARNING = re.compile(r"^.*\b\w*Warning: .*$", re.M)
SKIPPED_EXTENSION = "overlap: installing without the overlap._C extension"
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
TINY_TRAIN = ["--steps", "4", "--eval-every", "2", "--layers", "1", "--hidden", "32", "--heads", "2",
              "--seq", "32", "--batch", "4", "--sample", "1", "--sample-len", "8"]

BACKEND_CHECK = r"""
import json
import torch
import overlap
import overlap.kernels
import overlap.kernels.backends as kernels

srcs, offsets = [torch.arange(5.0), torch.arange(7.0)], [0, 8]
expected = torch.zeros(16)
kernels.get_backend("torch", "cpu").pack(srcs, expected, offsets, 0.5)
found = {"overlap": overlap.__file__, "kernels": list(overlap.kernels.__path__)[0], "backends": {}}
for name in kernels.BACKEND_NAMES:
    if name == "auto":
        continue
    try:
        backend = kernels.get_backend(name, "cpu")
    except kernels.BackendUnavailable as exc:
        found["backends"][name] = str(exc)
        continue
    out = torch.zeros(16)
    backend.pack(srcs, out, offsets, 0.5)
    found["backends"][name] = "ok" if torch.equal(out, expected) else f"wrong result {out.tolist()}"
print(json.dumps(found))
"""


def _run(command, cwd, env=None, timeout=300):
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(map(str, command))} exited with {done.returncode}:\n{output}"
    return output


def _build_wheel(venv, source, wheel_dir, env=None):
    """pip wheel (verbose: older pips show a build's warnings only then); the wheel and pip's output."""
    output = _run([venv / "bin" / "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                   "-w", wheel_dir, source], cwd=source.parent, env=env)
    wheels = list(wheel_dir.glob("overlap-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {wheel_dir}, found {wheels}\n{output}"
    return wheels[0], output


def _wheel_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


def _expected_files(tree):
    """What the wheel must hold: every file of overlap/ and kernels/ (as overlap/kernels/)."""
    files = set()
    for directory, target in (("overlap", "overlap"), ("kernels", "overlap/kernels")):
        for path in (tree / directory).rglob("*"):
            if path.is_file():
                files.add(f"{target}/{path.relative_to(tree / directory).as_posix()}")
    return files


@pytest.fixture(scope="module")
def install(tmp_path_factory):
    """Build from a copy of the tree into a fresh venv; the paths and the build logs."""
    base = tmp_path_factory.mktemp("install")
    tree = base / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=base)
    # The build runs in this venv too: as a user's, it has torch and setuptools but no NumPy yet.
    _run([venv / "bin" / "pip", "install", TORCH, SETUPTOOLS], cwd=base)
    python = venv / "bin" / "python"

    sdist_log = _run([python, "-c", "import sys; from setuptools import build_meta; "
                      "build_meta.build_sdist(sys.argv[1])", base / "sdist"], cwd=tree)
    sdists = list((base / "sdist").glob("overlap-*.tar.gz"))
    assert len(sdists) == 1, sdists
    with tarfile.open(sdists[0]) as archive:
        sdist_files = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        # pip builds a directory in place: each build gets its own copy.
        for copy in ("with-compiler", "no-compiler"):
            archive.extractall(base / copy, filter="data")
    source = sdists[0].name.removesuffix(".tar.gz")

    wheel, build_log = _build_wheel(venv, base / "with-compiler" / source, base / "wheel")
    no_compiler = dict(os.environ, CC="/nonexistent/cc", CXX="/nonexistent/c++")
    bare_wheel, bare_log = _build_wheel(venv, base / "no-compiler" / source, base / "wheel-no-compiler",
                                        env=no_compiler)

    _run([venv / "bin" / "pip", "install", f"{wheel}[{EXTRA}]"], cwd=base)
    workdir = base / "run"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return dict(tree=tree, venv=venv, workdir=workdir, env=env, sdist_files=sdist_files, sdist_log=sdist_log,
                wheel=wheel, build_log=build_log, bare_wheel=bare_wheel, bare_log=bare_log)


def _overlap(install, *args, timeout=120):
    return _run([install["venv"] / "bin" / "overlap", *args], cwd=install["workdir"], env=install["env"],
                timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sdist_holds_the_extension_sources_and_whole_test_suite(install):
    tree, files = install["tree"], install["sdist_files"]
    wanted = {p.relative_to(tree).as_posix() for p in [*(tree / "csrc").iterdir(), *(tree / "kernels").glob("*.cu"),
                                                         *(tree / "tests").glob("*.py")]}
    assert wanted <= files, f"missing from the sdist: {sorted(wanted - files)}"
    # Python warnings, and setuptools' own (a MANIFEST.in line that matches nothing).
    warnings = PYTHON_WARNING.findall(install["sdist_log"]) + re.findall(r"^warning: .*$", install["sdist_log"], re.M)
    assert not warnings, "\n".join(warnings)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_holds_every_package_and_data_file_and_builds_without_warnings(install):
    expected = _expected_files(install["tree"])
    assert any(name.startswith("overlap/models/") for name in expected)
    assert "overlap/kernels/flat_kernels.cu" in expected
    files = _wheel_files(install["wheel"])
    extension = {name for name in files if re.fullmatch(r"overlap/_C\.[^/]*\.so", name)}
    assert len(extension) == (1 if HAS_COMPILER else 0), f"extension files {extension} (compiler: {HAS_COMPILER})"
    assert files - extension == expected, (f"missing: {sorted(expected - files)}; "
                                           f"unexpected: {sorted(files - extension - expected)}")
    warnings = PYTHON_WARNING.findall(install["build_log"])
    if HAS_COMPILER:
        assert not warnings, "\n".join(warnings)
    else:
        assert len(warnings) == 1 and SKIPPED_EXTENSION in warnings[0], "\n".join(warnings)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_a_compiler_the_build_warns_once_and_ships_no_extension(install):
    warnings = PYTHON_WARNING.findall(install["bare_log"])
    assert len(warnings) == 1, "\n".join(warnings) or install["bare_log"]
    assert SKIPPED_EXTENSION in warnings[0] and "no C++ compiler found" in warnings[0], warnings[0]
    assert _wheel_files(install["bare_wheel"]) == _expected_files(install["tree"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_installed_package_and_every_available_kernel_backend(install):
    env = dict(install["env"], TRITON_INTERPRET="1")      # Triton runs CPU tensors in its interpreter
    found = json.loads(_run([install["venv"] / "bin" / "python", "-c", BACKEND_CHECK], cwd=install["workdir"],
                            env=env).strip().splitlines()[-1])
    site = str(install["venv"])
    assert found["overlap"].startswith(site) and found["kernels"].startswith(site), found
    backends = found["backends"]
    assert backends["torch"] == "ok", backends
    assert backends[EXTRA] == "ok", backends
    if HAS_COMPILER:
        assert backends["ext"] == "ok", backends
    else:
        assert "overlap._C was not built" in backends["ext"], backends
    assert "install cupy" in backends["cupy"], backends       # no GPU stack in this venv


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_help_estimate_and_simulate_run_from_the_install(install):
    out = _overlap(install, "--help")
    assert all(command in out for command in ("train", "estimate", "simulate")), out
    out = _overlap(install, "estimate", "--params", "7.5e9", "--world", "64", "--stage", "zero3")
    assert re.search(r"^total\s+1\.88$", out, re.M), out       # 16Ψ/N bytes of model state
    out = _overlap(install, "simulate", "--model", "llama3-8b", "--cluster", "8xH100-nvlink")
    assert re.search(r"^planner pick: depth \d+, .* tokens/s/GPU", out, re.M), out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_runs_from_the_install(install):
    out = _overlap(install, "train", *TINY_TRAIN, timeout=180)
    assert "coriolanus.txt" in out, out                       # the text shipped as package data
    assert re.search(r"^step 4: train loss [\d.]+, val loss [\d.]+$", out, re.M), out
    assert re.search(r"^communication [\d.]+ m?s/step, \d+% hidden", out, re.M), out
    assert "--- sample 1 ---" in out, out


def test_readme_install_section_matches_the_project_and_this_test():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    section = re.search(r"^## Install\n(.*?)^## ", (ROOT / "README.md").read_text(), re.M | re.S)
    assert section, "README.md has no '## Install' section"
    text = section.group(1)
    listed = set(re.findall(r"^- `\[([\w-]+)\]`", text, re.M))
    assert listed == set(config["project"]["optional-dependencies"]), listed
    torch_requirement = next(r for r in config["project"]["dependencies"] if r.startswith("torch"))
    assert SETUPTOOLS in config["build-system"]["requires"]
    for phrase in (f'"{torch_requirement}" "{SETUPTOOLS}"', "pip install --no-build-isolation",
                   "pip wheel --no-build-isolation --no-deps", f"[{EXTRA}]"):
        assert phrase in text, f"README's Install section no longer says {phrase!r}"
