"""The docs against the code: every command, flag and config key documented and none invented,
the generated pages complete and fresh, README a landing page, and the site building strictly.

The command reference (docs/commands.md) has one section per command, headed
``## `tvm-fusion NAME` `` (``###`` for a ``tuning-log`` action), whose table rows start with the
command's flags; the configuration reference (docs/configuration.md) one section per TOML table,
headed ``## `[name]` ``, whose rows start with the section's keys.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tvm_fusion import config
from tvm_fusion.cli import build_parser
from tvm_fusion.errors import TvmFusionError

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
HELP = {"-h", "--help"}
GLOBAL_AFTER_COMMAND = {"-q", "--quiet", "--wide"}  # taken after the command too, documented once


def _load_gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_docs", module)
    spec.loader.exec_module(module)
    return module


gen_docs = _load_gen_docs()


def _pages() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(DOCS.rglob("*.md"))}


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w/.`-])(--?[A-Za-z][\w-]*)", text.replace("`", " ")))


# --- the parser ------------------------------------------------------------------------------------

def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the root and every subcommand, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


PARSERS = dict(_parsers(build_parser()))
COMMANDS = {path: parser for path, parser in PARSERS.items() if path}
GLOBAL = _options(PARSERS[()])


# --- the command reference -------------------------------------------------------------------------

def _sections(text: str, heading: str) -> dict[str, str]:
    """Heading key -> its text up to the next heading, for headings matching ``heading``
    (a regex with one group, the key)."""
    sections, key, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("#"):
            if key is not None:
                sections[key] = "\n".join(lines)
            match = re.match(heading, line)
            key, lines = (match.group(1) if match else None), []
        elif key is not None:
            lines.append(line)
    if key is not None:
        sections[key] = "\n".join(lines)
    return sections


def _table_keys(section: str) -> list[str]:
    """The first cells of a section's table rows (the header row left out)."""
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [row.split("|")[1].strip() for row in rows[1:]]


COMMAND_SECTIONS = {tuple(key.split()): text for key, text in _sections(
    (DOCS / "commands.md").read_text(), r"^#{2,3} `tvm-fusion ([a-z][a-z -]*)`$").items()}


def test_every_command_is_documented_and_no_other():
    assert set(COMMAND_SECTIONS) == set(COMMANDS), (
        f"undocumented: {sorted(set(COMMANDS) - set(COMMAND_SECTIONS))}; "
        f"documented but not a command: {sorted(set(COMMAND_SECTIONS) - set(COMMANDS))}")


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_flag_of_a_command_is_documented_and_no_other(path):
    documented = set().union(*(_flags(cell) for cell in _table_keys(COMMAND_SECTIONS.get(path, ""))))
    real = _options(COMMANDS[path]) - HELP - GLOBAL_AFTER_COMMAND
    assert documented == real, (f"tvm-fusion {' '.join(path)}: undocumented {sorted(real - documented)}, "
                                f"documented but not a flag {sorted(documented - real)}")


def test_global_options_are_documented():
    section = _sections((DOCS / "commands.md").read_text(), r"^## (Global options)$")["Global options"]
    documented = set().union(*(_flags(cell) for cell in _table_keys(section)))
    assert documented == GLOBAL


