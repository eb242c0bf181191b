"""A griffe extension for the API reference: fence the docstrings' doctest examples.

optim's docstrings write their examples as bare doctests (`>>> ...` lines, then the expected output), which
pytest runs (`--doctest-modules`). Markdown would read `>>>` as nested block quotes and `[0.5, 1.0]` in an
output line as a link, so this wraps each run of doctest lines, up to the next blank line, in a ```pycon fence.
It also drops the parameters' type annotations from the rendered lists: loaded by inspection (which gives the
rules' dataclass signatures), an alias such as `Hyper` would show as a bare `Union`; the docstrings say what each
parameter takes. The docstrings and the code are not changed.
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen: set[int] = set()

        def walk(obj: griffe.Object) -> None:
            if id(obj) in seen or obj.is_alias:
                return
            seen.add(id(obj))
            for param in getattr(obj, "parameters", None) or ():
                param.annotation = None
            for member in obj.members.values():
                walk(member)

        walk(pkg)
