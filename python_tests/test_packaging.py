"""The source distribution carries what a build from it needs."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _checkout_files() -> list:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to list the source files")
    # Untracked files that git does not ignore count too: a new file belongs to the next commit.
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    return [name for name in listed.splitlines() if (ROOT / name).is_file()]


def _copy_of_checkout(tmp_path: Path) -> Path:
    # A copy, so that what a build writes (egg-info, build info) stays out of the checkout.
    tree = tmp_path / "tree"
    for name in _checkout_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    return tree


def test_sdist_carries_every_source_file(tmp_path):
    files = _checkout_files()
    tree = _copy_of_checkout(tmp_path)
    build_info = tree / "flashhead_ext" / "_build_info.py"
    env = {**os.environ, "FLASHHEAD_SKIP_CUDA_BUILD": "1"}
    subprocess.run([sys.executable, "setup.py", "-q", "--version"], cwd=tree, check=True, capture_output=True, env=env)
    assert not build_info.exists()  # only a build writes it, beside the extension it describes
    build_info.write_text("WITH_CUDA = True  # this machine's build\n")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--formats=gztar", "-d", str(tmp_path / "dist")],
                   cwd=tree, check=True, capture_output=True, env=env)
    assert build_info.read_text() == "WITH_CUDA = True  # this machine's build\n"  # an sdist leaves it alone
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as sdist:
        members = {Path(*Path(name).parts[1:]).as_posix() for name in sdist.getnames()}
    needed = [name for name in files if name.startswith("csrc/") or name.startswith("flashhead_ext/")
              or name in ("setup.py", "pyproject.toml", "README.md", "LICENSE")]
    assert needed and not sorted(set(needed) - members)
    assert "LICENSE" in needed and "flashhead_ext/_build_info.py" not in members


def test_the_package_requires_the_torch_it_is_built_against(tmp_path):
    """The extension loads under that release only, so pip must not see another as compatible."""
    import torch

    env = {**os.environ, "FLASHHEAD_SKIP_CUDA_BUILD": "1"}
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, env=env)
    (requires,) = tmp_path.glob("*.egg-info/requires.txt")
    runtime = requires.read_text().split("\n\n")[0].split()  # the extras' sections follow a blank line
    assert f"torch=={torch.__version__.split('+')[0]}" in runtime
    assert [name for name in runtime if name.startswith("torch")] == [runtime[0]]


def test_the_package_states_its_licence_without_a_deprecated_form(tmp_path):
    env = {**os.environ, "FLASHHEAD_SKIP_CUDA_BUILD": "1"}
    built = subprocess.run([sys.executable, "-W", "always", "setup.py", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                           check=True, capture_output=True, text=True, env=env)
    (info,) = tmp_path.glob("*.egg-info/PKG-INFO")
    fields = info.read_text().split("\n\n")[0].splitlines()
    assert "License-Expression: Apache-2.0" in fields or "License: Apache-2.0" in fields
    assert "License-File: LICENSE" in fields
    assert "license" not in "".join(line for line in built.stderr.splitlines() if "Deprecat" in line).lower()


def test_a_torch_older_than_2_6_is_refused():
    old_torch = "import runpy, torch; torch.__version__ = '2.5.1+cu124'; runpy.run_path('setup.py')"
    env = {**os.environ, "FLASHHEAD_SKIP_CUDA_BUILD": "1"}
    result = subprocess.run([sys.executable, "-c", old_torch, "--version"], cwd=ROOT, capture_output=True, text=True,
                            env=env)
    assert result.returncode != 0
    assert "flashhead_ext needs torch>=2.6, found 2.5.1+cu124: install a newer torch first" in result.stderr


def test_a_build_without_torch_stops_with_advice():
    """As in pip's isolated build environment, which pyproject.toml gives no torch."""
    hide_torch = "import runpy, sys; sys.modules['torch'] = None; runpy.run_path('setup.py')"
    result = subprocess.run([sys.executable, "-c", hide_torch, "--version"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0
    assert "install torch first, then pip install --no-build-isolation ." in result.stderr


def test_a_cuda_home_without_headers_is_refused_before_the_build(tmp_path):
    # torch guesses CUDA_HOME from the nvcc on the PATH; a wrapper outside the toolkit gives a
    # directory without headers, where the build failed minutes in.
    import torch

    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch compiles no CUDA sources")
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "FLASHHEAD_SKIP_CUDA_BUILD": "0"}
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert f"CUDA_HOME {tmp_path} has no include/cuda_runtime.h: set CUDA_HOME to the CUDA toolkit" in result.stderr



def test_the_built_package_carries_its_data_files(tmp_path):
    # What a wheel installs beside the modules: the prompts the CLIs read by default, and the PEP 561
    # marker without which type checkers ignore the package's annotations.
    tree, out = _copy_of_checkout(tmp_path), tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(out)], cwd=tree, check=True,
                   capture_output=True, env={**os.environ, "FLASHHEAD_SKIP_CUDA_BUILD": "1"})
    package = out / "flashhead_ext"
    assert (package / "py.typed").is_file()
    assert (package / "data" / "spec_bench_question.jsonl").is_file() and (package / "data" / "README.md").is_file()
