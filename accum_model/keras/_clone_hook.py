"""The package's one patch of Keras: what `clone_model` returns.

`keras.models.clone_model` never asks the model, or its class, how to clone
it. A Sequential is rebuilt as a literal `Sequential(layers, name=...)`
(`_clone_sequential_model`); a Functional by its graph, as
`model.__class__(inputs, outputs, name=...)` when the class has Functional's
constructor, else as a plain Functional (`_clone_functional_model`; Keras 3
takes this path for every Functional model, whatever its `get_config`).
Neither path calls anything of the original model that could pass its
settings on: the class is called with the graph alone, and the caller's
`clone_function` sees only layers. So, unpatched, the clone of an
accumulating Sequential is a plain Sequential, and that of an accumulating
Functional (`accumulate`d or a functional `AccumModel`) accumulates with
`accum_steps=1`, in Keras 3 and in tf_keras alike.

Hence the patch: both functions (private) are wrapped once, when
`accum_model` is imported, so that `hook(model, clone)` sees what they
return; the hook (`_accumulate`) leaves clones of other models alone.
`clone_model` looks them up by name at call time, so every import of it
sees the wrapped ones.
"""

_FUNCTIONS = ("_clone_sequential_model", "_clone_functional_model")


def install(cloning, hook):
    """Wraps the clone functions of the module `cloning` with `hook`.

    Args:
        cloning: The Keras generation's `clone_model` module
            (`ADAPTER.cloning_module`).
        hook: `hook(model, clone)`, returns the clone to use.
    """
    for name in _FUNCTIONS:
        original = getattr(cloning, name)
        if getattr(original, "_accum_model_hook", False):
            continue  # Wrapped already (the package imported again).
        setattr(cloning, name, _with_hook(original, hook))


def _with_hook(clone, hook):
    def clone_with_hook(model, *args, **kwargs):
        return hook(model, clone(model, *args, **kwargs))

    clone_with_hook._accum_model_hook = True
    clone_with_hook.__wrapped__ = clone
    return clone_with_hook
