"""Session templates: the shipped ones, the allowlist, image hashes and builds.

The builds use the real Docker engine and the local base image, the way the
demo does; images stay cached by their hash, so a second run reuses them.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from conftest import BASE_IMAGE
from support.configs import config_of

from gpuresa.backends.engines import Runtime
from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.reservations.catalog import template_variants
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.templates import (
    ACCESS_LAYER,
    FTP_SIDECAR,
    available_templates,
    context_archive,
    image_digest,
    resolve_template,
    templates_directory,
)

ROOT = Path(__file__).parents[1]
SHIPPED = ROOT / "templates"
UPSTREAM = {
    "pytorch": r"pytorch/pytorch:\S+",
    "tensorflow": r"tensorflow/tensorflow:\S+-gpu",
    "digits": r"nvcr\.io/nvidia/digits:\S+",
}


def make_config(tmp_path: Path, **templates: Any) -> Config:
    return config_of(
        {"templates": {"base_image": BASE_IMAGE, **templates}},
        base=False,
        source=str(tmp_path / "test.toml"),
    )


# --- the shipped templates ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_shipped_template_offers_upstream_cuda_variants_through_base_image(name: str) -> None:
    config = parse_config({}, "defaults")
    template, preferred = resolve_template(config.templates, name, None)
    assert len(template.variants) >= 2
    for variant in template.variants:
        assert re.fullmatch(UPSTREAM[name], variant.base_image), variant
    dockerfile = (SHIPPED / name / "Dockerfile").read_text()
    # BASE_IMAGE selects the base; its default is the preferred variant's image
    argument = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert argument is not None and argument.group(1) == preferred.base_image
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.MULTILINE)
    assert dockerfile.index("ARG BASE_IMAGE") < dockerfile.index("FROM ${BASE_IMAGE}")


def test_support_folders_are_not_templates_and_the_catalog_agrees() -> None:
    config = parse_config({}, "defaults")
    names = [template.name for template in available_templates(config.templates)]
    assert names == ["digits", "pytorch", "tensorflow"]
    assert ACCESS_LAYER not in names and FTP_SIDECAR not in names
    assert templates_directory(config.templates).resolve() == SHIPPED.resolve()
    # the bookings' validation view reads the same files
    assert dict(template_variants(config)) == {
        template.name: tuple(variant.name for variant in template.variants)
        for template in available_templates(config.templates)
    }


# --- the allowlist (fail closed) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cuda", "reason"),
    [
        ("caffe", None, "not allowed"),
        ("tensorflow", None, "not allowed"),  # present, but not in this allowlist
        ("../pytorch", None, "not a template name"),
        ("PyTorch", None, "not a template name"),
        ("pytorch:latest", None, "not a template name"),
        ("pytorch", "9.0", "no CUDA variant '9.0'"),
        ("missing", None, "does not exist"),
    ],
)
def test_only_allowed_templates_and_variants_resolve(
    tmp_path: Path, name: str, cuda: str | None, reason: str
) -> None:
    config = make_config(tmp_path, allowed=["pytorch", "digits", "missing"])
    with pytest.raises(SessionError, match=re.escape(reason)):
        resolve_template(config.templates, name, cuda)


def test_a_broken_template_file_is_refused_with_its_reason(tmp_path: Path) -> None:
    directory = tmp_path / "templates"
    shutil.copytree(SHIPPED, directory)
    (directory / "pytorch" / "template.toml").write_text('description = "no variants"\n')
    config = make_config(tmp_path, directory=str(directory))
    with pytest.raises(SessionError, match="variants"):
        resolve_template(config.templates, "pytorch", None)


# --- hashes ----------------------------------------------------------------------------------


def test_the_image_hash_follows_every_file_and_the_base(tmp_path: Path) -> None:
    template = tmp_path / "pytorch"
    access = tmp_path / "access"
    shutil.copytree(SHIPPED / "pytorch", template)
    shutil.copytree(SHIPPED / "access", access)
    original = image_digest(["pytorch", "12.4", BASE_IMAGE, "sha256:1"], template, access)
    assert image_digest(["pytorch", "12.4", BASE_IMAGE, "sha256:1"], template, access) == original
    assert image_digest(["pytorch", "12.4", BASE_IMAGE, "sha256:2"], template, access) != original
    assert image_digest(["pytorch", "11.8", BASE_IMAGE, "sha256:1"], template, access) != original
    with (template / "Dockerfile").open("a") as dockerfile:
        dockerfile.write("# edited\n")
    edited = image_digest(["pytorch", "12.4", BASE_IMAGE, "sha256:1"], template, access)
    assert edited != original
    (access / "sshd_config").write_text("Port 22\n")
    assert image_digest(["pytorch", "12.4", BASE_IMAGE, "sha256:1"], template, access) != edited


def test_the_build_context_keeps_executable_bits() -> None:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(context_archive(SHIPPED / "access"))) as archive:
        modes = {member.name: member.mode for member in archive.getmembers()}
    assert modes == {
        "Dockerfile": 0o644,
        "entrypoint.sh": 0o755,
        "install.sh": 0o755,
        "notebook.sh": 0o755,
        "template-motd.sh": 0o644,
        "sshd_config": 0o644,
    }


# --- builds on the real engine ---------------------------------------------------------------


def test_an_image_is_built_once_and_then_reused(tmp_path: Path, docker_client: Any) -> None:
    runtime = Runtime(make_config(tmp_path), docker_client)
    tag = runtime.ensure_image("pytorch", None)
    assert re.fullmatch(r"gpuresa/pytorch:12\.4-[0-9a-f]{12}", tag)
    image = docker_client.images.get(tag)
    assert image.labels["gpuresa.template"] == "pytorch"
    assert image.labels["gpuresa.base-image"] == BASE_IMAGE
    started = time.monotonic()
    assert runtime.ensure_image("pytorch", "12.4") == tag
    assert time.monotonic() - started < 1.0, "an unchanged template must not be rebuilt"
    assert docker_client.images.get(tag).id == image.id
    # the access layer is on top: sshd's entrypoint, and no host key baked in
    assert image.attrs["Config"]["Entrypoint"] == ["/opt/gpuresa/entrypoint.sh"]
    listing = docker_client.containers.run(
        tag,
        entrypoint=["sh", "-c", "ls /etc/ssh; cat /etc/gpuresa/template-motd"],
        remove=True,
        labels={"gpuresa.test-run": "templates"},
    ).decode()
    assert "sshd_config" in listing and "ssh_host_" not in listing
    assert "PyTorch" in listing


def test_an_edited_template_gets_a_new_image(tmp_path: Path, docker_client: Any) -> None:
    directory = tmp_path / "templates"
    shutil.copytree(SHIPPED, directory)
    config = make_config(tmp_path, directory=str(directory))
    runtime = Runtime(config, docker_client)
    before = runtime.ensure_image("pytorch", None)
    marker = uuid.uuid4().hex
    with (directory / "pytorch" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f'RUN echo "{marker}" > /etc/gpuresa/edited\n')
    after = runtime.ensure_image("pytorch", None)
    try:
        assert after != before
        output = docker_client.containers.run(
            after,
            entrypoint=["cat", "/etc/gpuresa/edited"],
            remove=True,
            labels={"gpuresa.test-run": "templates"},
        )
        assert output.decode().strip() == marker
    finally:
        try:
            docker_client.images.remove(after)
        except docker.errors.APIError as error:
            print(f"could not remove {after}: {error}")


def test_an_unknown_template_is_never_built(tmp_path: Path, docker_client: Any) -> None:
    runtime = Runtime(make_config(tmp_path, allowed=["pytorch"]), docker_client)
    with pytest.raises(SessionError, match="not allowed"):
        runtime.ensure_image("tensorflow", None)
    with pytest.raises(SessionError, match="not a template name"):
        runtime.ensure_image("ubuntu:latest", None)


def test_a_missing_base_image_that_cannot_be_pulled_is_a_clear_refusal(
    tmp_path: Path, docker_client: Any
) -> None:
    directory = tmp_path / "templates"
    shutil.copytree(SHIPPED, directory)
    missing = f"gpuresa-test/absent-{uuid.uuid4().hex[:8]}:1"
    (directory / "pytorch" / "template.toml").write_text(
        f'description = "x"\n[variants."12.4"]\nbase_image = "{missing}"\n'
    )
    config = parse_config({"templates": {"directory": str(directory)}}, "test.toml")
    with pytest.raises(SessionError, match=f"base image {missing} is not on this host"):
        Runtime(config, docker_client).ensure_image("pytorch", None)


# --- the commands -------------------------------------------------------------------------------


def write_config(tmp_path: Path, allowed: str = '["pytorch", "digits"]') -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[templates]\nbase_image = "{BASE_IMAGE}"\nallowed = {allowed}\n')
    return path


def test_templates_list_shows_variants_and_the_allowlist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["templates", "list", "--config", str(write_config(tmp_path))]) == 0
    output = capsys.readouterr().out
    rows = {line.split()[0]: line for line in output.splitlines() if line.strip()}
    assert re.search(r"pytorch\s+yes\s+12\.4, 11\.8", rows["pytorch"])
    assert re.search(r"tensorflow\s+no\s+12\.3", rows["tensorflow"])
    assert re.search(r"digits\s+yes\s+11\.4", rows["digits"])
    assert f"images build on {BASE_IMAGE}" in output


def test_templates_build_builds_the_named_variant(
    tmp_path: Path, docker_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    assert main(["templates", "build", "pytorch", "--cuda", "12.4", "--config", str(config)]) == 0
    output = capsys.readouterr().out
    match = re.search(r"pytorch \(CUDA 12\.4\): (\S+)", output)
    assert match is not None
    assert docker_client.images.get(match.group(1))
    assert "FTP sidecar: gpuresa/session-ftp:" in output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["tensorflow"], "not allowed"),
        (["pytorch", "--cuda", "10.0"], "no CUDA variant"),
        (["--cuda", "12.4"], "needs a template NAME"),
    ],
)
def test_templates_build_refuses_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    config = write_config(tmp_path)
    assert main(["templates", "build", *arguments, "--config", str(config)]) == 1
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert len(error.strip().splitlines()) == 1
