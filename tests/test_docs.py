"""What the README and docs/DETAILS.md tell a new user is true: the methods table's lossless and kind
columns are the registry's, the tour prints what its comment says, and the CPU-only install line
fetches CPU wheels."""

import ast
import re

from conftest import REPO

from visar.accel import METHODS

README = (REPO / "README.md").read_text()
DETAILS = (REPO / "docs" / "DETAILS.md").read_text()


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_methods_table_says_what_the_registry_does():
    """ "yes" is lossless at every setting (`visar methods`: "lossless"); a method exact only at some
    settings is "no", and its row may say where it is exact."""
    rows = [line for line in section(README, "Methods").splitlines() if line.startswith("| `")]
    listed = set()
    for row in rows:
        names, kind, lossless = (cell.strip() for cell in row.strip("|").split("|")[:3])
        for name in re.findall(r"`([^`]+)`", names):
            method = METHODS[name]
            assert lossless == ("yes" if method.lossless else "no"), (name, lossless, method.lossless_label)
            assert kind == method.model_kind, (name, kind)
            listed.add(name)
    assert listed == set(METHODS)


def test_the_tour_prints_what_its_comment_says():
    tour = README[README.index("```python\n") + len("```python\n") :]
    tour = tour[: tour.index("```")]
    lines = tour.splitlines()
    shown = next(i for i, line in enumerate(lines) if "forward_passes_per_image" in line)
    said = re.search(r"# (\[[\d, ]+\]) ([\d.]+): AR takes (\d+)", lines[shown])
    assert said, lines[shown]
    scope = {}
    exec("\n".join(line for line in lines[:shown] if ".save(" not in line), scope)  # the load and the generate
    out = scope["out"]
    assert out.stats["forward_passes_per_image"] == ast.literal_eval(said.group(1))
    assert f"{out.stats['acceptance_rate']:.2f}" == said.group(2)
    assert scope["pipe"].model.num_image_tokens == int(said.group(3))


def test_the_cpu_only_install_fetches_pytorchs_cpu_wheels():
    """PyPI's Linux torch wheels bring the CUDA libraries; PyTorch's CPU index has the CPU-only ones."""
    installs = [line for line in DETAILS.splitlines() if re.search(r"pip install torch\b", line)]
    assert installs
    for line in installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
