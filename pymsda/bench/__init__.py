"""python -m pymsda bench: the operator against the pure-PyTorch reference (op.py), or with
--models a training step of whole models (models.py); command.py is the command line, inputs.py
draws the problems of shapes.json, timing.py times them, report.py prints and writes the results."""
from .command import main  # noqa: F401
from .op import run  # noqa: F401

__all__ = ["main", "run"]
