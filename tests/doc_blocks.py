"""The ```python blocks of a Markdown file, for the tests that run the README's and the guide's
code (test_readme.py, test_guide.py). A block may be marked by an HTML comment on the line
before its fence (invisible in the rendered page):
    <!-- doc-test: skip REASON -->     not run here (needs GPUs, ...), REASON says why
    <!-- doc-test: launch N -->        a script for `python -m jax_nvcomm.launch -n N`
Unmarked blocks run in the order of the file, in one process, sharing their names
(`run_blocks`; also `python tests/doc_blocks.py FILE.md`)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARK = re.compile(r"<!--\s*doc-test:\s*(skip|launch)\s*(.*?)\s*-->")


@dataclasses.dataclass
class Block:
    path: Path
    line: int            # line of the block's first code line (1-based)
    code: str
    mode: str = "run"    # "run", "skip" or "launch"
    arg: str = ""        # skip: the reason; launch: the number of processes

    def compiled(self):
        """The block compiled so that tracebacks name the Markdown file and its line numbers."""
        return compile("\n" * (self.line - 1) + self.code, str(self.path), "exec")


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = start
            while lines[end].strip() != "```":
                end += 1
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            m = _MARK.search(prev)
            blocks.append(Block(path, start + 1, "\n".join(lines[start:end]) + "\n",
                                *(m.groups() if m else ())))
            i = end
        i += 1
    return blocks


def run_blocks(path: Path, first_only: bool = False) -> None:
    """Run the unmarked blocks of `path` in order in this process, sharing one namespace (or
    only the file's first block), printing a line before each."""
    ns = {"__name__": "__main__"}
    for b in python_blocks(path)[:1] if first_only else python_blocks(path):
        if b.mode == "run":
            print(f"--- {b.path.name}:{b.line}", flush=True)
            exec(b.compiled(), ns)


if __name__ == "__main__":
    # python tests/doc_blocks.py FILE.md [--first]: run its blocks (the tests and
    # scripts/gpu_check.sh's part `docs`);  ... FILE.md --launch-script OUT: write its first
    # launcher block to OUT
    import sys
    target = Path(sys.argv[1]).resolve()
    if "--launch-script" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--launch-script") + 1])
        out.write_text(next(b.code for b in python_blocks(target) if b.mode == "launch"))
    else:
        run_blocks(target, first_only="--first" in sys.argv)
