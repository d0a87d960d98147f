"""README.md's and docs/performance.md's figure tables are what tools/figures.py renders from
benchmarks/results/, and benchmarks/results/ holds the current baselines only."""
import runpy
import subprocess
import sys

from conftest import ROOT

FIGURES = runpy.run_path(str(ROOT / "tools" / "figures.py"))


def test_the_docs_tables_are_rendered_from_the_results():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "figures.py"), "--check"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_table_copied_by_hand_is_rendered_again():
    block = "<!-- figures: grads -->\n| R1 shapes | 1.0 µs |\n<!-- /figures -->"
    text = FIGURES["render"](f"before\n\n{block}\n\nafter\n")
    assert "1.0 µs" not in text and text.count("backward / forward") == 1 and text.endswith("\n\nafter\n")


def test_every_docs_block_is_a_known_table_and_results_stay_few():
    names = {m.group("name") for path in FIGURES["DOCS"] for m in FIGURES["BLOCK"].finditer(path.read_text())}
    assert names == set(FIGURES["TABLES"])  # every table is shown somewhere, and nothing else is claimed
    assert len(list((ROOT / "benchmarks" / "results").iterdir())) <= 16  # 15 and deep-ep-ws1.json (issue 74)


def test_no_measured_figure_outside_the_rendered_tables():
    """README.md and docs/ show measurements only in rendered blocks: a time, a rate or a measured ratio in the
    prose would go stale beside the tables (the prose says what they mean and names the results)."""
    import re
    measured = re.compile(r"\d(?:\.\d+)?\s?(?:µs|us|ms|GB/s|TB/s)\b|\d\.\d+×")
    found = []
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        prose = FIGURES["BLOCK"].sub("", path.read_text())
        found += [f"{path.name}: {line.strip()}" for line in prose.splitlines() if measured.search(line)]
    assert not found, "\n".join(found)
