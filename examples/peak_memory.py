"""Peak training memory from TensorFlow's own allocator, one run per process.

`examples/train.py` and `benchmarks/bench_memory.py` measure memory the same
way: each run in a fresh process (a peak is per process, so two runs in one
would mix), TensorFlow's allocator statistics for the device that trains.

    import peak_memory

    def run(config, queue):
        peak_memory.prepare_process(config["device"])   # before TensorFlow
        import tensorflow as tf
        device = peak_memory.memory_device(tf)
        ...build and compile...
        tf.config.experimental.reset_memory_stats(device)
        model.fit(...)
        queue.put(tf.config.experimental.get_memory_info(device)["peak"])

    peak = peak_memory.run_in_process(run, config)
"""

import multiprocessing
import os
import queue as _queue

DEVICES = ("auto", "cpu", "gpu")


def prepare_process(device="auto"):
    """Sets what must be set before TensorFlow is imported in this process.

    TensorFlow's CPU allocator keeps no peak-memory statistics unless it is
    the BFC allocator, or oneDNN (on by default only on some CPUs) is on;
    GPU allocators always keep them.

    Args:
        device: `"auto"` (a GPU when TensorFlow sees one), `"cpu"` (GPUs
            hidden from this process) or `"gpu"`.

    Raises:
        ValueError: if `device` is not one of those.
    """
    if device not in DEVICES:
        raise ValueError(
            f"`device` must be one of {DEVICES}. Received: device={device!r}"
        )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"


def memory_device(tf, device="auto"):
    """The device whose allocator to read: `"GPU:0"` or `"CPU:0"`.

    Args:
        tf: The `tensorflow` module, imported after `prepare_process`.
        device: As for `prepare_process`.

    Returns:
        The device name for `tf.config.experimental.get_memory_info`.

    Raises:
        RuntimeError: if `device="gpu"` and TensorFlow sees no GPU.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if device == "gpu" and not gpus:
        raise RuntimeError("`device='gpu'` was asked for, and no GPU is seen.")
    return "GPU:0" if gpus and device != "cpu" else "CPU:0"


def run_in_process(target, *args):
    """Runs `target(*args, queue)` in a fresh process; returns what it put.

    Args:
        target: A module-level function that puts one result on the queue
            it is given last.
        *args: Its other arguments (picklable).

    Returns:
        The object `target` put on the queue.

    Raises:
        RuntimeError: if the process exits without putting a result (its
            error is printed above by the process itself).
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    result = result_of(process, queue)
    process.join(timeout=60)
    return result


def result_of(process, queue):
    """What `process` put on `queue`; raises as soon as it died without."""
    while True:
        try:
            return queue.get(timeout=1)
        except _queue.Empty:
            if not process.is_alive():
                raise RuntimeError(
                    f"The training process exited with code "
                    f"{process.exitcode} without a result (its error is "
                    "above)."
                ) from None
