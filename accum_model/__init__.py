"""Gradient accumulation for Keras models, exactly equal to large batches."""

from accum_model._accumulator import GradientAccumulator
from accum_model._model import AccumModel

__all__ = ["AccumModel", "GradientAccumulator"]
__version__ = "0.1.0"
