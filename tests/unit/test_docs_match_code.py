"""The docs say what the code is (issue 44, item 7). Everything here is read
from the tree as it is, so a module, test, variable or command that moves
makes the doc that names it fail here.

Rules:

1. **Layers table** (docs/architecture.md, "Layers"; the packages are
   ``tools/check_layout.py``'s ``layers()``, their files its ``modules()``).
   The "modules" cell of package P's row names every module of P:

   * ``P/x.py`` as the code span `` `x.py` `` anywhere in the cell;
   * a sub-package ``P/s/`` as `` `s/` ``, followed by one parenthesised list
     (nested parentheses allowed); a module ``P/s/x.py`` is named when that
     list holds the code span `` `x` `` (or `` `x.py` ``) or the bare item
     ``x`` (items part at top-level commas and semicolons).

   And nothing stale: a `` `x.py` `` span in the cell is a file of P (or, with
   a slash, a path from the repository root), every `` `s/` `` a folder of P,
   and every item of a sub-package's list that is a bare name or opens with a
   code span of a name is a module of that sub-package.
2. **Layout** (docs/architecture.md, "Layout", one code block; an entry is a
   line that starts in column 0: the paths, then the description, which may
   go on over indented lines). Every path of an entry exists; every
   top-level folder of the repository (what git tracks or would add) is, or
   holds, an entry's path; a layer package's entry names each of its
   sub-packages as ``s/``, and, outside parentheses (which explain), names no
   module of another layer package that its own package lacks (``tiling``
   under ``exporters/`` is wrong); an
   ``x.py``, ``x.md`` or ``x/`` in an entry's description exists under the
   entry's folder, and the ``docs/`` entry names every page of docs/.
3. **Files a doc names** (README.md, docs/*.md): a path that starts with a
   top-level folder of the repository (``tests/e2e/test_e2e_tp.py``,
   ``kvtrace/store/testing.py``, ``tools/tp_probe.sh``, ``kvlens/stack``)
   exists, file or folder; a bare
   ``test_*.py`` is a file under tests/, a bare ``bench_*.py`` one under
   benchmarks/.
4. **Environment variables a doc names**: every ``KVLENS_*`` name, and every
   name of three or more characters a doc sets (``NAME=value`` or
   ``export NAME``), occurs as a word in
   the repository's code (``*.py``, ``*.sh``, the Makefile; outside docs and
   this file): something reads, sets or tests it. The few that only other
   software reads are in :data:`READ_ELSEWHERE`, each with its reader.
5. **Commands**: every subcommand of ``kvlens/cli.py``'s parser opens a row
   (`` `kvlens NAME ...` ``) of docs/production.md's "Commands" table; every
   option of the commands that read a store (:data:`READ_COMMANDS`: few
   options each, all in their rows) appears in that table; every option of
   every subcommand appears in README.md or docs/ (the services' many
   options are in their own pages: routers.md, security.md, links.md, ...).
6. **Setup**: every Debian package the Makefile's ``apt-get install`` installs
   is named in README.md.
7. **Dotted names** a doc gives under a layer package
   (``kvtrace.stuck.stuck``, ``kvrecord.semconv.SPAN_HANDOFF_OPEN``): the
   longest prefix that is a module exists and the part after it, if any, is a
   word of that module's source. Under ``kvlens`` a name whose second part is
   no module of ``kvlens/`` is a span attribute key (``kvlens.cpu.wait_s``):
   some string of the layer packages' code is that key or starts with it
   and a dot (``kvlens.prefill.*``).
8. **Size caps**: the Layers section states ``tools/check_layout.py``'s caps
   as "no file over N lines, no function over M lines" and its warning
   levels as "past N lines (a file) or M lines (a function)".
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCH = REPO / "docs" / "architecture.md"

_spec = importlib.util.spec_from_file_location("check_layout", REPO / "tools" / "check_layout.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

#: Variables a doc sets that only other software reads: name -> the reader.
READ_ELSEWHERE = {
    "OMP_NUM_THREADS": "OpenMP (vLLM's CPU worker sets it per rank: docs/tensor-parallel.md)",
    "OMP_PLACES": "OpenMP (vLLM's CPU worker sets it per rank)",
    "OMP_PROC_BIND": "OpenMP (vLLM's CPU worker sets it per rank)",
    "PYTHONPATH": "Python itself (docs/fleet.md: a benchmark run against another checkout)",
}

#: The commands that read a store: their options all belong in production.md's table.
READ_COMMANDS = ("traces", "verdict", "whatif")

CODE_SPAN = re.compile(r"`([^`]+)`")
ENV_NAME = re.compile(r"\b[A-Z][A-Z0-9_]+\b")


# --- helpers ---------------------------------------------------------------


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no '## {title}' section"
    return m.group(1)


def cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def layer_cells(text: str) -> dict[str, str]:
    """Layer package -> its row's "modules" cell (the table's third column)."""
    out = {}
    for line in section(text, "Layers").splitlines():
        m = re.match(r"^\|\s*`([A-Za-z_]\w*)/`\s*\|", line)
        if m:
            out[m.group(1)] = cells(line)[2]
    return out


def group_after(cell: str, start: int) -> str | None:
    """The parenthesised text that opens at or after ``start`` (only blanks
    before it), nested parentheses included, without the outer pair."""
    i = start
    while i < len(cell) and cell[i] == " ":
        i += 1
    if i >= len(cell) or cell[i] != "(":
        return None
    depth = 0
    for j in range(i, len(cell)):
        depth += {"(": 1, ")": -1}.get(cell[j], 0)
        if depth == 0:
            return cell[i + 1 : j]
    return None


def sub_groups(cell: str) -> dict[str, str]:
    """`` `s/` (list) `` in a cell: sub-package -> its list ('' if none)."""
    out = {}
    for m in re.finditer(r"`([A-Za-z_]\w*)/`", cell):
        out.setdefault(m.group(1), group_after(cell, m.end()) or "")
    return out


def items_text(text: str) -> str:
    """``text`` without its parenthesised parts (nested ones included)."""
    flat, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            flat.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(flat)


def items(group: str) -> list[str]:
    """The top-level items of a list: nested parentheses dropped, parted at , and ;."""
    return [i.strip() for i in re.split(r"[,;]", items_text(group))]


def named_in_group(name: str, group: str) -> bool:
    spans = set(CODE_SPAN.findall(group))
    return name in spans or f"{name}.py" in spans or name in items(group)


def item_name(item: str) -> str | None:
    """The module an item names: a bare name, or the code span it opens with."""
    if re.fullmatch(r"[a-z_]\w*", item):
        return item
    m = re.match(r"`([a-z_]\w*)(?:\.py)?`", item)
    return m.group(1) if m else None


def layers_problems(text: str, root: Path = REPO) -> list[str]:
    """Rule 1 on ``text`` (architecture.md) against the tree at ``root``."""
    rows = layer_cells(text)
    bad = []
    for pkg in layout.layers(root):
        cell = rows.get(pkg, "")
        groups = sub_groups(cell)
        pkg_dir = root / pkg
        for f in sorted(pkg_dir.rglob("*.py")):
            rel = f.relative_to(pkg_dir)
            if rel == Path("__init__.py"):
                continue
            if rel.name == "__init__.py":
                if rel.parent.parts[0] not in groups:
                    bad.append(f"{pkg}/{rel.parent}/: its row does not name `{rel.parts[0]}/`")
            elif len(rel.parts) == 1:
                if f"`{rel.name}`" not in cell:
                    bad.append(f"{pkg}/{rel}: its row does not name `{rel.name}`")
            else:
                sub, name = rel.parts[0], "/".join(rel.with_suffix("").parts[1:])
                if not named_in_group(name, groups.get(sub, "")):
                    bad.append(f"{pkg}/{rel}: `{sub}/` (...) in its row does not list {name}")
        for span in CODE_SPAN.findall(cell):
            if span.endswith(".py"):
                where = root / span if "/" in span else pkg_dir / span
                if not where.is_file():
                    bad.append(f"{pkg}/ row names `{span}`, which is no file ({where.relative_to(root)})")
        for sub, group in groups.items():
            if not (pkg_dir / sub).is_dir():
                bad.append(f"{pkg}/ row names `{sub}/`, which is no folder of {pkg}/")
                continue
            for item in items(group):
                name = item_name(item)
                if name and not (pkg_dir / sub / f"{name}.py").is_file() and not (pkg_dir / sub / name).is_dir():
                    bad.append(f"{pkg}/ row lists {name} under `{sub}/`, which has no {name}.py")
    return bad


def layout_entries(text: str) -> list[tuple[list[str], str]]:
    """The Layout block's entries: (paths, description)."""
    block = re.search(r"```[^\n]*\n(.*?)```", section(text, "Layout"), re.S)
    assert block, "the Layout section has no code block"
    out: list[tuple[list[str], str]] = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        if line[0] != " ":
            head, _, desc = re.sub(r"\s{2,}", "\0", line, count=1).partition("\0")
            out.append(([p.strip() for p in head.split(",")], desc))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + " " + line.strip())
    return out


