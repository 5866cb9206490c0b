"""The adapter: everything that differs between Keras generations.

The engine and `AccumModel` call the one `ADAPTER` chosen here, never `if`
on the version: `_keras3.Keras3Adapter` or `_tf_keras.TfKerasAdapter`,
siblings on `_adapter_base.AdapterBase` (what both do alike). `keras` is
the full package of the generation in use (`_generation`).

Most private Keras names the package uses are used in those modules, each
with its reason where it is used; `_private_names` lists them all, module by
module.
"""

from accum_model.keras._generation import LEGACY
from accum_model.keras._generation import keras

if LEGACY:
    from accum_model.keras._tf_keras import TfKerasAdapter as _Adapter
else:
    from accum_model.keras._keras3 import Keras3Adapter as _Adapter

ADAPTER = _Adapter()

__all__ = ["ADAPTER", "LEGACY", "keras"]
