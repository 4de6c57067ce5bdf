"""What the command-line tools share."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import ops
from ._loader import build_info
from .clustering import check_seed, cluster_sizes
from .prompts import load_prompts


def doc_summary(doc: str) -> str:
    """A module docstring's first paragraph as a CLI description (without reST's double backticks)."""
    return doc.split("\n\n")[0].replace("``", "")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, but for a default of None, whose help says what it
    stands for ("(default: None)" after "default: 8, or all the file holds" read as a contradiction)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def device_arg(text: str) -> str:
    """argparse ``type`` of a device flag: a device torch can name and this machine has, so a bad one
    is a usage error before any model is built. The CPU is always "cpu" (the runs compare with
    it: "cpu:0" once took their CUDA paths)."""
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({error})") from None
    if device.type == "meta":
        raise argparse.ArgumentTypeError(f"{text!r} holds no values: a run needs a CPU or CUDA device")
    if device.type not in ("cpu", "cuda"):  # "mps", "xpu": torch's error came mid-run, naming nothing
        raise argparse.ArgumentTypeError(f"{text!r}: a run needs a CPU or CUDA device")
    missing = ops._missing_cuda_device(device) if device.type == "cuda" else None
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: {missing}")
    return "cpu" if device.type == "cpu" else text


# Why a CPU-only build cannot run the flashhead ops on a GPU, and what to do.
NO_CUDA_KERNELS = ("flashhead_ext's CUDA kernels, and this build has none (built with FLASHHEAD_SKIP_CUDA_BUILD=1 or "
                   "without a CUDA toolkit): reinstall flashhead_ext with FLASHHEAD_SKIP_CUDA_BUILD unset and CUDA_HOME "
                   "set to a CUDA toolkit")


def refuse_missing_cuda_kernels(parser: argparse.ArgumentParser, flag: str, device, needs: str,
                                instead: Optional[str] = None) -> None:
    """A usage error where ``needs`` (a run of the flashhead ops) is asked of a GPU, ``flag``'s
    ``device``, that this CPU-only build has no kernels for; else the first op raised mid-run."""
    if torch.device(device).type == "cuda" and not build_info().WITH_CUDA:
        parser.error(f"{flag} {device}: {needs} {NO_CUDA_KERNELS}; or {instead or f'pass {flag} cpu'}")


def refuse_draft_without_kernels(parser: argparse.ArgumentParser, args, heads: list, body: Optional[str],
                                 body_flag: str) -> None:
    """``refuse_missing_cuda_kernels`` for the draft's device (--draft-device, else --device) where it
    runs the flashhead ops: for a FlashHead head, or for a ``body`` (None: no fast-path draft) that
    runs the decoder-layer ops; dense drafts of the other bodies are torch's alone."""
    from .fast.decoder import KERNEL_BODIES

    flag, device = ("--draft-device", args.draft_device) if args.draft_device else ("--device", args.device)
    if "flashhead" in heads:
        refuse_missing_cuda_kernels(parser, flag, device, "a FlashHead draft needs")
    elif heads and body in KERNEL_BODIES:
        refuse_missing_cuda_kernels(parser, flag, device, f"{body_flag} {body} needs", f"pass {body_flag} compiled")


def refuse_shared_files(parser: argparse.ArgumentParser, inputs: dict, outputs: dict) -> None:
    """A usage error where an output flag names a file an input flag reads or another output flag
    writes, under any name, hard links too (``{flag: path, list of paths or None}``): the run
    overwrote its prompts, a model's config.json, or the JSON with the plot."""
    users = {}
    for role, files in (("reads", inputs), ("writes", outputs)):
        for flag, paths in files.items():
            for path in [] if paths is None else paths if isinstance(paths, list) else [paths]:
                identity = _file_identity(path)
                if role == "writes" and identity in users:
                    parser.error(f"{flag} {path}: the file {users[identity]}, which the run would overwrite: name another")
                users.setdefault(identity, f"{flag} {role}")


def _file_identity(path) -> object:
    """An existing file's device and inode (one for all its names and links), else its real path."""
    try:
        status = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return status.st_dev, status.st_ino


# The files transformers reads by name from a model directory: a result written over one broke the model.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "model.safetensors",
               "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_files(name: str) -> list:
    """The files of MODEL_FILES in the model directory ``name``, as refuse_shared_files' input; none
    where it names no directory (smollm2, a Hub name, an early-exit draft)."""
    try:
        return [Path(name) / file for file in MODEL_FILES if (Path(name) / file).exists()]
    except OSError:  # a name too long for a path
        return []


