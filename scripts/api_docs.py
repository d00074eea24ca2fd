#!/usr/bin/env python3
"""Write docs/api.md, the API reference, from the docstrings and signatures of unickpt.

    python scripts/api_docs.py           # regenerate docs/api.md
    python scripts/api_docs.py --check   # exit 1 when docs/api.md is out of date

Every name of ``unickpt.__all__`` is documented (names not placed in a section below go to
"Other"), with the reports, the tools and the errors; a class lists its constructor's
arguments, its fields (with their attribute docstrings) and its public methods and properties.
A test (tests/test_api_docs.py) fails when the file differs from what this script writes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"

# (title, names): a name is an attribute of ``unickpt`` or a dotted path ``module:name``.
SECTIONS: list[tuple[str, list[str]]] = [
    ("Saving and loading", ["save", "async_save", "load", "prepare_staging", "wait_pending"]),
    (
        "Futures and reports",
        ["SaveFuture", "unickpt.engine.futures:SaveReport", "unickpt.engine.load:LoadReport"],
    ),
    ("Training loops", ["Checkpointer", "RNGState", "MemoryTier"]),
    (
        "Leaves of a state",
        ["PerRank", "ShardedTensor", "FlatShard", "Fused", "Padded", "Replicated"],
    ),
    ("Layout rules", ["fused_glu", "fused_qkv", "padded_vocab", "replicated"]),
    (
        "Recovery in place (unickpt run)",
        [
            "recover",
            "unickpt.launch:current_epoch",
            "unickpt.launch:Epoch",
            "unickpt.launch:Recovery",
        ],
    ),
    ("Settings", ["Config", "get_config"]),
    (
        "Tools (unickpt.tools)",
        [
            "unickpt.tools:inspect_checkpoint",
            "unickpt.tools:verify_checkpoint",
            "unickpt.tools:diff_checkpoints",
            "unickpt.tools:export_checkpoint",
            "unickpt.tools:import_checkpoint",
        ],
    ),
    (
        "Errors",
        [
            "CheckpointError",
            "CheckpointCorruptError",
            "CheckpointExistsError",
            "CheckpointLockedError",
            "CheckpointMismatchError",
            "CheckpointNotFoundError",
            "CheckpointVersionError",
            "DistributedCheckpointError",
            "UnsafeObjectError",
            "RecoveryError",
            "MembershipChanged",
        ],
    ),
]

HEADER = """\
# API reference

Generated from the docstrings by `python scripts/api_docs.py` (a test checks that this file is
up to date); do not edit it by hand. Start with the [README](../README.md); the concepts are
in [architecture.md](architecture.md), the formats in [formats.md](formats.md).
"""


def resolve(name: str) -> tuple[str, Any]:
    """The public name and the object ``name`` designates."""
    import unickpt

    if ":" in name:
        module, attr = name.split(":")
        public = module if module in ("unickpt.tools", "unickpt.launch") else "unickpt"
        return f"{public}.{attr}", getattr(importlib.import_module(module), attr)
    return f"unickpt.{name}", getattr(unickpt, name)


def render() -> str:
    import unickpt

    placed = {n.split(":")[-1] for _, names in SECTIONS for n in names}
    other = sorted(n for n in unickpt.__all__ if n not in placed)
    sections = [*SECTIONS, *([("Other", other)] if other else [])]
    parts = [HEADER, "## Contents\n"]
    for title, names in sections:
        links = ", ".join(f"[`{resolve(n)[0].rsplit('.', 1)[1]}`](#{anchor(n)})" for n in names)
        parts.append(f"- {title}: {links}")
    parts.append("")
    for title, names in sections:
        parts.append(f"## {title}\n")
        for name in names:
            public, obj = resolve(name)
            parts.append(document(public, obj, anchor(name)))
    return "\n".join(parts).rstrip() + "\n"


def anchor(name: str) -> str:
    return "api-" + name.split(":")[-1].lower()


def document(public: str, obj: Any, tag: str) -> str:
    if inspect.isclass(obj):
        return document_class(public, obj, tag)
    return "\n".join(
        [
            f'<a id="{tag}"></a>\n### `{public}`\n',
            code(signature(public, obj)),
            docstring(obj),
            "",
        ]
    )


def document_class(public: str, cls: type, tag: str) -> str:
    lines = [f'<a id="{tag}"></a>\n### class `{public}`\n']
    if issubclass(cls, BaseException):
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        lines += [f"Subclass of {bases}.\n", docstring(cls), ""]
        return "\n".join(lines)
    lines += [code(signature(public, cls)), docstring(cls), ""]
    if dataclasses.is_dataclass(cls):
        lines += fields_table(cls)
    for name, member in members(cls):
        kind = "property" if isinstance(member, property) else "method"
        target = member.fget if isinstance(member, property) else member
        head = f"`.{name}`" if kind == "property" else f"`.{name}{params(target)}`"
        text = docstring(target).replace("\n", "\n  ") or "(undocumented)"
        lines.append(f"- {kind} {head}: {text}")
    return "\n".join(lines).rstrip() + "\n"


def members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by ``cls`` (not inherited from object)."""
    found = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isfunction(member):
            found.append((name, member))
    return found


