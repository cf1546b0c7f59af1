"""`tests/` mirrors `src/routereplay/`, so a package's tests are found where the package is.

- every package folder has a test folder of the same name (or one named in `TESTED_IN`);
- every test folder is a package folder's, or says in `NOT_A_PACKAGE` what it holds instead;
- every test folder is a Python package (`__init__.py`), so modules of the same name in two folders do not clash;
- a top-level `test_<name>.py` tests the root module `<name>` or is one of the repo-wide checks (`REPO_WIDE`);
- no test file or test function is named after an issue or item number (name the behaviour instead).
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "routereplay"

# package folders whose tests live in a test folder of another name
TESTED_IN = {"transport": "compact"}  # rank bundles and plans (tests/compact/); gloo jobs in tests/distributed/
# test folders that are not one package's, and what they hold
NOT_A_PACKAGE = {
    "compact": "transport's rank bundles and per-rank plans, and codec's EncodedRoutes they cut from",
    "distributed": "real multi-process gloo / torchrun jobs: route delivery, FSDP, Ulysses",
    "data": "golden files and recorded vLLM payloads (no tests)",
}
# top-level test files that check the repository as a whole rather than one root module
REPO_WIDE = {"docs", "layering", "public_names", "golden_files", "make_demo", "conftest_profile", "mirror"}
ISSUE_NAME = re.compile(r"^(def )?test_(issue|item)_?\d", re.M)


def folders(root: Path) -> set[str]:
    return {path.name for path in root.iterdir() if path.is_dir() and not path.name.startswith(("_", "."))}


def package_folders() -> set[str]:
    return {name for name in folders(PACKAGE) if (PACKAGE / name / "__init__.py").exists()}


def root_modules() -> set[str]:
    return {path.stem for path in [*PACKAGE.glob("*.py"), *PACKAGE.glob("*.c")] if not path.stem.startswith("_")}


def test_every_package_folder_has_its_test_folder() -> None:
    missing = sorted(f"tests/{TESTED_IN.get(name, name)}/" for name in package_folders())
    missing = [folder for folder in missing if not (TESTS.parent / folder).is_dir()]
    assert missing == [], f"add {missing}: tests/ mirrors src/routereplay/ (or name the folder in TESTED_IN)"


def test_every_test_folder_is_a_package_folders_or_says_what_it_holds() -> None:
    stray = sorted(folders(TESTS) - package_folders() - set(NOT_A_PACKAGE))
    stray_paths = [f"tests/{name}/" for name in stray]
    assert stray == [], f"{stray_paths} mirror no package folder: rename, or say what each holds in NOT_A_PACKAGE"


def test_every_test_folder_is_a_python_package() -> None:
    loose = sorted(
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("*")
        if path.is_dir()
        and "data" not in path.relative_to(TESTS).parts
        and not any(part.startswith(("_", ".")) for part in path.relative_to(TESTS).parts)
        and any(path.glob("*.py"))
        and not (path / "__init__.py").exists()
    )
    assert loose == [], f"add __init__.py to {loose}: test modules of the same name in two folders must not clash"


def test_top_level_test_files_test_a_root_module_or_the_repository() -> None:
    named = {path.stem.removeprefix("test_") for path in TESTS.glob("test_*.py")}
    stray = sorted(named - root_modules() - REPO_WIDE)
    assert stray == [], f"move tests/test_{{{','.join(stray)}}}.py into the folder of the package they test"


def test_no_test_is_named_after_an_issue() -> None:
    named = sorted(
        f"{path.relative_to(TESTS)}: {match.group(0)}..."
        for path in TESTS.rglob("test_*.py")
        for match in [ISSUE_NAME.search(path.name.removesuffix(".py")), ISSUE_NAME.search(path.read_text("utf-8"))]
        if match
    )
    assert named == [], f"name these after the behaviour they check, not an issue: {named}"


def test_the_issue_name_pattern_finds_issue_names() -> None:
    assert ISSUE_NAME.search("def test_item31_wrong_top_k() -> None:")
    assert ISSUE_NAME.search("test_issue11_cli")
    assert not ISSUE_NAME.search("def test_items_are_sorted() -> None:")
    assert not ISSUE_NAME.search('"""Issue 11 item 3 (concurrency): ..."""')
