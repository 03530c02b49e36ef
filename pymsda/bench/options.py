"""The command-line options the operator's bench and the model bench share."""
import argparse

import torch

from .. import has_cuda

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}


def default_device():
    return "cuda" if torch.cuda.is_available() and has_cuda() else "cpu"


def checked_device(parser, device):
    """--device's value, or the default; a parser error where cuda cannot run pymsda's kernels."""
    device = device or default_device()
    if device == "cuda" and not (torch.cuda.is_available() and has_cuda()):
        parser.error("--device cuda needs a GPU visible to torch and a libpymsda built with CUDA "
                     "kernels (see python -m pymsda info)")
    return device


def comma_list(allowed):
    def parse(text):
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return items
    return parse
