"""Every ```python snippet in README.md and docs/*.md runs, so the documentation cannot rot.

The snippets of one file run in order in one namespace (a later snippet may use what an earlier
one made), with a fresh temporary directory as the working directory; a snippet that writes files
writes them there. A snippet that needs a GPU is marked by the line `<!-- gpu -->` right before
its fence: the CPU test runs the file without it (so later snippets must not depend on it), and
the GPU test (`-m gpu`) runs the whole file. Code that is not meant to run as it stands (an
excerpt, a signature sketch) belongs in a fence other than ```python, e.g. ```text.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_GPU_MARK = re.compile(r"<!--\s*gpu\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int   # 1-based line of the opening fence
    code: str
    gpu: bool


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n")
        gpu = bool(_GPU_MARK.search(before.rsplit("\n", 1)[-1]))
        out.append(Snippet(path, text.count("\n", 0, m.start()) + 1, m.group(1), gpu))
    return out


def run_file(path: Path, tmp_path: Path, monkeypatch, with_gpu: bool, root: Path = ROOT) -> int:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs:{path.name}"}
    ran = 0
    for sn in snippets(path):
        if sn.gpu and not with_gpu:
            continue
        where = f"{path.relative_to(root)}:{sn.line}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "CUDA EP has no device" on CPU machines
            try:
                exec(compile(sn.code, where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"the snippet at {where} failed: {type(exc).__name__}: {exc}") from exc
        ran += 1
    return ran


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def test_snippet_parser_sees_fences_and_gpu_marks(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\na = 1\n```\n\n<!-- gpu -->\n```python\nb = 2\n```\n```bash\nls\n```\n")
    found = snippets(doc)
    assert [(s.line, s.code, s.gpu) for s in found] == [(2, "a = 1\n", False), (7, "b = 2\n", True)]


def test_a_failing_snippet_names_its_file_and_line(tmp_path, monkeypatch):
    doc = tmp_path / "bad.md"
    doc.write_text("```python\nx = 1\n```\n\n```python\nundefined_name\n```\n")
    with pytest.raises(AssertionError, match=r"^the snippet at bad\.md:5 failed: NameError: "):
        run_file(doc, tmp_path, monkeypatch, with_gpu=False, root=tmp_path)


@pytest.mark.parametrize("path", [p for p in DOCS if any(not s.gpu for s in snippets(p))],
                         ids=_ids([p for p in DOCS if any(not s.gpu for s in snippets(p))]))
def test_doc_snippets_run(path, tmp_path, monkeypatch):
    assert run_file(path, tmp_path, monkeypatch, with_gpu=False) >= 1


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("path", [p for p in DOCS if any(s.gpu for s in snippets(p))],
                         ids=_ids([p for p in DOCS if any(s.gpu for s in snippets(p))]))
def test_doc_snippets_run_on_a_gpu(path, tmp_path, monkeypatch):
    if not _gpu_available():
        pytest.skip("needs CuPy and a CUDA device")
    assert run_file(path, tmp_path, monkeypatch, with_gpu=True) == len(snippets(path))