def _command_lines(text: str):
    """Every ``tvm-fusion ...`` command line in code: fenced blocks line by line (``\\``
    continuations joined), inline code spans whole; cut at a comment, a pipe or ``&&``."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    candidates = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    candidates += re.findall(r"`([^`\n]+)`", prose)
    for candidate in candidates:
        for match in re.finditer(r"(?<![\w-])tvm-fusion\s+(.*)", candidate):
            yield re.split(r"\s(?:#|\|\s|&&|;)", match.group(1))[0]


def _allowed(path: tuple[str, ...]) -> set[str]:
    """A command's flags, its subcommands' (a line may name none of them) and the global ones."""
    return GLOBAL.union(*(_options(p) for q, p in COMMANDS.items() if q[:len(path)] == path))


DOCUMENTS = [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_use_real_commands_and_flags(document):
    problems = []
    for line in _command_lines(document.read_text()):
        words = line.split()
        path: tuple[str, ...] = ()
        while words and re.fullmatch(r"[a-z][a-z-]*", words[0]) and (*path, words[0]) in COMMANDS:
            path, words = (*path, words[0]), words[1:]
        if not path and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
            problems.append(f"{line!r}: no command {words[0]!r}")
        unknown = _flags(" ".join(words)) - _allowed(path)
        if unknown:
            problems.append(f"{line!r}: {sorted(unknown)} not flags of tvm-fusion {' '.join(path)}")
    assert not problems, "\n".join(problems)


# --- the configuration reference -------------------------------------------------------------------

CONFIG_SECTIONS = _sections((DOCS / "configuration.md").read_text(), r"^## `\[([a-z]+)\]`$")


def test_every_config_section_is_documented_and_no_other():
    assert set(CONFIG_SECTIONS) == set(config.SECTIONS)


@pytest.mark.parametrize("section", sorted(config.SECTIONS))
def test_every_config_key_is_documented_and_no_other(section):
    documented = {cell.strip("`") for cell in _table_keys(CONFIG_SECTIONS.get(section, ""))}
    known = config.SECTIONS[section]
    if known is None:  # free-form ([inputs]): one row for any key, no named keys
        assert documented == {"any dim name"}, documented
    else:
        assert documented == set(known), (f"[{section}]: undocumented {sorted(set(known) - documented)}, "
                                           f"documented but not a key {sorted(documented - set(known))}")


def _toml_blocks(text: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_examples_use_real_sections_and_keys(document):
    for block in _toml_blocks(document.read_text()):
        raw = tomllib.loads(block)
        if "project" in raw:  # a pyproject.toml excerpt, not a pipeline config
            continue
        for section, keys in raw.items():
            assert section in config.SECTIONS, f"{document.name}: [{section}] is not a config section"
            known = config.SECTIONS[section]
            assert known is None or set(keys) <= set(known), \
                f"{document.name}: [{section}] {sorted(set(keys) - set(known))} are not config keys"


# --- generated pages -------------------------------------------------------------------------------

def test_pattern_catalogue_lists_every_registered_pattern_in_order():
    from tvm_fusion.patterns import pattern_registry

    registered = [name for name, rule in pattern_registry().items()
                  if type(rule).__module__.startswith("tvm_fusion.patterns.")]
    assert [rule.name for rule in gen_docs.builtin_patterns()] == registered
    catalogue = gen_docs.pattern_catalogue()
    assert re.findall(r"^### (\w+) \{#", catalogue, flags=re.MULTILINE) == registered


def test_schedule_catalogue_lists_every_rule_in_order():
    from tvm_fusion.schedules.registry import rule_name, rules_for_kind

    catalogue = gen_docs.schedule_catalogue()
    for kind in gen_docs.SCHEDULE_KINDS:
        asked = [rule_name(rule) for rule in rules_for_kind(kind)
                 if type(rule).__module__.startswith(("tvm_fusion.", "tvm."))]
        assert [rule_name(rule) for rule in gen_docs.builtin_schedule_rules(kind)] == asked
        title = gen_docs.SCHEDULE_KINDS[kind]
        part = catalogue.split(f"### {title}")[1].split("\n### ")[0]
        listed = re.findall(r"^\| \d+ \| \[?`(\w+)`", part, flags=re.MULTILINE)
        assert listed == asked, kind


def test_hand_written_notes_name_registered_patterns_and_rules():
    """The notes under each catalogue (``- **`name`**: ...``) name only what the registries hold."""
    from tvm_fusion.patterns import pattern_registry
    from tvm_fusion.schedules.registry import rule_name, rules_for_kind

    rules = {rule_name(rule) for kind in gen_docs.SCHEDULE_KINDS for rule in rules_for_kind(kind)}
    for page, known in (("patterns.md", set(pattern_registry())), ("schedules.md", rules)):
        named = set(re.findall(r"\*\*`(\w+)`\*\*", (DOCS / page).read_text()))
        assert named, page
        assert named <= known, f"{page} has notes on {sorted(named - known)}, which are not registered"


def test_fused_onnx_spec_defines_every_op_and_no_other():
    """docs/onnx-ops.md is the spec of the tvm_fusion ONNX domain: one row per op (or a few ops),
    naming in parentheses the patterns whose matches are written as it."""
    from tvm_fusion.patterns import pattern_registry

    exported = {name: ops for name, ops in gen_docs.fused_onnx_ops().items()
                if type(pattern_registry()[name]).__module__.startswith("tvm_fusion.patterns.")}
    assert exported, "no pattern has a fused ONNX op"
    section = _sections((DOCS / "onnx-ops.md").read_text(), r"^## (The ops)$")["The ops"]
    rows = {}  # op -> the patterns its row names
    for cell in _table_keys(section):
        ops = re.findall(r"`(\w+)`", cell)
        named = re.search(r"\(([\w, ]+)\)", cell)
        for op in ops:
            rows[op] = {p.strip() for p in named.group(1).split(",")} if named else set()
    assert set(rows) == {op for ops in exported.values() for op in ops}
    for pattern, ops in exported.items():
        for op in ops:
            assert pattern in rows[op], f"the row of {op} does not name pattern {pattern}"
    assert set().union(*rows.values()) <= set(pattern_registry()), "a row names no registered pattern"


def test_source_map_lists_every_module():
    source_map = gen_docs.source_map()
    for path in sorted((ROOT / "tvm_fusion").rglob("*.py")):
        relative = path.relative_to(ROOT / "tvm_fusion")
        if any(part.startswith("_") and part != "__init__.py" for part in relative.parts):
            continue
        if path.name == "__init__.py":
            folder = path.parent.relative_to(ROOT).as_posix()
            assert f"### `{folder}/`" in source_map, folder
        else:
            section = source_map.split(f"### `{path.parent.relative_to(ROOT).as_posix()}/`")[1].split("\n### ")[0]
            assert f"| `{path.name}` |" in section, relative


def _markers() -> list[tuple[Path, str, str | None]]:
    return [(path, match.group(1), match.group(2)) for path, text in _pages().items()
            for match in gen_docs.MARKER.finditer(text)]


def test_every_generated_block_is_on_a_page_and_builds():
    markers = _markers()
    used = {name for _, name, _ in markers}
    assert used >= set(gen_docs.BLOCKS) - {"headline"}, set(gen_docs.BLOCKS) - used
    for path, name, argument in markers:
        assert gen_docs.block(name, argument).strip(), f"{path.name}: {name} {argument} is empty"


def test_every_results_file_has_a_table_with_machine_and_date():
    shown = {argument for _, name, argument in _markers() if name == "result"}
    on_disk = {path.name for path in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert shown == on_disk, f"not on any page: {sorted(on_disk - shown)}; no such file: {sorted(shown - on_disk)}"
    for name in sorted(on_disk):
        machine, date, _ = gen_docs.provenance(name)
        assert machine and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), name


def test_zoo_and_cnn_tables_carry_openvino_default_precision_where_measured():
    """OpenVINO at its default precision (and both rows' errors against ONNX Runtime) get columns
    in a results file that has them; files from before keep their columns."""
    model = {"model": "bert", "compiles": True, "ours_ms": 3.4, "openvino_ms": 3.4, "ratio_to_openvino": 1.0,
             "openvino_max_abs_error": 1.2e-6, "openvino_default_ms": 1.2, "ratio_to_openvino_default": 2.8,
             "openvino_default_precision": "bf16", "openvino_default_max_abs_error": 2.9e-3}
    zoo = gen_docs.render_zoo({"models": [model, {"model": "old", "compiles": True}]}).splitlines()
    assert "OpenVINO default ms (precision)" in zoo[0] and "| 1.200 (bf16) | 2.80x | 1.2e-06 / 2.9e-03 |" in zoo[2]
    assert "| - | - | - / - |" in zoo[3]
    assert "OpenVINO default" not in gen_docs.render_zoo({"models": [{"model": "old", "compiles": True}]})
    bench = {"medians_ms": {"onnxruntime": 2.0, "tvm_fusion": 1.0, "openvino": 1.0, "openvino_default": 0.5},
             "ratio_to_onnxruntime": {"tvm_fusion": 0.5}, "peer_precision": {"openvino_default": "bf16"},
             "max_abs_error": {"openvino": 1e-6, "openvino_default": 3e-3}}
    cnn = gen_docs.render_cnn({"resnet": bench}).splitlines()
    assert "| 0.500 (bf16) | 1.0e-06 / 3.0e-03 |" in cnn[2]


def test_the_zoo_table_carries_our_bf16_columns_only_where_measured():
    """A ``zoo_report.py --precision bf16`` file gets our bf16 time, its ratios to our float32
    and to OpenVINO's default, its error and its bf16 kernel count; other files keep their columns."""
    model = {"model": "bert", "compiles": True, "ours_ms": 3.4, "ours_bf16_ms": 2.1, "ratio_bf16_to_f32": 0.62,
             "ratio_bf16_to_openvino_default": 1.75, "bf16_max_abs_error": 4.2e-2, "bf16_kernels": 3}
    zoo = gen_docs.render_zoo({"models": [model, {"model": "old", "compiles": True}]}).splitlines()
    assert ("| ours bf16 ms | bf16 / f32 | bf16 / OpenVINO default | bf16 max abs err vs ORT | bf16 kernels |"
            in zoo[0])
    assert "| 2.100 | 0.62x | 1.75x | 4.2e-02 | 3 |" in zoo[2] and "| - | - | - | - | - |" in zoo[3]
    assert len({line.count("|") for line in zoo}) == 1
    assert "bf16" not in gen_docs.render_zoo({"models": [{"model": "old", "compiles": True, "ours_ms": 3.4}]})


def test_readme_headline_table_is_fresh():
    text = README.read_text()
    assert gen_docs.readme_with_headline(text) == text, "run: python scripts/gen_docs.py --readme"


# --- README ----------------------------------------------------------------------------------------

def test_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert "make demo" in README.read_text() and "make test" in README.read_text()


def test_readme_links_into_the_docs_resolve():
    for target in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):
        assert (ROOT / target).exists(), target