def output_file(text: str) -> str:
    """argparse ``type`` of a file a run writes once it is over (--json, --plot): a path that could
    not be written is a usage error before the run, which would otherwise be lost. Leaves nothing
    behind. Permission bits do not tell (root passes them, and /proc refuses new files anyway), so
    it opens an existing file for appending, or else makes an unnamed file in the directory that
    would hold it."""
    try:
        return _writable_file(text)
    except OSError as error:  # a name past the filesystem's limit raised from is_dir() itself
        raise argparse.ArgumentTypeError(f"{text!r}: {error.strerror or error}") from None


def _writable_file(text: str) -> str:
    """output_file's checks, which may raise OSError."""
    path = Path(text)
    if path.is_symlink() and not path.exists():  # the write would follow it, after the run
        raise argparse.ArgumentTypeError(f"{text!r} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    if text.endswith(("/", os.sep)):  # Path drops the slash: the run wrote a file of the directory's name
        raise argparse.ArgumentTypeError(f"{text!r} ends in a slash, so it names a directory, not a file")
    if path.exists():
        if not path.is_file():  # opening a FIFO or device could block or act
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a regular file")
        try:
            with open(path, "ab"):
                pass
        except OSError:
            raise argparse.ArgumentTypeError(f"{text!r} exists and cannot be written") from None
        return text
    ancestor = path.parent.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(ancestor)
        tempfile.TemporaryFile(dir=ancestor).close()
    except OSError:
        raise argparse.ArgumentTypeError(f"{text!r}: {ancestor} is not a directory that can be written to") from None
    return text


def write_output(path, text: str) -> Path:
    """Writes a run's output file (an ``output_file`` path), making its directories; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


class ArgumentValueError(ValueError):
    """An argument that does not fit what is known only after parsing (the model's vocabulary, the
    prompts file): the CLI makes it a usage error."""


def cluster_layout(flag: str, vocab: int, cluster_size: int) -> tuple[int, int]:
    """(C, b): the clusters ``vocab`` rows make in clusters of ``cluster_size`` (``flag``'s value)
    and the largest one's size, narrower than asked where every cluster gets a padding slot; or an
    ArgumentValueError naming ``flag``."""
    try:
        sizes = cluster_sizes(vocab, cluster_size)[1]
    except ValueError as error:
        raise ArgumentValueError(f"{flag}: {error}") from None
    return sizes.numel(), int(sizes.max())


def cluster_count(flag: str, vocab: int, cluster_size: int) -> int:
    """C, as cluster_layout."""
    return cluster_layout(flag, vocab, cluster_size)[0]


def model_unavailable(subject: str, name: str) -> Optional[str]:
    """Why the model ``name`` cannot be loaded on this installation, said of ``subject`` (the flag
    naming it), or None: a usage error before the run, not an ImportError after it."""
    if importlib.util.find_spec("transformers") is None:
        return f"{subject} {name!r}: loading a model needs transformers (the [models] extra: pip install 'transformers>=5,<6')"
    if name == "smollm2":
        from .hf import smollm2_gguf_path

        try:
            smollm2_gguf_path()
        except (ImportError, FileNotFoundError) as error:
            return f"{subject} smollm2: {error}"
    return None


DEFAULT_NUM_PROMPTS = 8


def cli_prompts(path, num_prompts: Optional[int]) -> list:
    """The Spec-Bench prompts of a CLI's ``--prompts`` and ``--num-prompts``: by default up to
    DEFAULT_NUM_PROMPTS (all the file holds when fewer); a count given past the file's is an
    ArgumentValueError, rather than silently fewer prompts, as is a file that cannot be read."""
    try:
        questions = load_prompts(path, DEFAULT_NUM_PROMPTS if num_prompts is None else num_prompts)
    except (OSError, ValueError) as error:
        raise ArgumentValueError(f"--prompts: {error}") from None
    if num_prompts is not None and len(questions) < num_prompts:
        raise ArgumentValueError(f"--num-prompts {num_prompts} exceeds the {len(questions)} prompts with an odd "
                                 f"question_id in {path}")
    return questions


# torch.set_num_threads takes an int32, and far more threads than cores crashed torch at its first
# parallel op (100,000 did).
MAX_THREADS = 1024


def thread_count(text: str) -> int:
    """argparse ``type`` of ``--threads``: an integer in 1..MAX_THREADS."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type`` of a count: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type`` of a count that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seed(text: str, check) -> int:
    value = int(text)
    try:
        check(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def kmeans_seed(text: str) -> int:
    """argparse ``type`` of a clustering's seed: one torch.Generator.manual_seed takes."""
    return _seed(text, check_seed)


def run_seed(text: str) -> int:
    """argparse ``type`` of a speculative run's seed, which k-means takes and the fast path's random
    weights and synthetic acceptances take as an int64: one that fails only there failed
    mid-run, after the models loaded and the clustering was built."""
    return _seed(text, lambda value: ops._require_int("seed", value))


def positive_int_list(text: str) -> list[int]:
    """argparse ``type`` of a comma list of counts (probes values, cluster sizes, batch sizes); a
    repeated value runs once, so no configuration is measured or counted twice."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive values, got {text!r}")
    return list(dict.fromkeys(values))


def is_config_path(name: str) -> bool:
    """Whether a shape's name is a path: a transformers config.json or a model directory (one without
    a config.json gets transformers' error when read)."""
    try:
        return Path(name).exists()
    except OSError:  # a name too long for a path, say: no path
        return False


def config_file(name: str) -> Path:
    """The config file a path names: ``dir``, ``dir/`` and ``dir/config.json`` alike, links followed
    (the Hugging Face cache's files are links into its blobs)."""
    path = Path(name)
    return (path / "config.json" if path.is_dir() else path).resolve()


def note(text: str) -> None:
    """A remark beside the report (a name taken otherwise than given, a warning, the file written):
    on stderr, so that stdout holds the tables and readings alone, as every tool prints them. stdout
    is flushed first: piped, it is buffered where stderr is not, and both streams led to one file
    showed the note before the table printed above it."""
    sys.stdout.flush()
    print(text, file=sys.stderr)


def options_given(parser: argparse.ArgumentParser, args, names) -> list:
    """Each of ``names`` (argparse dests) that ``args`` sets otherwise than by default, as given:
    "--k 3"; for a note that says they go unused."""
    return [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in names
            if getattr(args, name) != parser.get_default(name)]


def note_unused_draft_options(options: list, modes: str) -> None:
    """Says that ``options`` (flags as given, e.g. "--head flashhead") go unused: the modes of
    ``modes`` (a comma list) run no draft."""
    if options:
        note(f"{', '.join(options)}: the draft runs in the speculative modes only, and --mode {modes} names none")


def note_shadowed_paths(flag: str, names: list, is_named) -> None:
    """Says where a shape's name is both a name ``is_named`` takes (a preset; ``4000x64``) and a path
    (a model downloaded to a directory named so): the name is what runs."""
    for name in names:
        if is_named(name) and is_config_path(name):
            note(f"{flag} {name}: the named shape, not the path {name!r} (give ./{name} for the path)")


def model_config(parser: argparse.ArgumentParser, flag: str, path: str):
    """The transformers config at ``path`` (a config.json or a model directory holding one), or a
    usage error naming ``flag``; a note where it quantizes its weights, which the benchmarks'
    random weights do not."""
    try:
        from transformers import AutoConfig
    except ImportError as error:
        parser.error(f"{flag} {path}: reading a config file needs transformers, which is not importable ({error}): "
                     "pip install 'transformers>=5,<6'")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # any unreadable or inconsistent config
        parser.error(f"{flag} {path}: {type(error).__name__}: {error}")
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else type(quantization).__name__
        note(f"{path}: its quantization ({method}) is not timed: the weights are random and unquantized")
    return config


def first_of_each(flag: str, names: list, key, what: str) -> list:
    """``names`` without those whose ``key(name)`` an earlier one has: a configuration named twice,
    under two spellings, runs once, under its first name, and a note says so (``what``: what the
    two share)."""
    first_names: dict = {}
    for name in names:
        first = first_names.setdefault(key(name), name)
        if first != name:
            note(f"{flag} {name}: {what} as {first}, run once under that name")
    return list(first_names.values())


def shape_names(parser: argparse.ArgumentParser, flag: str, text: str, presets, other_help: str,
                is_pattern=lambda name: False) -> list:
    """The comma list of shapes ``text``: each a preset, a name ``is_pattern`` takes or a config
    path (a parser error names any other); a name that is also a path is noted, and a config under
    two spellings runs once, under its first. A whole ``text`` that is a config path with a comma
    in it is that one path."""
    def is_named(name: str) -> bool:
        return name in presets or is_pattern(name)

    if "," in text and is_config_path(text.strip()):
        picked = [text.strip()]
    else:
        picked = choices_list(parser, text, presets, "shape", other=lambda name: is_named(name) or is_config_path(name),
                              other_help=other_help)
    note_shadowed_paths(flag, picked, is_named)
    return first_of_each(flag, picked, lambda name: name if is_named(name) else config_file(name), "the same config file")


def choices_list(parser: argparse.ArgumentParser, names: str, choices, what: str, other=None, other_help: str = "") -> list:
    """The comma list ``names``, each one of ``choices`` or a name ``other`` accepts (a parser
    error names the bad one and what is taken: ``choices``, or ``other_help``); a repeated name
    runs once."""
    taken = f"{sorted(choices)}" + (f" or {other_help}" if other_help else "")
    picked = [name.strip() for name in names.split(",") if name.strip()]
    if not picked:
        parser.error(f"no {what} given; choose from {taken}")
    for name in picked:
        if name not in choices and not (other is not None and other(name)):
            parser.error(f"unknown {what} {name!r}; choose from {taken}")
    return list(dict.fromkeys(picked))
