"""The build records what it was compiled against, and import refuses a different torch."""
import sys
import types
from pathlib import Path

import pytest
import torch

import flashhead_ext
from flashhead_ext import _loader


def test_build_info_names_the_running_torch():
    assert flashhead_ext.BUILD_INFO.TORCH_VERSION == torch.__version__
    assert flashhead_ext.cuda_kernels_built() == bool(flashhead_ext.BUILD_INFO.WITH_CUDA)


def test_import_refuses_a_different_torch(monkeypatch):
    fake = types.SimpleNamespace(TORCH_VERSION="1.0.0+fake", CUDA_VERSION="9.9", WITH_CUDA=True)
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", fake)
    monkeypatch.setattr(flashhead_ext, "_build_info", fake, raising=False)
    with pytest.raises(ImportError) as err:
        _loader.load_extension()
    message = str(err.value)
    assert "1.0.0+fake" in message and torch.__version__ in message and "Rebuild" in message


def test_import_says_when_nothing_was_built(monkeypatch):
    # None in sys.modules makes `from . import _build_info` raise ImportError, as for a missing file.
    monkeypatch.setitem(sys.modules, "flashhead_ext._build_info", None)
    monkeypatch.delattr(flashhead_ext, "_build_info", raising=False)
    with pytest.raises(ImportError, match="holds no built extension") as err:
        _loader.load_extension()
    # Where it was imported from, and the way out when that is a checkout shadowing an installed copy.
    assert str(Path(flashhead_ext.__file__).parent) in str(err.value) and "pip install --no-build-isolation -e" in str(err.value)
