"""bench/RESULTS.md invents no numbers: every figure in the tables of its current figures and history comes from the
raw file its row names in bench/results."""

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?")
FIGURES = re.compile(r"[\d,.\s/()\-]+")  # a cell of figures only: "2,243.9 (2,242.7)", "0.438 / 0.575", "-"


def unsupported(results_md: Path, results: Path) -> tuple[int, list[str]]:
    """(rows checked, problems) over the table rows above the session notes that name their raw files: a figure
    that is not a number in those files, or a file that is not there."""
    text = results_md.read_text().split("\n## Session notes")[0]
    rows, problems = 0, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+\.(?:jsonl|log))`", cells[-1]) if line.startswith("|") else []
        if not names:
            continue
        rows += 1
        files = [results / (n if n.startswith("2026-") else f"2026-11-30_{n}") for n in names]
        problems += [f"{f.name} is not in bench/results" for f in files if not f.exists()]
        raw = {float(n) for f in files if f.exists() for n in NUMBER.findall(f.read_text())}
        for cell in cells[1:-1]:
            if FIGURES.fullmatch(cell):
                problems += [f"{x} ({cells[0]}) is not in {names}" for x in NUMBER.findall(cell.replace(",", ""))
                             if float(x) not in raw]
    return rows, problems


def test_every_figure_of_the_current_and_history_tables_is_in_its_raw_file():
    rows, problems = unsupported(BENCH / "RESULTS.md", BENCH / "results")
    assert rows >= 25 and not problems, problems


def test_a_figure_not_in_its_file_is_caught(tmp_path):
    name = "2026-11-30_s10call9_synthetic_final.jsonl"
    (tmp_path / name).write_text((BENCH / "results" / name).read_text())
    md = tmp_path / "RESULTS.md"
    md.write_text(f"| synthetic Llama 8B, Q4_0 | 530.8 (530.1) | 13,673.4 | `{name}` |\n")
    assert unsupported(md, tmp_path) == (1, [])
    md.write_text(f"| synthetic Llama 8B, Q4_0 | 530.9 (530.1) | 13,673.4 | `{name}` |\n")
    assert unsupported(md, tmp_path) == (1, [f"530.9 (synthetic Llama 8B, Q4_0) is not in ['{name}']"])
