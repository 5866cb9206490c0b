"""The files of a window's state: writing, and reading every format.

Formats (`read` reads them all):

- 0: a list, keys "0", "1", ... (accum_model 0.1.0 up to 8a65589), read
  through the frozen order `_POSITION_ORDER`.
- 1: by name, the model's items keyed `group.0003.<Keras' path>` (up to
  c236af7); no version entry.
- 2: by name, the model's items keyed by structure (`structure_keys`);
  `format_version`.

The model's items are keyed by their place in the model's structure
(`structure_keys`): a file loads into the same network built again,
whatever counter Keras' names came from, and two variables of the same
shape that changed places are matched by their place, never crosswise.
An entry a later format adds (`Entry.since`) takes its initial value where
an older file lacks it: exact, since each is a counter that starts at zero
or belongs to a feature the file's model did not have. A file of the same
or a later format that lacks an entry is refused. Works on a `WindowState`
through its public methods.
"""

import re

import numpy as np

# The format `write` writes.
FORMAT_VERSION = 2
VERSION_KEY = "format_version"


def write(state, store):
    """Writes every saved variable of `state` into the dict-like `store`."""
    store[VERSION_KEY] = np.int64(FORMAT_VERSION)
    keys = structure_keys(state.dotted_keys(), state.structure)
    for name, variable in state.saved():
        for key, value in state.split(name, variable.numpy()).items():
            store[keys[key]] = value


def read(state, store):
    """The value of each of `state`'s saved variables in `store`.

    Returns:
        `[(variable, value)]`, every saved variable's, once all matched.

    Raises:
        ValueError: As `WindowState.load`.
    """
    saved, version, origin = _read(state, store)
    # Files before format 2 ranked the items among themselves.
    structure = structure_keys(
        state.dotted_keys(), state.structure if version >= 2 else None
    )
    found = {}
    for name, variable in state.saved():
        entry = state.entry(name)
        shape = () if state.is_vector(name) else tuple(variable.shape)
        for dotted in state.keys(name):
            found[dotted] = _matched(
                saved, structure[dotted], shape, entry, version, origin
            )
    unknown = sorted(origin[k] for k in set(saved) - set(structure.values()))
    if unknown:
        raise ValueError(
            "The saved accumulation state holds entries this model does "
            f"not know: {unknown}. It was saved by a model with other "
            "accumulation settings (`noise_scale`, `adascale`, "
            "AccumBatchNormalization layers) or other trainable variables."
        )
    values = []
    for name, variable in state.saved():
        keys = state.keys(name)
        if state.is_vector(name):
            values.append((variable, [found[k] for k in keys]))
        else:
            values.append((variable, found[keys[0]]))
    return values


# A model item's dotted key: group, index, path (and, for a layer's item,
# the entry).
_ITEM = re.compile(r"^(accumulator|received|batchnorm)\.(\d{4})\.(.+)$")
# Keras' auto-generated names: a base and a counter.
_COUNTER = re.compile(r"_\d+$")


def structure_keys(dotted_keys, structure=None):
    """`{dotted key: key by structure}` for the keys of one state.

    Each item's path is rewritten, component by component, to the base of
    its name (the name without a trailing `_<counter>`) and its place among
    the distinct names under the same parent, in the model's order: the
    paths of `structure` first, then the accumulators' variables by index,
    then the layers' items by index (`dense_4/kernel` becomes `dense_2.
    kernel_0` for the third layer), after the leading components all of
    them share (the model's own scope, in the paths or not depending on how
    Keras built it). The same network, built again, gets the same keys
    whatever its names' counters. Two layers that changed places
    get other keys: refused, never loaded crosswise, where Keras, which
    loads the weights by place, would give each the other's weights. Other
    keys are left as they are.

    Args:
        dotted_keys: The dotted keys (format 1) of a state or of a file.
        structure: None, or the dotted paths of all of the model's weights
            in its order (`WindowState.place_items_in`).

    Returns:
        A dict from each of `dotted_keys` to its key by structure.
    """
    items = []
    for key in dotted_keys:
        m = _ITEM.match(key)
        if m:
            group, index, rest = m.groups()
            parts = tuple(rest.split("."))
            path, entry = (
                (parts[:-1], parts[-1:])
                if group == "batchnorm"
                else (parts, ())
            )
            items.append(
                (
                    group != "accumulator",
                    group == "batchnorm",
                    int(index),
                    key,
                    group,
                    path,
                    entry,
                )
            )
    canonical = {}
    ranks = {}
    paths = [tuple(p.split(".")) for p in structure or ()]
    paths += [i[5] for i in sorted(items, key=lambda i: i[:3])]
    # What every path starts with is the model's own scope, which Keras
    # puts in the paths or not depending on how the model was built.
    common = len(_common_prefix([p[:-1] for p in paths])) if paths else 0
    prefix = paths[0][:common] if paths else ()

    def inside(path):
        return path[common:] if path[:common] == prefix else path

    for path in map(inside, paths):
        parent = ()
        for depth in range(len(path)):
            raw = path[: depth + 1]
            if raw not in canonical:
                base = _COUNTER.sub("", path[depth]) or path[depth]
                rank = ranks[parent] = ranks.get(parent, -1) + 1
                canonical[raw] = parent + (f"{base}_{rank}",)
            parent = canonical[raw]
    out = {key: key for key in dotted_keys}
    taken = set()
    for *_, key, group, path, entry in items:
        new = ".".join((group,) + canonical[inside(path)] + entry)
        # Two paths the same (not from Keras): told apart by their order.
        while new in taken:
            new += "~"
        taken.add(new)
        out[key] = new
    return out


