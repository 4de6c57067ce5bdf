"""What the command-line tools share."""
from __future__ import annotations

import argparse

import torch


def doc_summary(doc: str) -> str:
    """A module docstring's first paragraph as a CLI description (without reST's double backticks)."""
    return doc.split("\n\n")[0].replace("``", "")


def device_arg(text: str) -> str:
    """argparse ``type`` of a device flag: a device torch can name and this machine has, so a bad one
    is a usage error before any model is built."""
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({error})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device{'s' if count > 1 else ''}")
    return text
