"""Evaluation CLIs: ``python -m flashhead_ext.eval quality`` (see :mod:`flashhead_ext.eval.quality`)."""
