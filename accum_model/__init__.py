"""Gradient accumulation for Keras models, exactly equal to large batches.

The modules, in the order a micro-batch meets them: `_model` (`AccumModel`'s
`train_step`: forward pass, loss, and the weight from `_normalizers`; a
batch split into slices by `micro_batch_size` runs them in `_split`'s loop,
and `"auto"` through `_auto`'s train function; `evaluate` and `predict`
in slices through `_inference`), then
`_accumulator` (`GradientAccumulator`, the engine, its state declared in
`_state`): the micro-batch into the window (`_contribution`), then the
window out through the optimizer (`_close`), the optimizer's slots built
first (`_optimizers`); with the rules of
`_mixed_precision`, `_noise_scale`, `_adascale`, `_control_flow`, and the
apply hooks of `_batchnorm`. Around them: `_settings` (a model's settings
and the readings of its window), `_epoch_end` (partial windows at
epoch ends), `_model_engine` (the engine a model holds, saves and warns from),
`_model_classes` and `_accumulate` (how models become accumulating), `_plain`
(files for Keras alone), `_multi_worker`, `_resume`, `_warmup`,
`_validation`, and `_keras`, the one place Keras 3 and tf_keras differ, with
`_versions` (the oldest releases supported), `_private_names` (Keras
internals used, and why) and `_clone_hook` (the one patch of Keras).
docs/README.md has the table.
"""

from accum_model._accumulate import accumulate
from accum_model._accumulator import GradientAccumulator
from accum_model._adascale import AdaScale
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
    "AdaScale",
    "GradientAccumulator",
    "NoiseScale",
    "ResumableBackup",
    "accumulate",
    "replace_batchnorm",
    "save_plain",
]
__version__ = "0.2.0"
