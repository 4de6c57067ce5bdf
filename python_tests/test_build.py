"""The build records what it was compiled against, and import refuses a different torch."""
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import flashhead_ext
from flashhead_ext import _loader
from flashhead_ext import _provenance as provenance
from flashhead_ext.bench.timing import run_metadata


def test_build_info_names_the_running_torch():
    assert flashhead_ext.BUILD_INFO.TORCH_VERSION == torch.__version__
    assert flashhead_ext.cuda_kernels_built() == bool(flashhead_ext.BUILD_INFO.WITH_CUDA)


def test_the_version_is_the_distributions():
    # Results' JSON and compare-heads name flashhead_ext.__version__; pyproject.toml names the release.
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert flashhead_ext.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_each_packages_all_lists_its_public_names():
    # `from flashhead_ext.speculative import *` (and the others) gives what the package offers.
    import flashhead_ext.fast
    import flashhead_ext.speculative

    for package in (flashhead_ext, flashhead_ext.speculative, flashhead_ext.fast):
        public = {name for name, value in vars(package).items() if not name.startswith("_") and not isinstance(value, types.ModuleType)}
        assert len(set(package.__all__)) == len(package.__all__) and all(hasattr(package, name) for name in package.__all__)
        assert public <= set(package.__all__), package.__name__


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_recorded_is_that_of_the_checkout_tracking_the_code(tmp_path, monkeypatch):
    # A copy installed inside another repository (a venv in the user's own project) once recorded
    # that project's commit in every result file.
    monkeypatch.delenv("FLASHHEAD_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    _git(tmp_path, "add", "tracked.py")
    _git(tmp_path, "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    installed = tmp_path / "venv" / "site-packages" / "pkg" / "__init__.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    assert provenance.checkout_commit(installed, mark_dirty=True) is None
    assert provenance.checkout_commit(tmp_path / "tracked.py", mark_dirty=False) == head
    assert provenance.checkout_commit(tmp_path / "tracked.py", mark_dirty=True) == head + "+dirty"  # the venv
    monkeypatch.setenv("FLASHHEAD_COMMIT", "abc1234")
    assert provenance.source_commit(installed, mark_dirty=True) == "abc1234"


def test_an_installed_copy_names_the_commit_it_was_built_from(monkeypatch):
    monkeypatch.delenv("FLASHHEAD_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "checkout_commit", lambda tracked_file, mark_dirty: None)
    monkeypatch.setattr(flashhead_ext.BUILD_INFO, "SOURCE_COMMIT", "0123abc", raising=False)
    assert run_metadata("cpu")["commit"] == "0123abc" and run_metadata("cpu")["version"] == flashhead_ext.__version__
    monkeypatch.setattr(provenance, "checkout_commit", lambda tracked_file, mark_dirty: "4567def")  # an editable install
    assert (run_metadata("cpu")["commit"], run_metadata("cpu")["build_commit"]) == ("4567def", "0123abc")
    monkeypatch.setattr(provenance, "checkout_commit", lambda tracked_file, mark_dirty: None)
    monkeypatch.setattr(flashhead_ext.BUILD_INFO, "SOURCE_COMMIT", None)  # built outside a checkout (an sdist)
    assert run_metadata("cpu")["commit"] == "unknown"


def test_import_refuses_a_different_torch(monkeypatch):
    fake = types.SimpleNamespace(TORCH_VERSION="1.0.0+fake", CUDA_VERSION="9.9", WITH_CUDA=True)
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", fake)
    monkeypatch.setattr(flashhead_ext, "_build_info", fake, raising=False)
    with pytest.raises(ImportError) as err:
        _loader.load_extension()
    message = str(err.value)
    assert "1.0.0+fake" in message and torch.__version__ in message and "Rebuild" in message
    # pip's cache would give back the wheel built against the other torch
    assert "--no-cache-dir" in message


def test_import_refusal_says_a_cpu_only_build_was_one_and_a_cpu_torch_is_one(monkeypatch):
    fake = types.SimpleNamespace(TORCH_VERSION="1.0.0+fake", CUDA_VERSION=None, WITH_CUDA=False)
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", fake)
    monkeypatch.setattr(flashhead_ext, "_build_info", fake, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch: it said "CUDA None"
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0\+fake \(CPU references only\) but torch "
                                          r"\S+ \(a CPU build\) is installed"):
        _loader.load_extension()


def test_import_says_when_nothing_was_built(monkeypatch):
    # None in sys.modules makes `from . import _build_info` raise ImportError, as for a missing file.
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", None)
    monkeypatch.delattr(flashhead_ext, "_build_info", raising=False)
    with pytest.raises(ImportError, match="holds no built extension") as err:
        _loader.load_extension()
    # Where it was imported from, and the way out when that is a checkout shadowing an installed copy.
    assert str(Path(flashhead_ext.__file__).parent) in str(err.value) and "pip install --no-build-isolation -e" in str(err.value)
    assert "Rebuild" not in str(err.value)  # an installed copy elsewhere is fine: nothing to rebuild


def test_import_refuses_the_same_torch_release_of_another_build(monkeypatch):
    # 2.x+cpu and 2.x+cu130 share a release number but not an ABI: the whole version string must match.
    other = torch.__version__.split("+")[0] + "+otherbuild"
    fake = types.SimpleNamespace(TORCH_VERSION=other, CUDA_VERSION="9.9", WITH_CUDA=True)
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", fake)
    monkeypatch.setattr(flashhead_ext, "_build_info", fake, raising=False)
    with pytest.raises(ImportError) as err:
        _loader.load_extension()
    assert other in str(err.value) and "CUDA 9.9 kernels" in str(err.value)  # the CUDA it was built against


def test_import_says_when_the_compiled_extension_fails_to_load(monkeypatch):
    # None in sys.modules makes `from . import _C` raise ImportError, as for an undefined symbol.
    monkeypatch.setitem(sys.modules, "flashhead_ext._C", None)
    monkeypatch.delattr(flashhead_ext, "_C", raising=False)
    with pytest.raises(ImportError, match="_C failed to load") as err:
        _loader.load_extension()
    assert isinstance(err.value.__cause__, ImportError) and str(err.value.__cause__) in str(err.value)
    assert "Rebuild" in str(err.value)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_clean_checkout_is_not_marked_dirty_and_source_commit_passes_mark_dirty_on(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHHEAD_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    tracked = tmp_path / "tracked.py"
    tracked.write_text("x = 1\n")
    _git(tmp_path, "add", "tracked.py")
    _git(tmp_path, "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert provenance.checkout_commit(tracked, mark_dirty=True) == head
    tracked.write_text("x = 2\n")
    assert provenance.source_commit(tracked, mark_dirty=True) == head + "+dirty"
    assert provenance.source_commit(tracked, mark_dirty=False) == head
    monkeypatch.setenv("FLASHHEAD_COMMIT", "abc1234")  # the variable wins over a checkout too
    assert provenance.source_commit(tracked, mark_dirty=True) == "abc1234"


def test_no_git_installed_gives_no_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable on it
    (tmp_path / "tracked.py").write_text("")
    assert provenance.checkout_commit(tmp_path / "tracked.py", mark_dirty=True) is None


def test_an_empty_commit_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("FLASHHEAD_COMMIT", "")
    monkeypatch.setattr(provenance, "checkout_commit", lambda tracked_file, mark_dirty: "fromgit")
    assert provenance.source_commit(Path("x.py"), mark_dirty=False) == "fromgit"


def test_a_commit_variable_that_names_no_commit_is_refused(monkeypatch):
    # Recorded as given in every result: a blank hid the checkout's "+dirty", a typo named no commit.
    for given in (" ", "unknown", "abc12", "abc123", "0" * 41, "5a078ab 29aa3a9", "5a078abz", "5a078ab+clean"):
        monkeypatch.setenv("FLASHHEAD_COMMIT", given)
        with pytest.raises(ValueError, match=re.escape(f"FLASHHEAD_COMMIT must name a commit by its hex sha (7 to 40 "
                                                       f"digits, '+dirty' allowed), got {given!r}")):
            provenance.source_commit(Path("x.py"), mark_dirty=False)
    for given in ("5a078ab", "5a078ab+dirty", "5A078AB", "0" * 40):
        monkeypatch.setenv("FLASHHEAD_COMMIT", given)
        assert provenance.source_commit(Path("x.py"), mark_dirty=False) == given


SETUP_PY = Path(__file__).parents[1] / "setup.py"


def read_setup(monkeypatch) -> dict:
    """setup.py's names, run as pip would but with setuptools.setup doing nothing."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    return runpy.run_path(str(SETUP_PY))


needs_setup_py = pytest.mark.skipif(not SETUP_PY.is_file(), reason="needs the checkout's setup.py")


@needs_setup_py
def test_setup_builds_every_time_and_reads_its_switches_strictly(monkeypatch, capsys):
    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "1")
    build = read_setup(monkeypatch)["BuildWithInfo"]
    # Without ninja setuptools skipped a _C newer than its sources, so a rebuild under another torch
    # kept the old _C beside new build info: the build is forced (ninja keeps it incremental).
    from setuptools import Distribution
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension

    forced = []
    monkeypatch.setattr(BuildExtension, "run", lambda self: forced.append(self.force))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)  # torch forces ninja builds itself
    command = build(Distribution({"name": "probe", "ext_modules": []}))
    command.ensure_finalized()
    command.run()
    assert forced == [True]
    monkeypatch.setenv("FLASHHEAD_COMMIT", "5a078ab-dirty")  # refused before the build, not minutes into it
    with pytest.raises(SystemExit, match=r"FLASHHEAD_COMMIT must name a commit by its hex sha .* got '5a078ab-dirty'"):
        command.run()
    assert forced == [True]
    monkeypatch.delenv("FLASHHEAD_COMMIT")
    # "yes" and "true" had started the full CUDA build; an empty value is unset.
    for value in ("yes", "true", " 1"):
        monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", value)
        with pytest.raises(SystemExit, match=f"FLASHHEAD_SKIP_CUDA_BUILD must be 1 .* or 0, got {value!r}"):
            read_setup(monkeypatch)
    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "1")
    # torch ignored a MAX_JOBS of no number, and passed 0 to ninja, which then ran every job at once.
    for value in ("0", "two", "-1", "2 "):
        monkeypatch.setenv("MAX_JOBS", value)
        with pytest.raises(SystemExit, match=f"MAX_JOBS must be a positive number of parallel compile jobs, got {value!r}"):
            read_setup(monkeypatch)
    monkeypatch.setenv("MAX_JOBS", "3")
    read_setup(monkeypatch)
    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)  # no toolkit: a CPU-only build, not a refusal
    assert read_setup(monkeypatch)["WITH_CUDA"] is False
    assert ("no CUDA toolkit found" in capsys.readouterr().err) == (torch.version.cuda is not None)
    toolkit = Path("/usr/local/cuda")
    if torch.version.cuda is None or not (toolkit / "include" / "cuda_runtime.h").is_file():
        return  # the arch list is read only by a CUDA build
    # An empty arch list is unset too: torch built for the GPU present, or failed without one.
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", " ")
    assert read_setup(monkeypatch)["WITH_CUDA"] is True
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"  # the PTX for GPUs newer than sm_90
    # An arch below the kernels' 8.0 is refused at once (7.5 failed minutes in, in ptxas), by number
    # or by the name torch expands.
    for arch_list, named in (("7.5", "7.5"), ("8.0;7.0+PTX", "7.0+PTX"), ("6.1 9.0", "6.1"), ("Turing", "Turing"),
                             ("Hopper;Volta+Tegra", "Volta+Tegra"), ("Kepler+Tesla", "Kepler+Tesla"), ("Pascal", "Pascal")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        with pytest.raises(SystemExit, match=re.escape(f"the kernels need compute capability 8.0 or later, got {named}")):
            read_setup(monkeypatch)
    for arch_list in ("8.6", "9.0a", "8.0+PTX;10.0", "12.0f", "Ampere;Ada", "Hopper", "Ampere+Tegra", "Blackwell"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        read_setup(monkeypatch)


@needs_setup_py
def test_setup_records_the_checked_commit_beside_the_extension(tmp_path, monkeypatch):
    # _build_info.py names the commit the build checked before it started: FLASHHEAD_COMMIT as given,
    # or, unset or empty, the checkout's ("+dirty" for uncommitted code), not the raw variable.
    import runpy

    from setuptools import Distribution, Extension
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension

    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "1")
    build = read_setup(monkeypatch)["BuildWithInfo"]
    # No compiler run: the build only makes the directory its extension goes to, as a real one does.
    monkeypatch.setattr(BuildExtension, "run", lambda self: Path(self.get_ext_fullpath("flashhead_ext._C")).parent.mkdir(
        parents=True, exist_ok=True))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)  # torch forces ninja builds itself
    checkout = provenance.checkout_commit(SETUP_PY.resolve(), mark_dirty=True)  # None outside a checkout
    for given, recorded in (("5A078AB+dirty", "5A078AB+dirty"), ("0" * 40, "0" * 40), ("", checkout), (None, checkout)):
        if given is None:
            monkeypatch.delenv("FLASHHEAD_COMMIT", raising=False)
        else:
            monkeypatch.setenv("FLASHHEAD_COMMIT", given)
        command = build(Distribution({"name": "probe", "ext_modules": [Extension("flashhead_ext._C", [])]}))
        command.build_lib = str(tmp_path / f"lib-{given}")
        command.ensure_finalized()
        command.run()
        info = runpy.run_path(str(tmp_path / f"lib-{given}" / "flashhead_ext" / "_build_info.py"))
        assert (info["SOURCE_COMMIT"], info["TORCH_VERSION"], info["WITH_CUDA"]) == (recorded, torch.__version__, False), given


@needs_setup_py
def test_setup_builds_no_cuda_with_a_cpu_torch_even_beside_a_toolkit(tmp_path, monkeypatch, capsys):
    # A CPU build of torch compiles no CUDA sources, whatever toolkit the machine has (here one with
    # the header the toolkit check looks for).
    from torch.utils import cpp_extension

    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    monkeypatch.setattr(torch.version, "cuda", None)
    assert read_setup(monkeypatch)["WITH_CUDA"] is False
    assert "no CUDA toolkit found" not in capsys.readouterr().err


@needs_setup_py
def test_setup_takes_the_nvidia_wheel_headers_beside_torch_and_in_purelib(tmp_path, monkeypatch):
    # A --user or PYTHONPATH torch has its nvidia-* wheels beside it, not in purelib: both are searched,
    # each directory once, and only the include directories that are directories.
    import sysconfig

    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "1")
    wheel_cuda_includes = read_setup(monkeypatch)["wheel_cuda_includes"]
    beside, purelib = tmp_path.resolve() / "user-site", tmp_path.resolve() / "site-packages"
    for site, names in ((beside, ("cu13", "cu12")), (purelib, ("cu11",))):
        for name in names:
            (site / "nvidia" / name / "include").mkdir(parents=True)
    (beside / "nvidia" / "cu9").mkdir()
    (beside / "nvidia" / "cu9" / "include").write_text("")  # a file, not a directory of headers
    (beside / "torch").mkdir()
    (beside / "torch" / "__init__.py").write_text("")
    monkeypatch.setattr(torch, "__file__", str(beside / "torch" / "__init__.py"))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"purelib": str(purelib)})
    found = [beside / "nvidia" / "cu12" / "include", beside / "nvidia" / "cu13" / "include"]
    assert wheel_cuda_includes() == [str(p) for p in (*found, purelib / "nvidia" / "cu11" / "include")]
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"purelib": str(beside)})  # torch in purelib
    assert wheel_cuda_includes() == [str(p) for p in found]


@needs_setup_py
def test_setup_states_the_licence_in_the_form_its_setuptools_takes(monkeypatch):
    # setuptools 77 took PEP 639's SPDX license_expression and deprecated the license field; an
    # older setuptools knows only the field.
    import setuptools

    monkeypatch.setenv("FLASHHEAD_SKIP_CUDA_BUILD", "1")
    license_metadata = read_setup(monkeypatch)["license_metadata"]
    for version, key in (("61.0.0", "license"), ("76.1.0", "license"), ("77.0.0", "license_expression"),
                         ("77.0.3", "license_expression"), ("84.2.1", "license_expression"), ("100.1", "license_expression")):
        monkeypatch.setattr(setuptools, "__version__", version)
        assert license_metadata() == {key: "Apache-2.0"}, version


@pytest.mark.skipif(flashhead_ext.cuda_kernels_built(), reason="a CPU-only build's CUDA kernels are the refusals tested")
def test_a_cpu_only_build_refuses_cuda_inputs_saying_why():
    # torch's own error for an op without a CUDA kernel says it "may not exist for this backend".
    # The CUDA key is dispatched to directly: this machine may have no GPU to make CUDA tensors on.
    ops = [name for name in torch._C._dispatch_get_all_op_names()
           if name.startswith("flashhead::") and name != "flashhead::no_derivative"]
    assert len(ops) >= 10
    for name in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name
    generator = torch.Generator().manual_seed(0)
    hidden, centroids = torch.randn(3, 40, generator=generator), torch.randn(11, 40, generator=generator)
    select = torch.ops.flashhead.select_clusters.default
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(NotImplementedError, match=r"flashhead::select_clusters got CUDA tensors, but this flashhead_ext "
                                                  r"build has no CUDA kernels .*FLASHHEAD_SKIP_CUDA_BUILD=1"):
        select.redispatch(cuda, hidden, centroids, 4, None)
    if torch.cuda.is_available():  # a GPU machine: through the Python API, on CUDA tensors
        with pytest.raises(NotImplementedError, match="flashhead::select_clusters got CUDA tensors"):
            flashhead_ext.ops.select_clusters(hidden.cuda(), centroids.cuda(), 4)
