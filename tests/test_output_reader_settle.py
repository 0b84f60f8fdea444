"""A hand-over right after a stop, while the ended container's mount namespace still
holds the session's image (`outputs.capped.release_capped`): it waits for it, then
copies the output out whole.

Real loop mounts; the namespace's mount is stood in for by a second mount of the
image read-write on the host, let go of a moment after the hand-over began.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from test_host_holds import config, mounts_under  # noqa: F401  (the fixture)

from gpuresa.config.sections import Config
from gpuresa.outputs.capped import image_path, mount_capped, release_capped
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
        ["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(image), str(elsewhere)],
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