def top_folders(root: Path = REPO) -> set[str]:
    """Top-level folders holding files git tracks or would add."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {f.split("/")[0] for f in files if "/" in f and (root / f).exists() and not f.startswith(".")}


def module_names(pkg: str, root: Path = REPO) -> set[str]:
    """The last part of every module and sub-package name under ``pkg``."""
    out = set()
    for f in (root / pkg).rglob("*.py"):
        rel = f.relative_to(root / pkg)
        out |= set(rel.parent.parts) | ({f.stem} if f.stem != "__init__" else set())
    return out


def layout_problems(text: str, root: Path = REPO) -> list[str]:
    """Rule 2 on ``text`` (architecture.md) against the tree at ``root``."""
    entries = layout_entries(text)
    bad = []
    named = [p.rstrip("/") for paths, _ in entries for p in paths]
    for p in named:
        if not (root / p).exists():
            bad.append(f"Layout names {p}, which does not exist")
    for top in sorted(top_folders(root)):
        if not any(p == top or p.startswith(top + "/") for p in named):
            bad.append(f"Layout has no entry for the folder {top}/")
    pkgs = layout.layers(root)
    names = {pkg: module_names(pkg, root) for pkg in pkgs}
    for paths, desc in entries:
        for p in (p.rstrip("/") for p in paths):
            folder = root / p
            if not folder.is_dir():
                continue
            for token in re.findall(r"(?<![\w./-])([A-Za-z_][\w.-]*(?:\.py|\.md|/))(?![\w/])", desc):
                t = token.rstrip("/")
                if not any(folder.rglob(t)) and not (folder / t).exists():
                    bad.append(f"Layout: {p}/ names {token}, which is not under {p}/")
            if p == "docs":
                for page in sorted(folder.glob("*.md")):
                    if not re.search(rf"(?<![\w-]){re.escape(page.name)}", desc):
                        bad.append(f"Layout: docs/ does not name {page.name}")
            if p in pkgs:
                for sub in sorted(d.name for d in folder.iterdir() if (d / "__init__.py").is_file()):
                    if not re.search(rf"(?<![\w/]){sub}/", desc):
                        bad.append(f"Layout: {p}/ does not name its sub-package {sub}/")
                others = set().union(*(names[q] for q in pkgs if q != p)) - names[p]
                bare = items_text(desc)
                for word in sorted(set(re.findall(r"(?<![\w./-])[a-z_][a-z0-9_]*(?![\w./-])", bare)) & others):
                    bad.append(f"Layout: {p}/ names {word}, a module of another package that {p}/ lacks")
    return bad


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def named_files_problems(root: Path = REPO) -> list[str]:
    """Rule 3 over README.md and docs/*.md."""
    tops = top_folders(root)
    tests = {f.name for f in (root / "tests").rglob("test_*.py")}
    benches = {f.name for f in (root / "benchmarks").rglob("bench_*.py")}
    bad = []
    for doc in doc_files(root):
        text = doc.read_text()
        for path in sorted(set(re.findall(r"(?<![\w./-])([A-Za-z_][\w-]*/[\w./-]*\w)", text))):
            if path.split("/")[0] in tops and not (root / path).exists():
                bad.append(f"{doc.relative_to(root)} names {path}, which does not exist")
        for name in sorted(set(re.findall(r"(?<![\w./-])(test_\w+\.py)", text)) - tests):
            bad.append(f"{doc.relative_to(root)} names {name}, no file under tests/")
        for name in sorted(set(re.findall(r"(?<![\w./-])(bench_\w+\.py)", text)) - benches):
            bad.append(f"{doc.relative_to(root)} names {name}, no file under benchmarks/")
    return bad


