"""Gradient accumulation for Keras models, exactly equal to large batches.

The package is four layers, each a folder that imports only from the ones
below it: `model` (`AccumModel`, `accumulate`, the split inside the step,
`"auto"`, the epoch end, resuming, the warm-up, BatchNorm), `engine`
(`GradientAccumulator`: a micro-batch into the window, the window out
through the optimizer, its state declared and saved by name), `keras` (the
adapter, the one place Keras 3 and tf_keras differ, with the version gate,
the private Keras names and the clone hook) and `core` (TensorFlow control
flow and argument checks). docs/README.md has the table of files.
"""

from accum_model.engine._accumulator import GradientAccumulator
from accum_model.engine._adascale import AdaScale
from accum_model.engine._noise_scale import NoiseScale
from accum_model.model._accumulate import accumulate
from accum_model.model._batchnorm import AccumBatchNormalization
from accum_model.model._batchnorm import replace_batchnorm
from accum_model.model._model import AccumModel
from accum_model.model._plain import save_plain
from accum_model.model._resume import ResumableBackup
from accum_model.model._warmup import AccumStepsWarmup

__all__ = [
    "AccumBatchNormalization",
    "AccumModel",
    "AccumStepsWarmup",
    "AdaScale",
    "GradientAccumulator",
    "NoiseScale",
    "ResumableBackup",
    "accumulate",
    "replace_batchnorm",
    "save_plain",
]
__version__ = "0.2.0"
