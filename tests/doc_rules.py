"""What a page of the manual must hold to be read, not only looked up
(tests/test_docs.py checks every page of docs/ and README.md):

- prose in pieces: a paragraph, a list item or a definition runs to at most
  PARAGRAPH_LINES lines of LINE_CHARS characters (as the site renders it,
  not as the source wraps it); a table cell holds at most CELL_WORDS words;
- GPU status in one place: outside docs/gpu.md, no sentence says what was
  verified on a GPU or is not yet (a sentence naming a GPU, CUDA or NCCL
  together with words of status).

Also a command line, for writing pages:

    python3 tests/doc_rules.py docs/*.md README.md
"""

import math
import re
import sys

PARAGRAPH_LINES = 8
LINE_CHARS = 100
CELL_WORDS = 45

GPU_WORDS = re.compile(r"\b(GPUs?|CUDA|NCCL|H100|H200|A100)\b")
STATUS_WORDS = re.compile(r"\b(verified|unverified|untested|not yet|tested on|has not run|"
                          r"have not run|never run|CPU tensors only|CPU-only|only on the CPU)\b", re.I)
GPU_PAGE = "gpu.md"

_ITEM = re.compile(r"\s*([-*+]|\d+\.)\s")


def prose_blocks(text):
    """(first line number, [lines]) of each paragraph, list item and
    definition outside code blocks, tables, headings and HTML comments."""
    blocks, current, start = [], [], 0
    fence = False
    comment = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
            if current:
                blocks.append((start, current))
            current = []
            continue
        if fence:
            continue
        if stripped.startswith("<!--"):
            comment = "-->" not in stripped
            continue
        if comment:
            comment = "-->" not in stripped
            continue
        new_piece = (not stripped or stripped.startswith(("|", "#")) or _ITEM.match(line)
                     or stripped.startswith(": "))
        if new_piece and current:
            blocks.append((start, current))
            current = []
        if not stripped or stripped.startswith(("|", "#")):
            continue
        if not current:
            start = number
        current.append(stripped)
    if current:
        blocks.append((start, current))
    return blocks


def rendered_lines(lines):
    """Lines of LINE_CHARS characters the joined text takes."""
    text = " ".join(lines)
    text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's target is not shown
    return math.ceil(len(text) / LINE_CHARS)


def long_paragraphs(text):
    """(line number, rendered lines) of each prose block over the limit."""
    return [(start, rendered_lines(lines)) for start, lines in prose_blocks(text)
            if rendered_lines(lines) > PARAGRAPH_LINES]


def long_cells(text):
    """(line number, words) of each table cell over CELL_WORDS words."""
    out = []
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
        if fence or not line.lstrip().startswith("|"):
            continue
        for cell in line.strip().strip("|").split("|"):
            words = len(re.sub(r"\]\([^)]*\)", "]", cell).split())
            if words > CELL_WORDS:
                out.append((number, words))
    return out


def gpu_status_sentences(text):
    """Sentences (with their line numbers) that state what runs or was
    verified on a GPU: they belong on docs/gpu.md only."""
    out = []
    for start, lines in prose_blocks(text):
        for sentence in re.split(r"(?<=[.;:])\s+", " ".join(lines)):
            if GPU_WORDS.search(sentence) and STATUS_WORDS.search(sentence):
                out.append((start, sentence[:160]))
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|") and GPU_WORDS.search(line) and STATUS_WORDS.search(line):
            out.append((number, line.strip()[:160]))
    return out


def problems(path, text=None):
    """Every rule a page breaks, as readable lines."""
    text = open(path).read() if text is None else text
    out = [f"{path}:{n}: a paragraph of {k} lines (at most {PARAGRAPH_LINES} of "
           f"{LINE_CHARS} characters)" for n, k in long_paragraphs(text)]
    out += [f"{path}:{n}: a table cell of {k} words (at most {CELL_WORDS})"
            for n, k in long_cells(text)]
    if not path.endswith("/" + GPU_PAGE) and path != GPU_PAGE:
        out += [f"{path}:{n}: GPU status belongs on docs/{GPU_PAGE}: {s!r}"
                for n, s in gpu_status_sentences(text)]
    return out


if __name__ == "__main__":
    found = [p for path in sys.argv[1:] for p in problems(path)]
    print("\n".join(found) or "no problems")
    sys.exit(1 if found else 0)
