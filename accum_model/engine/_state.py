"""The window's state, declared once and saved by name.

Every variable a `GradientAccumulator` keeps (its own, the noise scale's,
AdaScale's, the `AccumBatchNormalization` layers' window moments) is
declared in the tables below, with its name, dtype, aggregation and role,
and created by `WindowState.declare`. Saving, restoring, resetting and the
memory count all read the one `WindowState`:

- `window`: zero when no window is open; zeroed when a window ends.
- `lifetime`: kept across windows (counters, moving averages, the
  accumulators, which the next window's first micro-batch overwrites).
- `setting`: a setting held as a variable so that changing it does not
  retrace; a model restores it from its config, so it is not saved.
- `batch`: a batch on its way into the window (`_contribution`): zero
  between batches, so never saved.

A file holds each saved variable under its name (`save`) and the format's
version (`FORMAT_VERSION`); `load` matches by name and refuses a file that
lacks an entry this state needs or holds one it does not know, naming it.
Variables of the model (an accumulator, the flag of whether it received a
gradient, a BatchNorm layer's window moments) are keyed by their place in
the model's structure, as Keras keys a model's weights: the path of the
variable (or layer) with each auto-generated name (`dense_4`) replaced by
its base and its place under the same parent, in the model's order
(`dense_0`, `accum_batch_normalization_1`, `dense_2`). So a file
loads into the same network built again, whatever counter Keras' names
came from, and two variables of the same shape that changed places are
matched by their place, never crosswise (`structure_keys`).

Formats (`load` reads them all):

- 0: a list, keys "0", "1", ... (accum_model 0.1.0 up to 8a65589), read
  through the frozen order `_POSITION_ORDER`.
- 1: by name, the model's items keyed `group.0003.<Keras' path>` (up to
  c236af7); no version entry.
- 2: by name, the model's items keyed by structure; `format_version`.

An entry a later format adds (`Entry.since`) takes its initial value where
an older file lacks it: exact, since each is a counter that starts at zero
or belongs to a feature the file's model did not have. A file of the same
or a later format that lacks an entry is refused.

This module knows TensorFlow only.
"""

import collections
import re

import numpy as np
import tensorflow as tf

SUM = tf.VariableAggregation.SUM
FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA

WINDOW = "window"
LIFETIME = "lifetime"
SETTING = "setting"
BATCH = "batch"

# The format `save` writes (see the module).
FORMAT_VERSION = 2
VERSION_KEY = "format_version"

Entry = collections.namedtuple(
    "Entry", ["name", "dtype", "aggregation", "role", "initial", "since"]
)
Entry.__new__.__defaults__ = (0, 1)
Entry.__doc__ = """One state variable, as the tables declare it.

`aggregation`: under a strategy the variables are per-replica, summed on
read (`SUM`, a replica's part of a global sum) or the first replica's
(`FIRST`, equal on every replica). `since`: the file format that first
saved it; an older file that lacks it loads it as `initial`.
"""