def dotted_problems(root: Path = REPO) -> list[str]:
    """Rule 7 over README.md and docs/*.md."""
    pkgs = layout.layers(root)
    mods = layout.modules(root)
    strings = {
        node.value
        for f in mods.values()
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    pattern = re.compile(rf"(?<![\w./-])((?:{'|'.join(pkgs)})(?:\.[A-Za-z_]\w*)+)")
    bad = []
    for doc in doc_files(root):
        for name in sorted(set(pattern.findall(doc.read_text()))):
            if re.search(r"\.(png|md|py|json|ya?ml|db|toml|sh)$", name):  # a file name (dashboard.png)
                continue
            parts = name.split(".")
            k = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods), default=0)
            if parts[0] == "kvlens" and k == 1:
                if not any(x == name or x.startswith(name + ".") for x in strings):
                    bad.append(f"{doc.relative_to(root)} names {name}: no module, and no attribute key of the code")
            elif k < len(parts) and not re.search(rf"\b{parts[k]}\b", mods[".".join(parts[:k])].read_text()):
                bad.append(f"{doc.relative_to(root)} names {name}: {'.'.join(parts[:k])} has no {parts[k]}")
    return bad


def code_words(root: Path = REPO) -> set[str]:
    """Every upper-case word of the repository's code (not docs/, not this file)."""
    words: set[str] = set()
    skip = {Path(__file__).resolve()}
    files = [root / "Makefile"]
    for top in top_folders(root) - {"docs"}:
        files += [f for f in (root / top).rglob("*") if f.suffix in (".py", ".sh")]
    for f in files:
        if f.resolve() not in skip and f.is_file():
            words |= set(ENV_NAME.findall(f.read_text(errors="replace")))
    return words


