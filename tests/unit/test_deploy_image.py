"""Offline checks of deploy/Dockerfile against pyproject.toml and the Helm values: no Docker.

Every module the Dagster instance of the chart imports, and every library a GPU training path needs,
comes from a package the image installs.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy.engine import make_url

from tests.unit.deploy_support import (
    DOCKERFILE,
    HELM_VALUES,
    REPO,
    distribution_of,
    image_extras,
    image_requirements,
    rendered_instance_classes,
)

DOCKERFILE_TEXT = DOCKERFILE.read_text()
PYPROJECT_TEXT = (REPO / "pyproject.toml").read_text()
IMAGE_REQUIREMENTS = image_requirements(DOCKERFILE_TEXT, PYPROJECT_TEXT)


@pytest.mark.parametrize("setting", sorted(rendered_instance_classes(HELM_VALUES)))
def test_every_class_of_the_charts_instance_comes_from_a_package_the_image_installs(setting):
    """Run and step pods, the code location and the daemon load the instance from the chart's
    dagster.yaml first: a module the image lacks fails every run and every schedule tick."""
    module, class_name = rendered_instance_classes(HELM_VALUES)[setting]
    assert distribution_of(module) in IMAGE_REQUIREMENTS, (
        f"dagster.yaml's {setting} is {module}.{class_name}, but deploy/Dockerfile installs no "
        f"{distribution_of(module)} (extras {sorted(image_extras(DOCKERFILE_TEXT))})"
    )


def test_instance_database_url_names_the_driver_dagster_postgres_installs():
    """dagster-postgres requires psycopg2-binary; the installed SQLAlchemy picks the driver of a URL
    without one (psycopg 3 from SQLAlchemy 2.1 on), which would fail at the first connection."""
    assert "dagster-postgres" in IMAGE_REQUIREMENTS
    scheme = HELM_VALUES["postgresql"].get("postgresqlScheme", "postgresql")
    assert make_url(f"{scheme}://dagster@postgres/dagster").get_dialect().driver == "psycopg2"


def test_dagster_libraries_are_pinned_to_one_release():
    """dagster-k8s and dagster-postgres are released together with dagster (1.13.x <-> 0.29.x)."""
    libraries = {name: req for name, req in IMAGE_REQUIREMENTS.items()
                 if name.startswith("dagster-") and name not in ("dagster-webserver", "dagster-ray")}
    assert {"dagster-k8s", "dagster-postgres"} <= set(libraries)
    assert len({str(req.specifier) for req in libraries.values()}) == 1, libraries


def test_the_image_has_the_gpu_training_libraries():
    """`method: qlora` loads the base model 4-bit through bitsandbytes on the Ray GPU workers."""
    assert "gpu" in image_extras(DOCKERFILE_TEXT)
    assert "bitsandbytes" in IMAGE_REQUIREMENTS


def test_flash_attention_is_an_opt_in_build_argument():
    assert re.search(r'^ARG FLASH_ATTN=""$', DOCKERFILE_TEXT, re.MULTILINE)
    assert '"flash-attn==${FLASH_ATTN}"' in DOCKERFILE_TEXT
    assert "flash-attn" not in IMAGE_REQUIREMENTS  # no wheel to rely on: never a pyproject requirement


def test_extras_the_dockerfile_names_must_exist():
    with pytest.raises(ValueError, match=r"extras pyproject.toml does not define: \['gpus'\]"):
        image_requirements(DOCKERFILE_TEXT.replace(",gpu]", ",gpus]"), PYPROJECT_TEXT)
