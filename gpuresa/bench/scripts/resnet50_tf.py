"""gpuresa bench's TensorFlow workload: ResNet-50 training throughput on synthetic images.

In the manner of tf_cnn_benchmarks: `tf.keras.applications.ResNet50` (no
weights) trained with SGD on a batch of random 224×224 images, in a
`tf.function` training step; after `--warmup` untimed steps, `--steps` steps
are timed. With `--gpus N` it trains on the first N visible GPUs (one GPU: a
OneDeviceStrategy; several: MirroredStrategy, `--batch-size` images per GPU).
`--gpus 0` trains on the CPU (for a quick check only). It prints

    framework: tensorflow 2.16.1, 1 GPU(s) visible
    workload: resnet50 batch=64/GPU steps=40 precision=fp32 parallel=mirrored gpus=2
    result: 1234.5 images/s

Exit codes: 3 when TensorFlow is missing, 4 when fewer GPUs are visible than asked.
`--check` stops after the framework line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

MISSING_FRAMEWORK = 3
TOO_FEW_GPUS = 4


def train(tf: Any, arguments: argparse.Namespace) -> float:
    """Train and return images per second."""
    gpus = arguments.gpus
    if arguments.precision == "amp":
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
    if gpus > 1:
        strategy = tf.distribute.MirroredStrategy(
            devices=[f"/gpu:{index}" for index in range(gpus)]
        )
    else:
        strategy = tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
    replicas = max(gpus, 1)
    global_batch = arguments.batch_size * replicas
    size = arguments.image_size
    with strategy.scope():
        model = tf.keras.applications.ResNet50(
            weights=None, input_shape=(size, size, 3), classes=1000
        )
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        loss_function = tf.keras.losses.SparseCategoricalCrossentropy(
            reduction=tf.keras.losses.Reduction.NONE
        )
    tf.random.set_seed(1234)
    images = tf.random.uniform((global_batch, size, size, 3))
    labels = tf.random.uniform((global_batch,), maxval=1000, dtype=tf.int32)
    dataset = (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .batch(global_batch, drop_remainder=True)
        .cache()
        .repeat()
    )
    batches = iter(strategy.experimental_distribute_dataset(dataset))

    def replica_step(inputs: Any, targets: Any) -> Any:
        with tf.GradientTape() as tape:
            predictions = model(inputs, training=True)
            losses = loss_function(targets, tf.cast(predictions, tf.float32))
            loss = tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function  # type: ignore[misc]
    def step(batch: Any) -> Any:
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    loss = None
    for _ in range(arguments.warmup):
        loss = step(next(batches))
    if loss is not None:
        loss.numpy()  # waits for the device
    started = time.perf_counter()
    for _ in range(arguments.steps):
        loss = step(next(batches))
    assert loss is not None
    loss.numpy()
    elapsed = time.perf_counter() - started
    return float(arguments.steps * global_batch / elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to train on (0: the CPU)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per GPU and step")
    parser.add_argument("--steps", type=int, default=40, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", choices=("fp32", "amp"), default="fp32")
    parser.add_argument("--check", action="store_true", help="print the framework line and stop")
    arguments = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError as error:
        print(f"error: TensorFlow is not installed for {sys.executable} ({error})", file=sys.stderr)
        return MISSING_FRAMEWORK
    devices = tf.config.list_physical_devices("GPU")
    for device in devices:
        # several processes (host and container runs) never hold all the memory at once
        tf.config.experimental.set_memory_growth(device, True)
    print(f"framework: tensorflow {tf.__version__}, {len(devices)} GPU(s) visible", flush=True)
    if arguments.gpus > len(devices):
        print(
            f"error: {arguments.gpus} GPU(s) asked, {len(devices)} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            file=sys.stderr,
        )
        return TOO_FEW_GPUS
    if arguments.check:
        return 0
    parallel = "mirrored" if arguments.gpus > 1 else "single"
    print(
        f"workload: resnet50 batch={arguments.batch_size}/GPU steps={arguments.steps} "
        f"precision={arguments.precision} parallel={parallel} gpus={arguments.gpus}",
        flush=True,
    )
    print(f"result: {train(tf, arguments):.2f} images/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