def documented_env_vars(root: Path = REPO) -> dict[str, str]:
    """Rule 4's names: variable -> the first doc that names it."""
    out: dict[str, str] = {}
    for doc in doc_files(root):
        text = doc.read_text()
        found = re.findall(r"\b(KVLENS_[A-Z0-9_]+)\b", text)
        found += re.findall(r"(?<![\w$/])([A-Z][A-Z0-9_]+[A-Z0-9])=", text)
        found += re.findall(r"\bexport\s+([A-Z][A-Z0-9_]+[A-Z0-9])\b", text)
        for name in found:
            out.setdefault(name, str(doc.relative_to(root)))
    return out


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from kvlens.cli import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def command_table() -> list[str]:
    """The first cells of docs/production.md's "Commands" table."""
    text = section((REPO / "docs" / "production.md").read_text(), "Commands")
    return [cells(line)[0] for line in text.splitlines() if line.startswith("| `")]


# --- the tests --------------------------------------------------------------


def test_every_module_is_in_its_layers_row():
    bad = layers_problems(ARCH.read_text())
    assert not bad, "docs/architecture.md, Layers table:\n" + "\n".join(bad)


def test_the_layout_section_is_the_folders():
    bad = layout_problems(ARCH.read_text())
    assert not bad, "docs/architecture.md, Layout:\n" + "\n".join(bad)


def test_every_file_a_doc_names_exists():
    bad = named_files_problems()
    assert not bad, "\n".join(bad)


def test_every_dotted_name_a_doc_gives_is_in_the_code():
    bad = dotted_problems()
    assert not bad, "\n".join(bad)


def test_every_environment_variable_a_doc_names_is_in_the_code():
    words = code_words()
    bad = [
        f"{doc} names {name}, which no code reads or sets"
        for name, doc in sorted(documented_env_vars().items())
        if name not in words and name not in READ_ELSEWHERE
    ]
    assert not bad, "\n".join(bad)


def test_every_command_has_a_row_in_productions_command_table():
    rows = command_table()
    missing = [n for n in subcommands() if not any(re.match(rf"`kvlens {n}\b", r) for r in rows)]
    assert not missing, f"docs/production.md, Commands: no row for kvlens {', '.join(missing)}"


def options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]


def mentions(text: str, option: str) -> bool:
    return re.search(rf"{re.escape(option)}(?![\w-])", text) is not None


def test_every_option_of_the_read_commands_is_in_productions_command_table():
    table = section((REPO / "docs" / "production.md").read_text(), "Commands")
    commands = subcommands()
    missing = [f"kvlens {c} {o}" for c in READ_COMMANDS for o in options(commands[c]) if not mentions(table, o)]
    assert not missing, f"docs/production.md, Commands: not described: {missing}"


def test_every_option_of_every_command_is_in_the_docs():
    docs = "\n".join(d.read_text() for d in doc_files())
    missing = [f"kvlens {c} {o}" for c, p in subcommands().items() for o in options(p) if not mentions(docs, o)]
    assert not missing, f"options no page of README.md or docs/ names: {missing}"


def test_readme_names_every_debian_package_setup_installs():
    makefile = (REPO / "Makefile").read_text()
    installs = re.findall(r"apt-get install\s+((?:-\S+\s+)*)([a-z0-9 .+-]+)", makefile)
    assert installs, "the Makefile installs no Debian package (apt-get install)"
    packages = {p for _, names in installs for p in names.split()}
    readme = (REPO / "README.md").read_text()
    missing = sorted(p for p in packages if not re.search(rf"`{re.escape(p)}`", readme))
    assert not missing, f"README.md does not name (as `pkg`) the Debian packages setup installs: {missing}"


