"""The README's and docs/*.md's relative links and anchors resolve (as GitHub renders them), and
docs/METRICS.md lists the vLLM plug-in's counters."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "journal").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor: link text kept, lowercased, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    out: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a, n = anchor(m.group(1)), 0
            while (a if n == 0 else f"{a}-{n}") in out:
                n += 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_anchor_follows_github() -> None:
    assert anchor("CUDA: `scripts/device_check.sh` (issue 44)") == "cuda-scriptsdevice_checksh-issue-44"
    assert anchor("Router: `kvpool bench cross-node --fronts` against vllm-router") == \
        "router-kvpool-bench-cross-node---fronts-against-vllm-router"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, frag = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif frag and target.suffix == ".md" and frag not in anchors(target):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_every_vllm_plugin_counter_is_documented() -> None:
    """docs/METRICS.md lists each counter the vLLM plug-in registers (`PROM_COUNTERS`, read from
    the source: importing the plug-in needs vLLM, which this environment does not have)."""
    import ast

    tree = ast.parse((ROOT / "connector" / "vllm_plugin.py").read_text())
    (table,) = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "PROM_COUNTERS" for t in node.targets)]
    keys = [ast.literal_eval(k) for k in table.keys]
    assert len(keys) >= 10, keys
    documented = (ROOT / "docs" / "METRICS.md").read_text()
    assert [k for k in keys if f"`kvpool:{k}_total`" not in documented] == []
