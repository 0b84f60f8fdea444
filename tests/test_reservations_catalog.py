"""The template catalog bookings are checked against: template.toml files, read tolerantly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.reservations.catalog import (
    TemplateError,
    load_templates,
    read_template,
    template_variants,
)


def templates_config(directory: Path, *allowed: str) -> Config:
    return parse_config({"templates": {"directory": str(directory), "allowed": list(allowed)}})


def write_template(directory: Path, name: str, text: str, dockerfile: bool = True) -> Path:
    folder = directory / name
    folder.mkdir(parents=True)
    (folder / "template.toml").write_text(text)
    if dockerfile:
        (folder / "Dockerfile").write_text("FROM scratch\n")
    return folder


def test_the_shipped_templates() -> None:
    assert dict(template_variants(parse_config({}))) == {
        "tensorflow": ("12.3", "12.2", "11.8"),
        "digits": ("11.4", "11.1"),
        "pytorch": ("12.4", "11.8"),
    }
    shipped = load_templates(parse_config({}))
    assert shipped["pytorch"].variant("11.8").base_image == (
        "pytorch/pytorch:2.1.2-cuda11.8-cudnn8-runtime"
    )
    assert shipped["digits"].default_variant.base_image.startswith("nvcr.io/nvidia/digits:")


def test_unknown_keys_are_tolerated_and_order_is_preference(tmp_path: Path) -> None:
    write_template(
        tmp_path,
        "jax",
        'description = "JAX"\nbuild_arguments = { A = "1" }\n'
        '[variants."12.6"]\nbase_image = "example/jax:12.6"\nsize = "large"\n'
        '[variants."11.8"]\nbase_image = "example/jax:11.8"\n',
    )
    assert template_variants(templates_config(tmp_path, "jax")) == {"jax": ("12.6", "11.8")}


def test_only_allowed_templates_exist_for_bookings(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_template(tmp_path, name, f'[variants."1"]\nbase_image = "example/{name}:1"\n')
    assert set(template_variants(templates_config(tmp_path, "b", "../a", "missing"))) == {"b"}


@pytest.mark.parametrize(
    ("text", "dockerfile", "fragment"),
    [
        ("description = 3\n", True, "description: expected a string"),
        (
            'command = "run"\n[variants."1"]\nbase_image = "x"\n',
            True,
            "command: expected a non-empty",
        ),
        ('description = "no variants"\n', True, 'expected at least one [variants."CUDA"] table'),
        ('[variants."1 2"]\nbase_image = "x"\n', True, "a variant name is letters"),
        ('[variants."1"]\nbase_image = "two words"\n', True, "base_image: expected an image name"),
        ('[variants."1"]\n', True, "base_image: expected an image name"),
        ("[variants\n", True, "TOML syntax error"),
        ('[variants."1"]\nbase_image = "x"\n', False, "Dockerfile: no such file"),
    ],
)
def test_a_broken_template_is_refused_with_its_reason(
    tmp_path: Path, text: str, dockerfile: bool, fragment: str
) -> None:
    folder = write_template(tmp_path, "broken", text, dockerfile)
    with pytest.raises(TemplateError) as caught:
        read_template(folder)
    assert fragment in str(caught.value)
    # and bookings cannot choose it
    assert template_variants(templates_config(tmp_path, "broken")) == {}


def test_a_changed_template_file_is_read_again(tmp_path: Path) -> None:
    folder = write_template(tmp_path, "t", '[variants."1"]\nbase_image = "x:1"\n')
    config = templates_config(tmp_path, "t")
    assert template_variants(config) == {"t": ("1",)}
    (folder / "template.toml").write_text('[variants."2"]\nbase_image = "x:2"\n')
    os.utime(folder / "template.toml", ns=(1, 1))
    assert template_variants(config) == {"t": ("2",)}


def test_a_variant_lookup_names_the_choices(tmp_path: Path) -> None:
    folder = write_template(
        tmp_path, "t", '[variants."1"]\nbase_image = "x:1"\n[variants."2"]\nbase_image = "x:2"\n'
    )
    template = read_template(folder)
    assert template.variant(None).name == "1"
    with pytest.raises(TemplateError, match="template 't' has no CUDA variant '3' \\(has: 1, 2\\)"):
        template.variant("3")
