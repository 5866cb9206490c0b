"""`save_plain`: a file of an accumulating model that Keras alone loads.

An `AccumModel` is saved under `accum_model`'s class name, so loading it
needs `accum_model` imported. (A model made by `accumulate` keeps its own
class's name and module, which Keras alone loads as that plain class; see
docs/models.md.) For a service that only runs inference, `save_plain`
writes the model as the class it is without accumulation: the class it had
before `accumulate`, or Keras' Functional model for a functional
`AccumModel`, and never the window.
"""

from accum_model.keras import _adapter
from accum_model.model import _model_classes
from accum_model.model._model import AccumModel
from accum_model.model._model import training_state

ADAPTER = _adapter.ADAPTER


def save_plain(model, filepath, **kwargs):
    """Saves `model` so that Keras alone, without `accum_model`, loads it.

    ```python
    accum_model.save_plain(model, "model.keras")
    # elsewhere, without accum_model installed:
    model = keras.models.load_model("model.keras")
    ```

    The file names the model's own class (a `keras.Sequential`, a
    Functional `keras.Model`, a keras-hub task, your registered subclass),
    with its config, weights, compile settings and optimizer state, as
    `model.save` writes them for that class. Not saved: the accumulation
    settings and an open window of accumulated gradients (save with
    `model.save` to resume training). Layers of `accum_model`
    (`AccumBatchNormalization`) still need it to load.

    Args:
        model: An accumulating model: made by `accumulate`, or a functional
            `AccumModel`.
        filepath: Where to save, as `model.save` takes it (e.g. a `.keras`
            path).
        **kwargs: Passed to `model.save`.

    Raises:
        TypeError: If `model` is not an `AccumModel`.
        ValueError: If `model` is a subclassed `AccumModel`: its own class
            is the accumulating one (save its weights and load them into a
            plain model of the same layers).
    """
    if not isinstance(model, AccumModel):
        raise TypeError(
            "`model` must be an accumulating model (`accum_model.accumulate` "
            f"or `AccumModel`). Received: model of type {type(model).__name__}"
        )
    cls = type(model)
    plain = _model_classes.base_of(cls)
    if plain is cls:
        # Not made by `accumulate`: a functional `AccumModel` saves as the
        # Functional model of its graph; a subclassed one has no plain class.
        functional = isinstance(model, ADAPTER.functional_class)
        plain = ADAPTER.functional_class if functional else None
    if plain is None:
        raise ValueError(
            f"`model` is a subclassed `AccumModel` ({cls.__name__}), whose "
            "own class accumulates: there is no plain class to save it as. "
            "Build the model from a plain `keras.Model` subclass and call "
            "`accum_model.accumulate` on it, or save its weights and load "
            f"them into a plain model. Received: model of type {cls.__name__}"
        )
    with training_state(model).without_window():
        # Class surgery for the length of the save: Keras' saving names the
        # class from `model.__class__` and writes what its `get_config`
        # returns; the object itself (weights, optimizer state, compile
        # config) is what must be saved, so it is saved as `plain`.
        model.__class__ = plain
        try:
            model.save(filepath, **kwargs)
        finally:
            model.__class__ = cls
