"""gpuresa bench's PyTorch workload: ResNet-50 training throughput on synthetic images.

Runs with the Python of the host or of a session container, wherever PyTorch
is installed (torchvision is used when present, else the same ResNet-50 is
defined below). One training step is forward, loss, backward and an SGD
update on a batch of random 224×224 images; after `--warmup` untimed steps,
`--steps` steps are timed. With `--gpus N` it trains on the first N visible
GPUs: one GPU directly, several with DistributedDataParallel (one process per
GPU, NCCL, rendezvous on 127.0.0.1), or DataParallel with `--parallel dp`.
`--gpus 0` trains on the CPU (for a quick check only). It prints

    framework: torch 2.4.1 (CUDA 12.4), 1 GPU(s) visible: NVIDIA H100 80GB HBM3
    workload: resnet50 batch=64/GPU steps=40 precision=fp32 parallel=single gpus=1
    model: resnet50 (torchvision, 25557032 parameters)
    result: 1234.5 images/s

Exit codes: 3 when PyTorch is missing, 4 when fewer GPUs are visible than asked.
`--check` stops after the framework line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

MISSING_FRAMEWORK = 3
TOO_FEW_GPUS = 4


def resnet50(nn: Any, own: bool, classes: int = 1000) -> tuple[Any, str]:
    """ResNet-50 (v1.5: stride on the 3×3 convolution) and where it came from.

    torchvision's when it is installed and `own` is false, else the same
    network defined here (25,557,032 parameters either way).
    """
    if not own:
        try:
            import torchvision

            return torchvision.models.resnet50(num_classes=classes), "torchvision"
        except ImportError:
            pass

    class Bottleneck(nn.Module):  # type: ignore[misc]
        def __init__(self, inputs: int, width: int, stride: int) -> None:
            super().__init__()
            outputs = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(inputs, width, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, outputs, 1, bias=False),
                nn.BatchNorm2d(outputs),
            )
            self.shortcut = (
                nn.Identity()
                if stride == 1 and inputs == outputs
                else nn.Sequential(
                    nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
                )
            )
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.shortcut(x))

    layers: list[Any] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    inputs = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for index in range(blocks):
            layers.append(Bottleneck(inputs, width, stride if index == 0 else 1))
            inputs = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers), "own"


def train(arguments: argparse.Namespace, rank: int, world: int, port: int) -> float | None:
    """Train on GPU `rank` (or the CPU); returns images/s on rank 0, None elsewhere."""
    import torch
    from torch import nn

    distributed = arguments.parallel == "ddp"
    if distributed:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    device = torch.device(f"cuda:{rank}" if arguments.gpus else "cpu")
    if arguments.gpus:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    network, origin = resnet50(nn, arguments.own_model)
    if rank == 0:
        parameters = sum(parameter.numel() for parameter in network.parameters())
        print(f"model: resnet50 ({origin}, {parameters} parameters)", flush=True)
    model: Any = network.to(device).to(memory_format=torch.channels_last)
    per_device = arguments.batch_size
    batch = per_device * (world if arguments.parallel == "dp" else 1)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    elif arguments.parallel == "dp":
        model = nn.DataParallel(model, device_ids=list(range(world)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_function = nn.CrossEntropyLoss()
    generator = torch.Generator(device=device).manual_seed(1234 + rank)
    images = torch.randn(
        batch, 3, arguments.image_size, arguments.image_size, device=device, generator=generator
    ).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device, generator=generator)
    autocast = arguments.precision == "amp" and arguments.gpus > 0

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_function(model(images), labels)
        loss.backward()
        optimizer.step()

    def synchronize() -> None:
        if arguments.gpus:
            torch.cuda.synchronize(device)
        if distributed:
            dist.barrier()

    for _ in range(arguments.warmup):
        step()
    synchronize()
    started = time.perf_counter()
    for _ in range(arguments.steps):
        step()
    synchronize()
    elapsed = time.perf_counter() - started
    if distributed:
        dist.destroy_process_group()
    if rank != 0:
        return None
    total = arguments.steps * per_device * (world if arguments.parallel != "single" else 1)
    return total / elapsed


def _worker(rank: int, arguments: argparse.Namespace, world: int, port: int) -> None:
    rate = train(arguments, rank, world, port)
    if rate is not None:
        print(f"result: {rate:.2f} images/s", flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to train on (0: the CPU)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per GPU and step")
    parser.add_argument("--steps", type=int, default=40, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", choices=("fp32", "amp"), default="fp32")
    parser.add_argument(
        "--parallel",
        choices=("auto", "ddp", "dp"),
        default="auto",
        help="several GPUs: DistributedDataParallel (auto) or DataParallel; "
        "ddp also forces DDP on one GPU",
    )
    parser.add_argument(
        "--own-model", action="store_true", help="the ResNet-50 defined here, even with torchvision"
    )
    parser.add_argument("--check", action="store_true", help="print the framework line and stop")
    arguments = parser.parse_args(argv)
    try:
        import torch
    except ImportError as error:
        print(f"error: PyTorch is not installed for {sys.executable} ({error})", file=sys.stderr)
        return MISSING_FRAMEWORK
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(index) for index in range(visible)})
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    print(
        f"framework: torch {torch.__version__}{cuda}, {visible} GPU(s) visible"
        + (f": {', '.join(names)}" if names else ""),
        flush=True,
    )
    if arguments.gpus > visible:
        print(
            f"error: {arguments.gpus} GPU(s) asked, {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            file=sys.stderr,
        )
        return TOO_FEW_GPUS
    if arguments.check:
        return 0
    if arguments.parallel == "auto":
        arguments.parallel = "ddp" if arguments.gpus > 1 else "single"
    if arguments.gpus == 0:
        arguments.parallel = "single"
    world = max(arguments.gpus, 1)
    print(
        f"workload: resnet50 batch={arguments.batch_size}/GPU steps={arguments.steps} "
        f"precision={arguments.precision} parallel={arguments.parallel} gpus={arguments.gpus}",
        flush=True,
    )
    if arguments.parallel == "ddp":
        import torch.multiprocessing as multiprocessing

        multiprocessing.spawn(_worker, args=(arguments, world, free_port()), nprocs=world)
    else:
        _worker(0, arguments, world, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
