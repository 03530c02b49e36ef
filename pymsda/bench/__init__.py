"""python -m pymsda bench: the operator against the pure-PyTorch reference (op.py), or with
--models a training step of whole models (models.py); inputs.py draws the problems of
shapes.json, timing.py times them, report.py prints and writes the results."""
from .op import main, run  # noqa: F401

__all__ = ["main", "run"]
