"""ARCHITECTURE.md names real code: every `Class.method()`, `function()` and file or folder
path it writes in backticks exists in the production packages (or, for a path under
`tests/`, in the tests), so renaming a function or moving a module fails here rather than
leaving the walk through a request pointing at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "connector", "shared", "launch", "cli", "bench")


def _names() -> tuple[set[str], set[str], set[str]]:
    """Functions (any depth), `Class.member`s (methods and annotated fields), modules (dotted tails)."""
    functions: set[str] = set()
    members: set[str] = set()
    modules: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            dotted = path.relative_to(ROOT).with_suffix("").parts
            dotted = dotted[:-1] if dotted[-1] == "__init__" else dotted  # a package is its folder's name
            modules.update(".".join(dotted[start:]) for start in range(len(dotted)))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.add(node.name)
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            members.add(f"{node.name}.{item.name}")
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(f"{node.name}.{item.target.id}")
    return functions, members, modules


def _path_exists(token: str, files: list[str]) -> bool:
    wanted = token.rstrip("/")
    return any(file == wanted or file.endswith("/" + wanted) or f"/{wanted}/" in f"/{file}" for file in files)


def test_every_function_method_and_path_the_architecture_names_exists() -> None:
    functions, members, modules = _names()
    files = [path.relative_to(ROOT).as_posix() for package in (*PACKAGES, "tests")
             for path in (ROOT / package).rglob("*.py")]
    missing = []
    tokens = re.findall(r"`([^`\s]+)`", (ROOT / "ARCHITECTURE.md").read_text())
    for token in tokens:
        if match := re.fullmatch(r"([A-Za-z_][\w.]*)\.([A-Za-z_]\w*)\(\)", token):
            owner, name = match[1], match[2]
            found = f"{owner}.{name}" in members or (owner in modules and name in functions)
        elif match := re.fullmatch(r"([A-Za-z_]\w*)\(\)", token):
            found = match[1] in functions
        elif re.fullmatch(r"[\w./-]+\.py|[\w/-]+/", token):
            found = _path_exists(token, files)
        else:
            continue
        if not found:
            missing.append(token)
    assert len(tokens) > 100  # the walk is there to check
    assert not missing, f"ARCHITECTURE.md names what the code no longer has: {missing}"