def fields_table(cls: Any) -> list[str]:
    notes = attribute_docs(cls)
    rows = ["| field | type | default | what it is |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = default_text(f)
        note = markdown(" ".join(notes.get(f.name, "").split()))
        cells = [f"`{f.name}`", f"`{f.type}`", default, note]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return [*rows, ""]


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory.__name__}()`"
    return "required"


def attribute_docs(cls: type) -> dict[str, str]:
    """The string literals that follow a class's annotated attributes."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for this, following in itertools.pairwise(body):
        if (
            isinstance(this, ast.AnnAssign)
            and isinstance(this.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            out[this.target.id] = inspect.cleandoc(following.value.value)
    return out


def signature(public: str, obj: Any) -> str:
    """``public(arg: type = default, ...) -> result``, one argument a line when long."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    args = arguments(target)
    sig = inspect.signature(target)
    result = ""
    if not inspect.isclass(obj) and sig.return_annotation is not inspect.Signature.empty:
        result = f" -> {annotation_text(sig.return_annotation)}"
    text = f"{public}({', '.join(args)}){result}"
    if len(text) <= 96:
        return text
    body = "".join(f"    {a},\n" for a in args)
    return f"{public}(\n{body}){result}"


def params(func: Any) -> str:
    return f"({', '.join(arguments(func))})"


def arguments(func: Any) -> list[str]:
    """The arguments as written in the source: ``name: type = default``, ``*`` before the
    keyword-only ones, without ``self``."""
    out: list[str] = []
    star = False
    for p in inspect.signature(func).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        if p.annotation is not p.empty:
            text += f": {annotation_text(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {clean(repr(p.default))}" if p.annotation is not p.empty else ""
            text += "" if p.annotation is not p.empty else f"={clean(repr(p.default))}"
        out.append(text)
    return out


def annotation_text(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return clean(text)


def clean(text: str) -> str:
    """Signatures without addresses of objects (stable across runs)."""
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", text)


_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc):`~?([^`]+)`")


def markdown(line: str) -> str:
    """reStructuredText's roles and double backquotes as Markdown code."""
    line = _ROLE.sub(lambda m: f"`{m.group(1)}`", line)
    return line.replace("``", "`")


def docstring(obj: Any) -> str:
    """The docstring in Markdown, with its doctest examples as Python code blocks."""
    doc = inspect.getdoc(obj) or ""
    out: list[str] = []
    block: list[str] = []
    for line in doc.splitlines():
        if line.lstrip().startswith((">>> ", "... ")) or line.strip() in (">>>", "..."):
            stripped = line.lstrip()[4:]
            block.append(stripped.split("  # doctest:")[0].rstrip())
            continue
        if block:
            out.append(code("\n".join(block)))
            block = []
        out.append(markdown(line))
    if block:
        out.append(code("\n".join(block)))
    return "\n".join(out).strip()


def code(text: str) -> str:
    return f"```python\n{text}\n```\n"


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