def _common_prefix(paths):
    """The leading components all of `paths` (tuples) share."""
    first = paths[0]
    n = min(len(p) for p in paths)
    for i in range(n):
        if any(p[i] != first[i] for p in paths):
            return first[:i]
    return first[:n]


def _read(state, store):
    """The entries of `store` by structure key, its format, their origins.

    Returns:
        `(saved, version, origin)`: `{key by structure: array}`, the
        file's format, and `{key by structure: the file's own key}`.
    """
    keys = [k for k in store.keys() if k != VERSION_KEY]
    if VERSION_KEY in store.keys():
        version = int(np.asarray(store[VERSION_KEY]))
        if version > FORMAT_VERSION:
            raise ValueError(
                "The saved accumulation state was written by a later "
                f"accum_model (file format {version}; this one reads up to "
                f"{FORMAT_VERSION}). Upgrade accum_model to load it."
            )
        arrays = {k: np.asarray(store[k]) for k in keys}
        return arrays, version, {k: k for k in keys}
    if keys and all(k.isdigit() for k in keys):
        arrays = _from_position_layout(state, store, keys)
        structure = structure_keys(list(arrays))
        return (
            {structure[k]: a for k, a in arrays.items()},
            0,
            {structure[k]: k for k in arrays},
        )
    structure = structure_keys(keys)
    return (
        {structure[k]: np.asarray(store[k]) for k in keys},
        1,
        {structure[k]: k for k in keys},
    )


def _matched(saved, key, shape, entry, version, origin):
    """The saved array of `key`, its default, or a `ValueError`."""
    if key not in saved:
        if entry.since > version:
            # Added after the file's format: the value it starts at.
            return np.full(shape, entry.initial)
        raise ValueError(
            "The saved accumulation state lacks the entry "
            f"{key!r}, which this model needs. It was saved by a model with "
            "other accumulation settings (`noise_scale`, `adascale`, "
            "AccumBatchNormalization layers) or other trainable variables. "
            f"Received entries: {sorted(origin.values())}"
        )
    array = saved[key]
    if array.shape != shape:
        raise ValueError(
            f"The saved accumulation state entry {origin[key]!r} has shape "
            f"{array.shape}, but this model's {key!r} has shape {shape}."
        )
    return array


# Format 0 (accum_model 0.1.0 up to 8a65589): the state as a list, in this
# order, frozen as that release wrote it. "*" stands for each item of the
# group in index order; a group of a feature that was off is absent.
_POSITION_ORDER = (
    "engine/micro_step",
    "engine/contributed_steps",
    "engine/weight_sum",
    "noise_scale/squared_norm_sum",
    "noise_scale/micro_batches",
    "batchnorm/*",
    "engine/window_steps",
    "accumulator/*",
    "engine/skipped_microbatches",
    "engine/discarded_windows",
    "received",
    "noise_scale/windows",
    "noise_scale/measurements",
    "noise_scale/ema_trace_sigma",
    "noise_scale/ema_grad_sq_norm",
    "noise_scale/ema_window_weight",
    "noise_scale/ema_micro_batch_weight",
    "noise_scale/last_trace_sigma",
    "noise_scale/last_grad_sq_norm",
    "adascale/tau",
    "adascale/gain",
    "adascale/learning_rate",
)


def _from_position_layout(state, store, keys):
    """A format-0 file (keys "0", "1", ...) as `{dotted key: array}`.

    Its length fixes which features were on; a count that fits no order of
    this state is refused.
    """
    names = _position_layout_order(state)
    if len(keys) != len(names):
        raise ValueError(
            "The saved accumulation state (written by accum_model before "
            "2026-12-06, by position) does not match this model: expected "
            f"{len(names)} variables, received {len(keys)}."
        )
    converted = {}
    for i, name in enumerate(names):
        converted.update(state.split(name, np.asarray(store[str(i)])))
    return converted


def _position_layout_order(state):
    """This state's saved names in format 0's order (`_POSITION_ORDER`)."""
    saved = [n for n, _ in state.saved()]
    order = []
    for name in _POSITION_ORDER:
        if name.endswith("/*"):
            order += [n for n in saved if n.startswith(name[:-1])]
        elif name in saved:
            order.append(name)
    return order
