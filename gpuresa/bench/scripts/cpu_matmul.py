"""gpuresa bench's CPU workload: a fixed amount of pure-Python arithmetic, timed.

Runs with any python3 (3.8 or later, nothing to install), on the host and in
a session container alike. It multiplies two fixed integer matrices modulo a
prime `--rounds` times (the same work everywhere: the printed checksum must
match between sides) after one untimed warm-up round, and prints

    framework: python 3.11.2
    workload: cpu-matmul size=N rounds=R
    checksum: C
    result: X matmul/s

where X is rounds per second of wall-clock time. gpuresa reads the `result:` line.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

PRIME = 1_000_003


def matrices(size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two deterministic `size`×`size` matrices (a linear congruential sequence)."""
    state = 12345
    values: list[int] = []
    for _ in range(2 * size * size):
        state = (state * 1103515245 + 12345) % 2**31
        values.append(state % PRIME)
    first = [values[row * size : (row + 1) * size] for row in range(size)]
    offset = size * size
    second = [values[offset + row * size : offset + (row + 1) * size] for row in range(size)]
    return first, second


def multiply(first: list[list[int]], second: list[list[int]]) -> list[list[int]]:
    """first × second modulo PRIME, in plain Python."""
    columns = list(zip(*second))
    return [
        [sum(a * b for a, b in zip(row, column)) % PRIME for column in columns] for row in first
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="matrix size (default 64)")
    parser.add_argument("--rounds", type=int, default=50, help="timed multiplications (default 50)")
    parser.add_argument("--gpus", type=int, default=0, help="ignored: accepted like the others")
    arguments = parser.parse_args(argv)
    if arguments.size < 1 or arguments.rounds < 1:
        print("error: --size and --rounds must be at least 1", file=sys.stderr)
        return 2
    first, second = matrices(arguments.size)
    multiply(first, second)  # warm-up, untimed
    checksum = 0
    started = time.perf_counter()
    for _ in range(arguments.rounds):
        product = multiply(first, second)
        checksum = (checksum + product[0][0] + product[-1][-1]) % PRIME
        # feed the result back so no round can be skipped or cached
        first = product
    elapsed = time.perf_counter() - started
    print(f"framework: python {platform.python_version()}")
    print(f"workload: cpu-matmul size={arguments.size} rounds={arguments.rounds}")
    print(f"checksum: {checksum}")
    print(f"result: {arguments.rounds / elapsed:.3f} matmul/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
