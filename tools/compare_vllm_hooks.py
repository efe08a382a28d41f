"""Compare the vLLM methods and fields kvlens hooks between the installed
vLLM and another release's wheel, by parsing the source (nothing imported,
so a CUDA wheel can be checked on a CPU machine).

    pip download --no-deps -d /tmp/w "vllm==0.33.*"
    .venv/bin/python tools/compare_vllm_hooks.py /tmp/w/vllm-0.33.0-*.whl

Prints one line per hook point (``same``, ``differs: ...`` or ``missing``)
and exits 1 when any hooked signature differs or is missing.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
#: dataclass fields the hooks read besides the hook points (file, class, field)
FIELDS = (
    ("tp_mapping.py", "ReadSpec", "remote_rank"),
    ("metadata.py", "RemoteMeta", "request_id"),
    ("metadata.py", "ReqMeta", "remote"),
)


def _classes(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    out = {}
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def _method(classes: dict[str, ast.ClassDef], cls: str, name: str) -> list[str] | None:
    """Argument names of ``cls.name``, following base classes by name."""
    seen = set()
    todo = [cls]
    while todo:
        c = classes.get(todo.pop(0))
        if c is None or c.name in seen:
            continue
        seen.add(c.name)
        for n in c.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                a = n.args
                return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        todo += [b.id for b in c.bases if isinstance(b, ast.Name)]
    return None


def _fields(classes: dict[str, ast.ClassDef], cls: str) -> set[str]:
    c = classes.get(cls)
    if c is None:
        return set()
    return {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _wheel_sources(path: str) -> dict[str, str]:
    with zipfile.ZipFile(path) as z:
        return {n[len(NIXL) :]: z.read(n).decode() for n in z.namelist() if n.startswith(NIXL) and n.endswith(".py")}


def _installed_sources() -> dict[str, str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    root = Path(spec.origin).parent / "distributed/kv_transfer/kv_connector/v1/nixl"
    return {p.name: p.read_text() for p in root.glob("*.py")}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from instrumented_connector import hooks

    mine, theirs = _classes(_installed_sources()), _classes(_wheel_sources(argv[0]))
    bad = n = 0
    for cls, methods in hooks.all_hooks().items():
        for m in methods:
            n += 1
            a, b = _method(mine, cls, m), _method(theirs, cls, m)
            state = "same" if a == b and a is not None else ("missing" if b is None else f"differs: {a} vs {b}")
            bad += state != "same"
            print(f"{cls}.{m}: {state}")
    for _file, cls, field in FIELDS:
        n += 1
        ok = field in _fields(theirs, cls)
        bad += not ok
        print(f"{cls}.{field} (field): {'present' if ok else 'missing'}")
    print(f"{n - bad} of {n} hook points and fields match")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
