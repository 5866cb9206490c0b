"""Gradient accumulation for Keras models, exactly equal to large batches."""

from accum_model._accumulate import accumulate
from accum_model._accumulator import GradientAccumulator
from accum_model._batchnorm import AccumBatchNormalization
from accum_model._batchnorm import replace_batchnorm
from accum_model._model import AccumModel
from accum_model._noise_scale import NoiseScale
from accum_model._plain import save_plain
from accum_model._resume import ResumableBackup
from accum_model._warmup import AccumStepsWarmup

__all__ = [
    "AccumBatchNormalization",
    "AccumModel",
    "AccumStepsWarmup",
    "GradientAccumulator",
    "NoiseScale",
    "ResumableBackup",
    "accumulate",
    "replace_batchnorm",
    "save_plain",
]
__version__ = "0.1.0"