def _exit_code_table(text: str) -> list[str]:
    return re.findall(r"^\| (?:\d+|2 \(argparse\)) \|.*$", text, flags=re.MULTILINE)


def test_exit_code_tables_agree_and_cover_every_error():
    readme, reference = _exit_code_table(README.read_text()), _exit_code_table((DOCS / "commands.md").read_text())
    assert readme == reference
    codes = {int(row.split("|")[1]) for row in reference if "argparse" not in row}
    assert codes >= {cls.exit_code for cls in TvmFusionError.__subclasses__()} | {0, 130, 143}


# --- paths named in the docs -----------------------------------------------------------------------

# Files that an artifact, a tuning store or a command writes: not in the repository.
WRITTEN = {"metadata.json", "names.json", "kernels.json", "database_workload.json",
           "database_tuning_record.json", "paths.cmake", "CMakeLists.txt", "vm_runner.cc"}


@functools.cache
def _repository_files() -> tuple[frozenset[str], frozenset[str]]:
    """(paths relative to the root, file names) of the checkout, environments and builds left out."""
    skip = {".git", ".venv", "build", "__pycache__", ".pytest_cache"}
    relative, names = set(), set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.startswith(".venv")]
        for name in [*files, *subfolders]:
            relative.add((Path(folder) / name).relative_to(ROOT).as_posix())
            names.add(name)
    return frozenset(relative), frozenset(names)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_named_in_the_docs_exist(document):
    relative, names = _repository_files()
    missing = []
    for span in set(re.findall(r"`([\w./-]+\.(?:py|toml|sh|cc|json|md))`", document.read_text())):
        if span.startswith(("build/", "~", "out/")) or span in WRITTEN:
            continue
        if "/" in span:
            found = span in relative or any(r.endswith("/" + span) for r in relative)
        else:
            found = span in names
        if not found:
            missing.append(span)
    assert not missing, f"{document.name} names files that do not exist: {sorted(missing)}"


# --- the site --------------------------------------------------------------------------------------

def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: no broken link or anchor, no page missing from the nav, no
    generated block that fails. MkDocs is in the test extra: this never skips."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "patterns" / "index.html").exists()


def test_the_zoo_table_sets_a_quantized_model_beside_our_float_build_of_its_float_model():
    """A quantized model made from a zoo float one (``derived_from``) gets our float32 build of
    that model and the int8 / float32 ratio; other rows get dashes, other files no such columns."""
    derived = {"model": "bert-qdq", "compiles": True, "ours_ms": 2.0, "float_model": "bert", "float_ours_ms": 5.0}
    zoo = gen_docs.render_zoo({"models": [derived, {"model": "plain", "compiles": True, "ours_ms": 1.0}]}).splitlines()
    assert "| float model: ours float32 ms | ours int8 / ours float32 |" in zoo[0]
    assert "| 5.000 (bert) | 0.40x |" in zoo[2] and "| - | - |" in zoo[3]
    assert len({line.count("|") for line in zoo}) == 1
    assert "float model" not in gen_docs.render_zoo({"models": [{"model": "plain", "compiles": True}]})