def test_architecture_states_check_layouts_size_caps():
    text = section(ARCH.read_text(), "Layers")
    text = re.sub(r"\s+", " ", text)
    caps = re.search(r"no file over (\d+) lines, no function over (\d+) lines", text)
    warns = re.search(r"past (\d+) lines \(a file\) or (\d+) lines \(a function\)", text)
    assert caps and warns, "docs/architecture.md, Layers: the size caps' sentences are gone"
    assert tuple(map(int, caps.groups())) == (layout.MAX_FILE_LINES, layout.MAX_FUNC_LINES), caps.group(0)
    assert tuple(map(int, warns.groups())) == (layout.WARN_FILE_LINES, layout.WARN_FUNC_LINES), warns.group(0)


# --- the checkers catch what they should ------------------------------------


def _tree(tmp_path: Path, arch: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(arch)
    for rel in ("low/__init__.py", "low/a.py", "low/b.py", "low/sub/__init__.py", "low/sub/c.py", "top/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    return tmp_path


def test_the_layers_check_catches_a_missing_and_a_stale_module(tmp_path):
    arch = (
        "## Layers\n\n| folder | layer | modules | job |\n|---|---|---|---|\n"
        "| `low/` | low | `a.py`, `gone.py`, `sub/` (`c` the c; old, two words (y, z)) | j |\n"
        "| `top/` | top | | j |\n\n## Next\n"
    )
    bad = layers_problems(arch, _tree(tmp_path, arch))
    assert any("low/b.py" in b for b in bad), bad
    assert any("`gone.py`" in b for b in bad), bad
    assert any("lists old under `sub/`" in b for b in bad), bad
    assert not any("lists two" in b or "sub/c.py" in b or "lists y" in b for b in bad), bad
    assert len(bad) == 3, bad


def test_the_layout_check_catches_a_module_in_the_wrong_folder(tmp_path):
    arch = (
        "## Layers\n\n| folder | layer | modules | job |\n|---|---|---|---|\n"
        "| `low/` | low | | j |\n| `top/` | top | | j |\n\n## Layout\n\n```\n"
        "low/   a, b (the b)\n"
        "top/   c, sub/ (wrong package, but a, b in parentheses explain), gone.py\n"
        "docs/  architecture.md\n```\n"
    )
    root = _tree(tmp_path, arch)
    (root / "tools").mkdir()
    (root / "tools" / "t.py").write_text("")
    bad = layout_problems(arch, root)
    assert "Layout has no entry for the folder tools/" in bad, bad
    assert "Layout: low/ does not name its sub-package sub/" in bad, bad
    assert "Layout: top/ names c, a module of another package that top/ lacks" in bad, bad
    assert "Layout: top/ names gone.py, which is not under top/" in bad, bad
    assert "Layout: top/ names sub/, which is not under top/" in bad, bad
    assert len(bad) == 5, bad


def test_the_dotted_name_check_catches_a_moved_module_and_a_gone_function(tmp_path):
    arch = "## Layers\n\n| folder | layer | modules | job |\n|---|---|---|---|\n| `low/` | low | | j |\n"
    root = _tree(tmp_path, arch)
    (root / "low" / "a.py").write_text("def f():\n    pass\n")
    (root / "README.md").write_text("`low.a.f`, `low.a` and `low.png` are fine; `low.a.g` and `low.gone.h` are not\n")
    bad = dotted_problems(root)
    assert bad == ["README.md names low.a.g: low.a has no g", "README.md names low.gone.h: low has no gone"], bad


def test_the_named_files_check_catches_a_gone_file_and_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_here.py").write_text("")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "README.md").write_text(
        "`tests/unit`, `tests/unit/test_here.py` and `test_here.py` exist; `tests/gone.py`, `tests/nowhere` "
        "and `test_gone.py` do not; `P/D` and `docs/<page>.md` are no paths\n"
    )
    assert named_files_problems(tmp_path) == [
        "README.md names tests/gone.py, which does not exist",
        "README.md names tests/nowhere, which does not exist",
        "README.md names test_gone.py, no file under tests/",
    ]


def test_the_env_var_reader_finds_settings_not_prose(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "export KVLENS_A=1 OTHER_B=$(cat x)\n`FOO_BAR=1 cmd` and KVLENS_C in prose; MAX_PHASES is a constant;\n"
        "at TP=1, -subj /CN=host, `PGPASSWORD=... cmd`\n"
    )
    found = documented_env_vars(tmp_path)
    assert set(found) == {"KVLENS_A", "OTHER_B", "FOO_BAR", "KVLENS_C", "PGPASSWORD"}, found


@pytest.mark.parametrize(
    "item, name",
    [("schema", "schema"), ("`app` the ASGI receiver", "app"), ("its statistics are `kvtrace/stats.py`", None)],
)
def test_an_item_names_a_module_by_a_bare_name_or_its_opening_code_span(item, name):
    assert item_name(item) == name
