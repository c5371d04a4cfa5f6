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
    """PyPI's Linux torch wheels bring the CUDA libraries; PyTorch's CPU index has the CPU-only ones. The
    README gives the line beside its first command, docs/DETAILS.md beside the tests."""
    for page in (README, DETAILS):
        installs = [line for line in page.splitlines() if re.search(r"pip install torch\b", line)]
        assert installs
        for line in installs:
            assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
    top = README[: README.index("```python")]
    assert "pip install -e . && visar generate" in top and "pip install torch" in top


# What the docs point at exists, and the figures a user reads first are not random weights' compression.
# docs/history/ is the dated record, kept as written: none of these reads it.

DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "history" not in p.parts)]
PAGES = [REPO / "README.md", *(p for p in DOCS if p.parent == REPO / "docs")]  # README and docs/*.md
SOURCES = [*sorted((REPO / "visar").rglob("*.py")), *sorted((REPO / "tools").glob("*.py"))]
RANDOM = re.compile(r"random[- ]weight", re.I)
FILE_PATH = r"(?<![\w/-])(?:\.\./)?((?:tests|visar|tools)/[\w/.-]*\w\.(?:py|sh))"
RATIO = re.compile(r"fewer passes|step compression|latency / |latency over AR|x AR\b|\b\d+(?:\.\d+)?x\b", re.I)
PASS_COST_ONLY = re.compile(r"pass cost only", re.I)


def prose(text: str) -> list[str]:
    """The page's table rows, and its sentences outside code blocks (a sentence may span lines)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    rows = [line for line in text.splitlines() if line.startswith("|")]
    paragraphs = re.split(r"\n\s*\n", "\n".join(line for line in text.splitlines() if not line.startswith("|")))
    sentences = [s for p in paragraphs for s in re.split(r"(?<=[.;:])\s+", " ".join(p.split()))]
    return rows + sentences


def test_the_readme_quotes_no_compression_or_latency_measured_on_random_weights():
    """A random-weight model's next-token law is near uniform, so drafts pass far more often than under
    any trained model: such a figure measures what a pass costs, never a method's gain."""
    for page in DOCS:
        for line in prose(page.read_text()):
            if not RANDOM.search(line) or "pass cost only" in line:
                continue
            assert not line.startswith("|"), (page.name, line)  # a table row of random weights says so
            if page.name == "README.md":
                assert not RATIO.search(line), line


def sections(text: str) -> list[tuple[str, str]]:
    """The page's (heading, body) pairs, split at every heading outside code blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    parts = re.split(r"^(#{1,6}\s+.*)$", text, flags=re.M)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]


def test_no_doc_gives_random_weights_a_compression_or_latency_ratio_unless_labelled_pass_cost_only():
    """README and docs/**.md (docs/history/ aside): a row or sentence that names random weights, or one
    under a heading that does, gives no step compression ("Nx", "fewer passes") or latency ratio
    ("latency / AR") unless its section (heading to heading) says "pass cost only"."""
    offenders = []
    for page in DOCS:
        for heading, body in sections(page.read_text()):
            if PASS_COST_ONLY.search(heading + body):
                continue
            for line in prose(body):
                if (RANDOM.search(heading) or RANDOM.search(line)) and RATIO.search(line):
                    offenders.append((str(page.relative_to(REPO)), heading, line))
    assert not offenders, offenders


# Raw bench output measured on random weights: GPT-B-size folders (auto, the H200 device check) and the tiny
# Lumina-mGPT 2.0 of tests/fixtures/lumina, whose rows name no weights themselves.
RANDOM_WEIGHT_BENCHES = ["auto/gpt-b-*.md", "device/*.md", "lumina/*.md"]


def test_raw_bench_output_of_random_weights_opens_with_pass_cost_only():
    """docs/bench keeps such rows as measured, under a first line that says "pass cost only"; a folder of
    them (the device check's .jsonl) has such a page beside its raw files."""
    bench = REPO / "docs" / "bench"
    pages = {p for pattern in RANDOM_WEIGHT_BENCHES for p in bench.glob(pattern)}
    pages |= {p for p in bench.rglob("*.md") if RANDOM.search(p.read_text())}
    for pattern in RANDOM_WEIGHT_BENCHES:
        assert list(bench.glob(pattern)), pattern
    first_lines = {str(p.relative_to(REPO)): p.read_text().split("\n")[0] for p in sorted(pages)}
    unlabelled = [name for name, line in first_lines.items() if not PASS_COST_ONLY.search(line)]
    assert not unlabelled, unlabelled


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)]


def anchors(page) -> set[str]:
    seen, out = {}, set()
    for heading in headings(page):
        a = anchor(heading)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def test_no_docs_heading_is_dated_as_a_journal_entry():
    """The docs are references; the dated record lives in docs/history/."""
    dated = [(p.name, h) for p in DOCS for h in headings(p) if re.search(r"\b\d{4}-\d{2}-\d{2}\b", h)]
    assert not dated, dated


def is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent that is a module, not a package
        return False


def test_every_module_and_file_the_docs_name_exists():
    """A dotted `visar.x.y` resolves (the longest prefix that is a module, then attributes), and a
    tests/, visar/ or tools/ file path exists: the docs cannot send a user to a removed module."""
    import importlib

    missing = []
    for page in PAGES:
        text = page.read_text()
        for name in sorted(set(re.findall(r"(?<![\w/.-])visar(?:\.[A-Za-z_]\w*)+", text))):
            parts = name.split(".")
            k = len(parts)
            while k > 1 and not is_module(".".join(parts[:k])):
                k -= 1
            obj = importlib.import_module(".".join(parts[:k]))
            for part in parts[k:]:
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append((page.name, name))
        for path in sorted(set(re.findall(FILE_PATH, text))):
            if not (REPO / path).exists():
                missing.append((page.name, path))
    assert not missing, missing


def short_titles(heading: str) -> set[str]:
    """A heading is named whole, by its part before a colon, or without a closing parenthesis."""
    plain = re.sub(r"\s*\([^()]*\)$", "", heading)
    return {heading, plain, heading.split(":")[0].strip(), plain.split(":")[0].strip()}


def test_every_link_and_section_named_in_the_docs_exists():
    """`[..](X.md#anchor)` in README.md and docs/ resolves to a file and one of its headings; a section
    named by title (`docs/X.md, "Title"`, in the docs, visar's docstrings or tools/) is a heading of
    X.md (`short_titles`)."""
    broken = []
    for page in DOCS:
        for target, fragment in re.findall(r"\]\(([^()\s#]+\.md)(?:#([^()\s]*))?\)", page.read_text()):
            path = (page.parent / target).resolve()
            if not path.exists() or (fragment and fragment not in anchors(path)):
                broken.append((page.name, target, fragment))
    for page in DOCS + SOURCES:
        text = page.read_text()
        for target, title in re.findall(r"([\w/.-]*\w\.md),?\s+\"([^\"\n]+(?:\n[^\"\n]+)?)\"", text):
            title = " ".join(title.split())
            base = REPO if target.startswith(("docs/", "tests/")) or page.suffix == ".py" else page.parent
            path = base / target
            if not path.exists() and (REPO / "docs" / target).exists():
                path = REPO / "docs" / target
            names = {n for h in headings(path) for n in short_titles(h)} if path.exists() else set()
            if title not in names:
                broken.append((page.name, target, title))
    assert not broken, broken
