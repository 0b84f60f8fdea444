"""A hand-over right after a stop, while the ended container's mount namespace still
holds the session's image (`outputs.capped.release_capped`): it waits for it, then
copies the output out whole; a damaged image, which nothing holds, fails at once.

Real loop mounts; the namespace's mount is stood in for by a second mount of the
image read-write on the host, let go of a moment after the hand-over began.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_host_holds import config, mounts_under  # noqa: F401  (the fixture)

from gpuresa.config.sections import Config
from gpuresa.outputs.capped import (
    MOUNT_OPTIONS,
    READER_SETTLE,
    image_path,
    mount_capped,
    release_capped,
)
from gpuresa.outputs.running_area import ensure_area, running_path, stored_path


def test_a_hand_over_waits_for_the_image_held_elsewhere_then_copies_it_whole(
    config: Config,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    ensure_area(config)
    running = running_path(config, "ended")
    running.mkdir(mode=0o700)
    mount_capped(config, "ended", running, 32 * 1024**2)
    (running / "result.txt").write_text("kept\n")
    # the ended container's namespace, still holding the image read-write
    elsewhere = tmp_path / "namespace-of-the-ended-container"
    elsewhere.mkdir()
    image = image_path(config, "ended")
    subprocess.run(
        ["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(elsewhere)],
        check=True,
    )
    let_go = threading.Timer(1.0, lambda: subprocess.run(["umount", str(elsewhere)], check=True))
    stored = stored_path(config, "ended")
    started = time.monotonic()
    let_go.start()
    try:
        release_capped(config, "ended", running, stored)
    finally:
        let_go.join()
    waited = time.monotonic() - started
    assert waited >= 0.9, f"copied after {waited:.1f} s, while the image was held elsewhere"
    assert (stored / "result.txt").read_text() == "kept\n"
    assert not image.exists()
    # the image's mounts are all gone (the fixture then releases the area, its loop devices)
    assert mounts_under(running) == [] and mounts_under(elsewhere) == []


def test_a_damaged_image_nothing_holds_fails_at_once(
    config: Config,  # noqa: F811  (the fixture imported above)
) -> None:
    """Its output stays in the image, listed, for the next round or an admin; the hand-over
    does not wait out `READER_SETTLE` on a mount that can never work."""
    ensure_area(config)
    running = running_path(config, "damaged")
    running.mkdir(mode=0o700)
    mount_capped(config, "damaged", running, 32 * 1024**2)
    (running / "result.txt").write_text("kept\n")
    subprocess.run(["umount", str(running)], check=True)
    image = image_path(config, "damaged")
    with image.open("r+b") as file:  # the ext4 superblock, and its magic, gone
        file.seek(1024)
        file.write(bytes(1024))
    started = time.monotonic()
    with pytest.raises(OSError):
        release_capped(config, "damaged", running, stored_path(config, "damaged"))
    waited = time.monotonic() - started
    assert waited < READER_SETTLE / 2, f"failed after {waited:.1f} s"
    assert image.exists(), "the output's image went with a failed hand-over"