# The engine's own scalars.
ENGINE = (
    Entry("accum_steps", tf.int64, FIRST, SETTING),
    # The open window's length, latched when it opens, so that a new
    # `accum_steps` takes effect at the next window.
    Entry("micro_step", tf.int64, FIRST, WINDOW),
    Entry("contributed_steps", tf.int64, FIRST, WINDOW),
    Entry("weight_sum", tf.float32, SUM, WINDOW),
    Entry("window_steps", tf.int64, FIRST, LIFETIME),
    Entry("skipped_microbatches", tf.int64, FIRST, LIFETIME),
    Entry("discarded_windows", tf.int64, FIRST, LIFETIME),
)
# One of each per accumulated variable, of its shape (`received`: whether
# it ever received a gradient, one element of a vector over the variables).
ACCUMULATOR = Entry("accumulator", tf.float32, SUM, LIFETIME)
RECEIVED = Entry("received", tf.int64, FIRST, LIFETIME)
# A batch entering the window in slices (`_contribution`). `open`: 1 from
# the first addition of a batch to its end, so a batch cut short by an
# error is seen. `sums`: what its slices added so far (`BATCH_SUMS`), one
# vector written by one operation per slice, after the slice's additions.
# Per replica, like the accumulators.
BATCH_STATE = (
    Entry("open", tf.int64, FIRST, BATCH),
    Entry("sums", tf.float32, SUM, BATCH),
)
BATCH_SUMS = (
    # Rows whose slices are in: added, or left out as not finite.
    "rows",
    # The weight of the added slices, and of all (for the logged loss).
    "weight",
    "loss_weight",
    "weighted_loss",
    # The noise scale's sums of the added slices.
    "squared_norm_sum",
    "micro_batches",
    "added",
    "non_finite",
)
# Per accumulated variable: the row up to which it holds the open batch's
# gradient (a batch that may be run again after an out-of-memory error).
ROWS_ADDED = Entry("rows_added", tf.int64, FIRST, BATCH)
# `_noise_scale.NoiseScaleEstimator`.
NOISE_SCALE = (
    Entry("squared_norm_sum", tf.float32, SUM, WINDOW),
    Entry("micro_batches", tf.float32, SUM, WINDOW),
    Entry("windows", tf.int64, FIRST, LIFETIME),
    Entry("measurements", tf.float32, FIRST, LIFETIME),
    Entry("ema_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("ema_grad_sq_norm", tf.float32, FIRST, LIFETIME),
    Entry("ema_window_weight", tf.float32, FIRST, LIFETIME),
    Entry("ema_micro_batch_weight", tf.float32, FIRST, LIFETIME),
    Entry("last_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("last_grad_sq_norm", tf.float32, FIRST, LIFETIME),
)
# `_adascale.AdaScaleState`: equal on every replica.
ADASCALE = (
    Entry("tau", tf.float64, FIRST, LIFETIME),
    Entry("gain", tf.float32, FIRST, LIFETIME, 1.0),
    Entry("learning_rate", tf.float32, FIRST, LIFETIME),
)
# `AccumBatchNormalization`'s window moments, per channel, in the dtype
# the layer computes them in (None here).
BATCHNORM = (
    Entry("count", None, FIRST, WINDOW),
    Entry("mean", None, FIRST, WINDOW),
    Entry("variance", None, FIRST, WINDOW),
)


_LENGTHS = ("accum_steps", "window_steps")


def declare_engine(state, variables, accum_steps):
    """Declares a `GradientAccumulator`'s own variables in `state`.

    Args:
        state: The engine's `WindowState`.
        variables: The variables whose gradients it accumulates.
        accum_steps: Int, the initial window length.

    Returns:
        `(engine, accumulators, received, batch)`: a dict from `ENGINE`'s
        names to variables, one accumulator per variable, the `received`
        vector, and a dict of the batch state: `BATCH_STATE`'s names, and
        `rows_added`, one per variable.
    """
    engine = {
        e.name: state.declare(
            f"engine/{e.name}",
            e,
            initial=accum_steps if e.name in _LENGTHS else None,
        )
        for e in ENGINE
    }
    paths = [variable_path(v) for v in variables]
    accumulators = [
        state.declare(item_name("accumulator", i, p), ACCUMULATOR, v.shape)
        for i, (v, p) in enumerate(zip(variables, paths))
    ]
    received = state.declare_vector(
        "received",
        RECEIVED,
        [item_name("received", i, p) for i, p in enumerate(paths)],
    )
    batch = {
        e.name: state.declare(
            f"batch/{e.name}",
            e,
            shape=(len(BATCH_SUMS),) if e.name == "sums" else (),
        )
        for e in BATCH_STATE
    }
    batch["rows_added"] = [
        state.declare(item_name("rows_added", i, p), ROWS_ADDED)
        for i, p in enumerate(paths)
    ]
    return engine, accumulators, received, batch


def variable_path(variable):
    """A variable's path in its model: Keras 3's `path`, else its name."""
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def item_name(group, index, path):
    """The name of a model item: `group/0003/path`."""
    return f"{group}/{index:04d}/{path}"


class WindowState(tf.Module):
    """Every variable of one engine's state, by name, in declaration order.

    Args:
        name: Name of the module.
    """

    def __init__(self, name="state"):
        super().__init__(name=name)
        self._variables = {}
        self._entries = {}
        # For the per-variable `received` vector: the names of its elements.
        self._vector_items = {}
        self._items = {}
        # Declared by layers (`declare_item`): written by their forward
        # pass.
        self._item_variables = []
        # The dotted paths of all of the model's weights, in its order
        # (`place_items_in`).
        self._structure = None

    def declare(self, name, entry, shape=(), dtype=None, initial=None):
        """Creates the variable `name` of `entry`, eagerly.

        Args:
            name: Str, unique in this state (`group/entry` by convention).
            entry: Its `Entry`.
            shape: Its shape.
            dtype: Its dtype, where `entry.dtype` is None.
            initial: Its initial value, where not `entry.initial`.

        Returns:
            The `tf.Variable`.

        Raises:
            ValueError: If `name` is declared already.
        """
        if name in self._variables:
            raise ValueError(f"State variable {name!r} is declared twice.")
        dtype = entry.dtype or dtype
        with tf.init_scope():
            variable = tf.Variable(
                tf.fill(
                    shape,
                    tf.constant(
                        entry.initial if initial is None else initial, dtype
                    ),
                ),
                trainable=False,
                name=name.replace("/", "_"),
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=entry.aggregation,
            )
        self._variables[name] = variable
        self._entries[name] = entry
        return variable

    def declare_group(self, group, entries, shape=(), dtype=None):
        """Declares `group/<entry name>` for each of `entries`.

        Returns:
            A dict from entry name to variable.
        """
        return {
            e.name: self.declare(f"{group}/{e.name}", e, shape, dtype)
            for e in entries
        }

    def declare_item(self, group, path, entries, shape, dtype):
        """Declares `entries` for the next item of `group` (a layer).

        Named `group/<index>/path/<entry>`, the index counting the items of
        `group` in the order they are declared.

        Returns:
            A dict from entry name to variable.
        """
        self._items[group] = index = self._items.get(group, -1) + 1
        declared = self.declare_group(
            item_name(group, index, path), entries, shape, dtype
        )
        self._item_variables.extend(declared.values())
        return declared

    def declare_vector(self, name, entry, item_names):
        """Declares a vector with one element per item, saved per item.

        Args:
            name: The vector's name.
            entry: Its `Entry`.
            item_names: One name per element (saved as `name` of each).

        Returns:
            The `tf.Variable`.
        """
        variable = self.declare(name, entry, shape=(len(item_names),))
        self._vector_items[name] = list(item_names)
        return variable

    @property
    def variables(self):
        """Every variable, in declaration order."""
        return list(self._variables.values())

    def names(self, role=None):
        """The names of the variables (of `role`), in declaration order."""
        return [
            n
            for n in self._variables
            if role is None or self._entries[n].role == role
        ]

    def get(self, name):
        """The variable `name`."""
        return self._variables[name]

    def item_variables(self):
        """The variables layers declared, which their forward pass writes."""
        return list(self._item_variables)

    def window_variables(self):
        """The variables zeroed when a window ends."""
        return [self._variables[n] for n in self.names(WINDOW)]

    def batch_variables(self):
        """The variables of a batch in progress, zero between batches."""
        return [self._variables[n] for n in self.names(BATCH)]

    def saved_variables(self):
        """The variables a checkpoint holds: neither settings nor batches."""
        return [v for _, v in self._saved()]

    # Files

    def place_items_in(self, paths):
        """Keys the model's items by their place among `paths`.

        Args:
            paths: The paths (`variable_path`) of all of the model's
                weights, trainable or not, in the model's order: the places
                a frozen layer keeps, so that the items of the layers after
                it keep their keys when it is frozen or thawed.
        """
        self._structure = [file_key(p) for p in paths]

    def save(self, store):
        """Writes every saved variable into the dict-like `store`.

        Keyed by name, the model's items by structure (`structure_keys`),
        with the format's version.
        """
        store[VERSION_KEY] = np.int64(FORMAT_VERSION)
        keys = structure_keys(self._dotted_keys(), self._structure)
        for name, variable in self._saved():
            for key, value in self._split(name, variable.numpy()).items():
                store[keys[key]] = value

    def load(self, store):
        """Assigns every saved variable from `store`, of any format.

        Nothing is assigned unless every entry matches.

        Raises:
            ValueError: If `store` lacks an entry this state saves (one its
                format already had), holds one it does not know, or holds
                one of another shape.
        """
        saved, version, origin = _read(self, store)
        # Files before format 2 ranked the items among themselves.
        structure = structure_keys(
            self._dotted_keys(), self._structure if version >= 2 else None
        )
        found = {}
        for name, variable in self._saved():
            entry = self._entries[name]
            for dotted in self._keys(name):
                key = structure[dotted]
                shape = () if name in self._vector_items else variable.shape
                found[dotted] = _matched(
                    saved, key, tuple(shape), entry, version, origin
                )
        unknown = sorted(
            origin[k] for k in set(saved) - set(structure.values())
        )
        if unknown:
            raise ValueError(
                "The saved accumulation state holds entries this model does "
                f"not know: {unknown}. It was saved by a model with other "
                "accumulation settings (`noise_scale`, `adascale`, "
                "AccumBatchNormalization layers) or other trainable variables."
            )
        for name, variable in self._saved():
            if name in self._vector_items:
                value = [found[k] for k in self._keys(name)]
            else:
                value = found[file_key(name)]
            variable.assign(
                np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
            )

    def _saved(self):
        return [
            (n, v)
            for n, v in self._variables.items()
            if self._entries[n].role not in (SETTING, BATCH)
        ]

    def _dotted_keys(self):
        """The dotted keys of every saved variable, vector elements apart."""
        return [k for name, _ in self._saved() for k in self._keys(name)]

    def _keys(self, name):
        """The dotted keys of `name`: its own, or one per vector element."""
        items = self._vector_items.get(name)
        return [file_key(n) for n in ([name] if items is None else items)]

    def _split(self, name, value):
        """`{dotted key: array}` of variable `name` holding `value`."""
        if name in self._vector_items:
            return dict(zip(self._keys(name), value))
        return {file_key(name): value}


def file_key(name):
    """A name, dotted (Keras' stores take no `/` in a key): format 1's key."""
    return name.replace("/", ".")


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
        converted.update(state._split(name, np.asarray(store[str(i)])))
    return converted


def _position_layout_order(state):
    """This state's saved names in format 0's order (`_POSITION_ORDER`)."""
    saved = [n for n, _ in state._saved()]
    order = []
    for name in _POSITION_ORDER:
        if name.endswith("/*"):
            order += [n for n in saved if n.startswith(name[:-1])]
        elif name in saved:
            order.append(name)
    return order
