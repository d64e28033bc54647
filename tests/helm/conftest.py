"""Fixtures of the chart tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import SESSION_PREFIX
from tests.helm.chart import CHART


@pytest.fixture(scope="session")
def notes_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart that carries NOTES.txt in a ConfigMap `helm template` renders.
    Helm renders NOTES only on install, which needs a cluster even with --dry-run
    (helm/helm#13144)."""
    chart = tmp_path_factory.mktemp(SESSION_PREFIX + "notes") / "kvpool"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  NOTES.txt: {{ include (print .Template.BasePath "/NOTES.txt") . | quote }}\n')
    return chart
